-- The copies of a request's adapter into a device slot charged to it
-- (each copy's time split evenly among the live requests of the adapter),
-- kept beside its forward-pass time, and rolled up per hour as
-- device_us is.
ALTER TABLE audit_log ADD COLUMN load_us bigint;
ALTER TABLE usage_hourly ADD COLUMN load_us BIGINT NOT NULL DEFAULT 0;

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
    RETURN NULL;
END
$$;
