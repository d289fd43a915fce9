-- The audit log: one row per completion, successful or not, saying which
-- tenant's request went to which adapter version on which worker.
--
-- Rows are facts about the past, so they carry copies (model name, adapter
-- name and version, base hash, worker id) rather than foreign keys: a row
-- must be insertable when replayed from a gateway's spool long after the
-- request, whatever happened to the registry since. request_id is unique so
-- that a replay is idempotent (INSERT ... ON CONFLICT DO NOTHING).

CREATE TYPE audit_status AS ENUM (
    -- The completion finished (finish_reason says how).
    'ok',
    -- The client went away or cancelled.
    'cancelled',
    -- Refused before reaching a worker: auth, quota, validation, routing.
    'rejected',
    -- Failed at or after the worker.
    'error'
);

CREATE TABLE audit_log (
    id                 BIGINT       GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The gateway's id for the request; the same id travels to the worker.
    request_id         UUID         NOT NULL,
    received_at        TIMESTAMPTZ  NOT NULL,
    completed_at       TIMESTAMPTZ  NOT NULL,
    -- NULL only for a request refused before its tenant was known.
    tenant_id          UUID,
    -- The API key used, or NULL for a JWT (then subject holds its sub).
    api_key_id         UUID,
    subject            TEXT,
    -- What was asked for, and which route and revision it resolved to.
    model_name         TEXT         NOT NULL,
    route_id           UUID,
    route_revision     INTEGER,
    -- The adapter version served; all NULL for the base model.
    lora_int_id        BIGINT,
    adapter_name       TEXT,
    adapter_version    INTEGER,
    base_hash          TEXT,
    -- The worker that ran it, and where the adapter was when it arrived.
    worker_id          TEXT,
    adapter_residency  TEXT,
    status             audit_status NOT NULL,
    -- The HTTP status returned to the client.
    http_status        SMALLINT     NOT NULL,
    -- A stable error code such as "model_not_found"; NULL when ok.
    error_code         TEXT,
    -- "stop" or "length" when status is ok.
    finish_reason      TEXT,
    prompt_tokens      INTEGER      NOT NULL DEFAULT 0,
    completion_tokens  INTEGER      NOT NULL DEFAULT 0,
    -- Microseconds from receipt to the last byte, and to the first token.
    latency_us         BIGINT       NOT NULL,
    ttft_us            BIGINT,
    -- How many workers were tried before one answered.
    attempts           SMALLINT     NOT NULL DEFAULT 1,
    CONSTRAINT audit_log_request_id_unique UNIQUE (request_id),
    CONSTRAINT audit_log_time_order CHECK (completed_at >= received_at),
    CONSTRAINT audit_log_http_status_range CHECK (http_status BETWEEN 100 AND 599),
    CONSTRAINT audit_log_finish_reason_known CHECK (finish_reason IN ('stop', 'length')),
    CONSTRAINT audit_log_ok_has_finish_reason CHECK ((status = 'ok') = (finish_reason IS NOT NULL)),
    CONSTRAINT audit_log_tokens_non_negative CHECK (prompt_tokens >= 0 AND completion_tokens >= 0),
    CONSTRAINT audit_log_latency_non_negative CHECK (latency_us >= 0 AND (ttft_us IS NULL OR ttft_us >= 0)),
    CONSTRAINT audit_log_attempts_non_negative CHECK (attempts >= 0),
    CONSTRAINT audit_log_adapter_complete CHECK (
        (lora_int_id IS NULL) = (adapter_name IS NULL)
        AND (lora_int_id IS NULL) = (adapter_version IS NULL)
    ),
    CONSTRAINT audit_log_residency_known CHECK (
        adapter_residency IN ('device', 'host', 'not_loaded', 'loading')
    )
);

-- Compliance reads by tenant or by adapter over a time range, newest first,
-- with keyset pagination on (received_at, id).
CREATE INDEX audit_log_tenant_time ON audit_log (tenant_id, received_at DESC, id DESC);
CREATE INDEX audit_log_adapter_time ON audit_log (lora_int_id, received_at DESC, id DESC)
    WHERE lora_int_id IS NOT NULL;
CREATE INDEX audit_log_api_key_time ON audit_log (api_key_id, received_at DESC, id DESC)
    WHERE api_key_id IS NOT NULL;
-- Rows arrive roughly in time order, so a BRIN index serves time-only ranges
-- at a tiny size.
CREATE INDEX audit_log_received_at_brin ON audit_log USING brin (received_at);

-- The log is append-only: a row, once written, is never edited.
CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_log is append-only'
        USING ERRCODE = 'restrict_violation', CONSTRAINT = 'audit_log_append_only';
END;
$$;

CREATE TRIGGER audit_log_append_only
    BEFORE UPDATE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION audit_log_append_only();
