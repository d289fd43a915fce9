-- Usage per hour, tenant, route, adapter version and base model, kept as
-- audit rows land, so that a month's report reads a few hundred rows per
-- tenant instead of the log. A statement-level trigger on audit_log adds
-- each statement's new rows into their hours (through the statement's
-- transition table: a replay that inserts nothing adds nothing, and a row
-- is counted once whichever partition it lands in). The rows outlive the
-- log's partitions: retiring a day of the log keeps its usage.
--
-- requests counts what the audit rows stand for (occurrences: an
-- aggregated row of failed authentications stands for several); the
-- evaluation traffic of rollouts (subject 'rollout-evaluator') is kept
-- apart from tenants'. Hours are UTC.

CREATE TABLE usage_hourly (
    hour               TIMESTAMPTZ  NOT NULL,
    tenant_id          UUID,
    route_id           UUID,
    lora_int_id        BIGINT,
    base_hash          TEXT,
    evaluation         BOOLEAN      NOT NULL,
    status             audit_status NOT NULL,
    requests           BIGINT       NOT NULL,
    prompt_tokens      BIGINT       NOT NULL,
    completion_tokens  BIGINT       NOT NULL,
    cached_tokens      BIGINT       NOT NULL,
    -- The workers' forward-pass time (audit_log.device_us), summed.
    device_us          BIGINT       NOT NULL,
    CONSTRAINT usage_hourly_key UNIQUE NULLS NOT DISTINCT
        (hour, tenant_id, route_id, lora_int_id, base_hash, evaluation, status)
);

CREATE INDEX usage_hourly_by_tenant ON usage_hourly (tenant_id, hour);

-- Adds a statement's new audit rows to their hours. Runs as the schema
-- owner, so the serving role needs no right on usage_hourly. Groups are
-- upserted in key order, so two gateways' statements lock them in one
-- order.
CREATE FUNCTION audit_log_roll_up() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    INSERT INTO usage_hourly AS u (hour, tenant_id, route_id, lora_int_id, base_hash,
                                   evaluation, status, requests, prompt_tokens,
                                   completion_tokens, cached_tokens, device_us)
    SELECT date_trunc('hour', received_at, 'UTC'), tenant_id, route_id, lora_int_id,
           base_hash, coalesce(subject = 'rollout-evaluator', false), status,
           sum(occurrences), sum(prompt_tokens), sum(completion_tokens),
           sum(cached_tokens), coalesce(sum(device_us), 0)
      FROM new_rows
     GROUP BY 1, 2, 3, 4, 5, 6, 7
     ORDER BY 1, 2, 3, 4, 5, 6, 7
    ON CONFLICT ON CONSTRAINT usage_hourly_key DO UPDATE SET
        requests = u.requests + EXCLUDED.requests,
        prompt_tokens = u.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = u.completion_tokens + EXCLUDED.completion_tokens,
        cached_tokens = u.cached_tokens + EXCLUDED.cached_tokens,
        device_us = u.device_us + EXCLUDED.device_us;
    RETURN NULL;
END
$$;

CREATE TRIGGER audit_log_usage AFTER INSERT ON audit_log
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION audit_log_roll_up();

-- The rows already in the log, when it is small enough to read under the
-- trigger's lock (inserts wait for this migration). A larger log is left
-- for an online backfill, and said so.
DO $$
BEGIN
    IF (SELECT count(*) FROM (SELECT 1 FROM audit_log LIMIT 100001) s) <= 100000 THEN
        INSERT INTO usage_hourly (hour, tenant_id, route_id, lora_int_id, base_hash,
                                  evaluation, status, requests, prompt_tokens,
                                  completion_tokens, cached_tokens, device_us)
        SELECT date_trunc('hour', received_at, 'UTC'), tenant_id, route_id, lora_int_id,
               base_hash, coalesce(subject = 'rollout-evaluator', false), status,
               sum(occurrences), sum(prompt_tokens), sum(completion_tokens),
               sum(cached_tokens), coalesce(sum(device_us), 0)
          FROM audit_log
         GROUP BY 1, 2, 3, 4, 5, 6, 7;
    ELSE
        RAISE NOTICE 'usage_hourly: the audit log holds over 100000 rows; its usage before this migration is not rolled up';
    END IF;
END
$$;

GRANT SELECT ON usage_hourly TO lorafleet_admin;
