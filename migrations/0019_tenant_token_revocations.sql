-- Tenant JWTs revoked before they expire: a deny-list of their `jti`
-- claims, loaded with every replica's registry snapshot as admin token
-- revocations are (honoured fleet-wide within the reload time). A row is
-- kept until the token's own expiry; a later revocation of the same jti
-- extends it.
CREATE TABLE tenant_token_revocations (
    jti        TEXT        PRIMARY KEY,
    expires_at TIMESTAMPTZ NOT NULL,
    revoked_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- The admin subject that revoked it.
    revoked_by TEXT        NOT NULL,
    CONSTRAINT tenant_token_revocations_jti_length CHECK (length(jti) BETWEEN 1 AND 256)
);

GRANT SELECT ON tenant_token_revocations TO lorafleet_runtime;
GRANT SELECT, INSERT, UPDATE ON tenant_token_revocations TO lorafleet_admin;
