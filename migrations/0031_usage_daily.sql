-- Usage per UTC day beside the hourly rollup, kept by the same trigger, so
-- a report by day or over a whole span reads a row per day instead of 24:
-- a tenant's month of 100 adapters is 3,000 rows here against 72,000
-- hourly. Reports read a day's row only when no price starts inside that
-- day (prices start on whole hours, and a day's hours then share its first
-- hour's prices); a day with a change, and the hours of a span's partial
-- first and last days, are read from usage_hourly.
--
-- Writes to the log wait for this migration, so the backfill from the
-- hourly rows sees every row the trigger added before it and the trigger
-- adds every row after it.
LOCK TABLE audit_log IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE usage_daily (
    day                TIMESTAMPTZ  NOT NULL,
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
    device_us          BIGINT       NOT NULL,
    load_us            BIGINT       NOT NULL,
    CONSTRAINT usage_daily_whole_days CHECK (day = date_trunc('day', day, 'UTC')),
    CONSTRAINT usage_daily_key UNIQUE NULLS NOT DISTINCT
        (day, tenant_id, route_id, lora_int_id, base_hash, evaluation, status)
);

CREATE INDEX usage_daily_by_tenant ON usage_daily (tenant_id, day);

INSERT INTO usage_daily (day, tenant_id, route_id, lora_int_id, base_hash, evaluation, status,
                         requests, prompt_tokens, completion_tokens, cached_tokens, device_us,
                         load_us)
SELECT date_trunc('day', hour, 'UTC'), tenant_id, route_id, lora_int_id, base_hash, evaluation,
       status, sum(requests), sum(prompt_tokens), sum(completion_tokens), sum(cached_tokens),
       sum(device_us), sum(load_us)
  FROM usage_hourly
 GROUP BY 1, 2, 3, 4, 5, 6, 7;

-- Each statement's new rows into their hours and their days, each in key
-- order (two gateways' statements lock the groups in one order).
CREATE OR REPLACE FUNCTION audit_log_roll_up() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    INSERT INTO usage_hourly AS u (hour, tenant_id, route_id, lora_int_id, base_hash,
                                   evaluation, status, requests, prompt_tokens,
                                   completion_tokens, cached_tokens, device_us, load_us)
    SELECT date_trunc('hour', received_at, 'UTC'), tenant_id, route_id, lora_int_id,
           base_hash, coalesce(subject = 'rollout-evaluator', false), status,
           sum(occurrences), sum(prompt_tokens), sum(completion_tokens),
           sum(cached_tokens), coalesce(sum(device_us), 0), coalesce(sum(load_us), 0)
      FROM new_rows
     GROUP BY 1, 2, 3, 4, 5, 6, 7
     ORDER BY 1, 2, 3, 4, 5, 6, 7
    ON CONFLICT ON CONSTRAINT usage_hourly_key DO UPDATE SET
        requests = u.requests + EXCLUDED.requests,
        prompt_tokens = u.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = u.completion_tokens + EXCLUDED.completion_tokens,
        cached_tokens = u.cached_tokens + EXCLUDED.cached_tokens,
        device_us = u.device_us + EXCLUDED.device_us,
        load_us = u.load_us + EXCLUDED.load_us;
    INSERT INTO usage_daily AS d (day, tenant_id, route_id, lora_int_id, base_hash,
                                  evaluation, status, requests, prompt_tokens,
                                  completion_tokens, cached_tokens, device_us, load_us)
    SELECT date_trunc('day', received_at, 'UTC'), tenant_id, route_id, lora_int_id,
           base_hash, coalesce(subject = 'rollout-evaluator', false), status,
           sum(occurrences), sum(prompt_tokens), sum(completion_tokens),
           sum(cached_tokens), coalesce(sum(device_us), 0), coalesce(sum(load_us), 0)
      FROM new_rows
     GROUP BY 1, 2, 3, 4, 5, 6, 7
     ORDER BY 1, 2, 3, 4, 5, 6, 7
    ON CONFLICT ON CONSTRAINT usage_daily_key DO UPDATE SET
        requests = d.requests + EXCLUDED.requests,
        prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
        cached_tokens = d.cached_tokens + EXCLUDED.cached_tokens,
        device_us = d.device_us + EXCLUDED.device_us,
        load_us = d.load_us + EXCLUDED.load_us;
    RETURN NULL;
END
$$;

GRANT SELECT ON usage_daily TO lorafleet_admin, lorafleet_runtime;
