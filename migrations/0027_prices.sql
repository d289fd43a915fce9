-- Prices for chargeback. A base model's price is per hour of its
-- workers' device time (the audit log's device_us); a route's, optional,
-- per million prompt and per million completion tokens. Each row is a
-- price from `effective_at` (a whole UTC hour, the rollups' grain) until
-- the next row for the same base model or route: a change is a new row,
-- and the history stays (the admin change log has each one). A route's
-- row states both token prices from its time on (one left out costs
-- nothing). One currency, the platform's.
CREATE TABLE prices (
    id                     UUID          PRIMARY KEY DEFAULT gen_random_uuid(),
    base_model             TEXT          REFERENCES base_models (name),
    route_id               UUID          REFERENCES routes (id),
    effective_at           TIMESTAMPTZ   NOT NULL,
    device_hour            NUMERIC(24, 9),
    prompt_per_million     NUMERIC(24, 9),
    completion_per_million NUMERIC(24, 9),
    created_at             TIMESTAMPTZ   NOT NULL DEFAULT now(),
    created_by             TEXT          NOT NULL,
    CONSTRAINT prices_one_subject CHECK ((base_model IS NULL) <> (route_id IS NULL)),
    CONSTRAINT prices_of_base_models CHECK (
        base_model IS NULL
        OR (device_hour IS NOT NULL AND prompt_per_million IS NULL
            AND completion_per_million IS NULL)),
    CONSTRAINT prices_of_routes CHECK (
        route_id IS NULL
        OR (device_hour IS NULL
            AND (prompt_per_million IS NOT NULL OR completion_per_million IS NOT NULL))),
    CONSTRAINT prices_not_negative CHECK (
        coalesce(device_hour, 0) >= 0 AND coalesce(prompt_per_million, 0) >= 0
        AND coalesce(completion_per_million, 0) >= 0),
    CONSTRAINT prices_whole_hours CHECK (effective_at = date_trunc('hour', effective_at, 'UTC')),
    CONSTRAINT prices_one_per_time UNIQUE NULLS NOT DISTINCT (base_model, route_id, effective_at)
);

CREATE INDEX prices_by_base_model ON prices (base_model, effective_at) WHERE base_model IS NOT NULL;
CREATE INDEX prices_by_route ON prices (route_id, effective_at) WHERE route_id IS NOT NULL;

-- Prices are history: a row is never changed or deleted.
CREATE FUNCTION prices_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'a price is history: set a new one from a later time instead'
        USING ERRCODE = 'restrict_violation', CONSTRAINT = 'prices_immutable';
END
$$;
CREATE TRIGGER prices_immutable BEFORE UPDATE OR DELETE ON prices
    FOR EACH ROW EXECUTE FUNCTION prices_immutable();

GRANT SELECT, INSERT ON prices TO lorafleet_admin;
-- A tenant's own report (GET /v1/usage) shows its cost.
GRANT SELECT ON prices TO lorafleet_runtime;
