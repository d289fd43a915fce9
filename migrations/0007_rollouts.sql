-- Progressive rollouts: a candidate adapter version takes a route step by
-- step (1%, 10%, 50%, 100%, say), each step held for a while and judged by
-- gates that compare it with the stable version over the step's window,
-- from the audit log. One gateway replica at a time drives them, chosen by
-- a lease row.

CREATE TYPE rollout_state AS ENUM ('running', 'paused', 'succeeded', 'rolled_back', 'aborted');

CREATE TABLE rollouts (
    id                      UUID          PRIMARY KEY DEFAULT gen_random_uuid(),
    route_id                UUID          NOT NULL,
    stable_lora_int_id      BIGINT        NOT NULL,
    candidate_lora_int_id   BIGINT        NOT NULL,
    -- The candidate's share at each step, in basis points, rising to 10000.
    steps_bp                INTEGER[]     NOT NULL,
    hold_secs               INTEGER       NOT NULL,
    min_requests            INTEGER       NOT NULL,
    max_error_rate_increase DOUBLE PRECISION NOT NULL,
    max_ttft_p95_ratio      DOUBLE PRECISION NOT NULL,
    max_tpot_p95_ratio      DOUBLE PRECISION NOT NULL,
    -- The step being held (an index into steps_bp), and since when: its
    -- window starts then.
    step_index              INTEGER       NOT NULL DEFAULT 0,
    step_started_at         TIMESTAMPTZ   NOT NULL DEFAULT now(),
    state                   rollout_state NOT NULL DEFAULT 'running',
    -- Why it ended (a failed gate's figures, or who aborted it).
    reason                  TEXT,
    created_by              TEXT          NOT NULL,
    created_at              TIMESTAMPTZ   NOT NULL DEFAULT now(),
    updated_at              TIMESTAMPTZ   NOT NULL DEFAULT now(),
    CONSTRAINT rollouts_route_fk FOREIGN KEY (route_id) REFERENCES routes (id),
    CONSTRAINT rollouts_stable_fk FOREIGN KEY (stable_lora_int_id) REFERENCES adapters (lora_int_id),
    CONSTRAINT rollouts_candidate_fk FOREIGN KEY (candidate_lora_int_id) REFERENCES adapters (lora_int_id),
    CONSTRAINT rollouts_two_versions CHECK (stable_lora_int_id <> candidate_lora_int_id),
    CONSTRAINT rollouts_steps_shape CHECK (
        cardinality(steps_bp) BETWEEN 2 AND 20 AND steps_bp[cardinality(steps_bp)] = 10000),
    CONSTRAINT rollouts_step_index_range CHECK (step_index >= 0 AND step_index < cardinality(steps_bp)),
    CONSTRAINT rollouts_hold_positive CHECK (hold_secs > 0),
    CONSTRAINT rollouts_min_requests_positive CHECK (min_requests > 0)
);

-- At most one rollout in progress per route.
CREATE UNIQUE INDEX rollouts_one_active_per_route ON rollouts (route_id)
    WHERE state IN ('running', 'paused');

-- Every decision, with the figures it was taken on.
CREATE TABLE rollout_decisions (
    id          BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    rollout_id  UUID        NOT NULL REFERENCES rollouts (id),
    at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- advance, succeed, roll_back, pause, resume, abort
    decision    TEXT        NOT NULL,
    step_index  INTEGER     NOT NULL,
    -- The route revision the decision wrote, if it wrote one.
    revision    INTEGER,
    actor       TEXT        NOT NULL,
    figures     JSONB,
    reason      TEXT
);
CREATE INDEX rollout_decisions_rollout ON rollout_decisions (rollout_id, id);

-- Leases for singleton work among gateway replicas: the holder renews its
-- row before it expires; another replica takes it only once it has.
CREATE TABLE controller_leases (
    name       TEXT        PRIMARY KEY,
    holder     TEXT        NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);

GRANT SELECT, INSERT, UPDATE ON rollouts, controller_leases TO lorafleet_admin;
GRANT SELECT, INSERT ON rollout_decisions TO lorafleet_admin;
