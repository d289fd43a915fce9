-- Evaluation sets: a route's own items (multiple choice, or generation
-- with an expected answer), registered by an admin, immutable, named and
-- versioned per route like adapters. A rollout may name one: the
-- controller scores the candidate and the stable version on it before
-- the candidate takes any traffic, and keeps every item's outcome.

CREATE TABLE eval_sets (
    id          UUID        PRIMARY KEY DEFAULT gen_random_uuid(),
    route_id    UUID        NOT NULL REFERENCES routes (id),
    name        TEXT        NOT NULL,
    version     INTEGER     NOT NULL,
    -- SHA-256 of the file as registered.
    sha256      TEXT        NOT NULL,
    -- The items as the gateway read them (kind, prompt, choices, answer,
    -- expected, match, max_tokens, stop).
    items       JSONB       NOT NULL,
    item_count  INTEGER     NOT NULL,
    bytes       INTEGER     NOT NULL,
    created_by  TEXT        NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT eval_sets_name_format CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,63}$'),
    CONSTRAINT eval_sets_name_version_unique UNIQUE (route_id, name, version),
    CONSTRAINT eval_sets_version_positive CHECK (version > 0),
    CONSTRAINT eval_sets_sha256_format CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    CONSTRAINT eval_sets_items_shape CHECK (
        jsonb_typeof(items) = 'array' AND item_count > 0 AND jsonb_array_length(items) = item_count)
);

CREATE FUNCTION eval_sets_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%: evaluation sets and their results are immutable; register a new version instead',
        TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation', CONSTRAINT = TG_TABLE_NAME || '_immutable';
END;
$$;

CREATE TRIGGER eval_sets_immutable
    BEFORE UPDATE OR DELETE ON eval_sets
    FOR EACH ROW EXECUTE FUNCTION eval_sets_immutable();

-- A rollout's evaluation: the set, the score delta the candidate must
-- reach over the stable version, the seed of its requests, and the two
-- scores once known.
ALTER TABLE rollouts
    ADD COLUMN eval_set_id     UUID REFERENCES eval_sets (id),
    ADD COLUMN min_score_delta DOUBLE PRECISION,
    ADD COLUMN eval_seed       BIGINT,
    ADD COLUMN stable_score    DOUBLE PRECISION,
    ADD COLUMN candidate_score DOUBLE PRECISION,
    ADD CONSTRAINT rollouts_eval_complete CHECK (
        (eval_set_id IS NULL) = (min_score_delta IS NULL)
        AND (eval_set_id IS NULL) = (eval_seed IS NULL)),
    ADD CONSTRAINT rollouts_min_score_delta_range CHECK (min_score_delta BETWEEN -1 AND 1),
    ADD CONSTRAINT rollouts_evaluating_has_set CHECK (state <> 'evaluating' OR eval_set_id IS NOT NULL);

-- At most one rollout in progress per route, evaluating included.
DROP INDEX rollouts_one_active_per_route;
CREATE UNIQUE INDEX rollouts_one_active_per_route ON rollouts (route_id)
    WHERE state IN ('evaluating', 'running', 'paused');

-- One row per (rollout, version, item): what the version answered and
-- whether it was right, with the audit rows of its requests. Written as
-- items are scored, so a controller that takes over goes on where the
-- last one stopped.
CREATE TABLE rollout_eval_results (
    rollout_id  UUID        NOT NULL REFERENCES rollouts (id),
    lora_int_id BIGINT      NOT NULL REFERENCES adapters (lora_int_id),
    item_index  INTEGER     NOT NULL,
    correct     BOOLEAN     NOT NULL,
    outcome     JSONB       NOT NULL,
    request_ids UUID[]      NOT NULL,
    at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (rollout_id, lora_int_id, item_index),
    CONSTRAINT rollout_eval_results_item_index CHECK (item_index >= 0)
);

CREATE TRIGGER rollout_eval_results_immutable
    BEFORE UPDATE OR DELETE ON rollout_eval_results
    FOR EACH ROW EXECUTE FUNCTION eval_sets_immutable();

GRANT SELECT, INSERT ON eval_sets, rollout_eval_results TO lorafleet_admin;
