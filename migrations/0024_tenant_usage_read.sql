-- A tenant reads its own usage through the public gateway (GET /v1/usage),
-- so the serving role reads the hourly rollups; the gateway scopes every
-- such read to the caller's tenant. It writes them only through the audit
-- trigger, whose function runs as its owner.
GRANT SELECT ON usage_hourly TO lorafleet_runtime;
