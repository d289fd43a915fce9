-- The audit log as compliance can trust it: who asked (the OpenAI `user`
-- field and the credential's prefix), a dead-letter table for rows that
-- Postgres refused as data, and roles that let the serving processes write
-- rows but never erase them.

-- The OpenAI `user` field as the client sent it (capped and made safe by
-- the gateway), and the prefix of the API key used (NULL for a JWT, whose
-- `sub` is in `subject`). Copies, like every other column of the log.
ALTER TABLE audit_log
    ADD COLUMN end_user TEXT,
    ADD COLUMN api_key_prefix TEXT;

-- Rows Postgres refused as data (SQLSTATE classes 22 and 23) and spool
-- lines that could not be read back. Nothing is dropped silently: what could
-- not become an audit row is kept here, byte for byte, with the reason.
CREATE TABLE audit_dead_letter (
    id             BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    quarantined_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- 'insert': a row refused by audit_log; 'spool': a spool line that was
    -- torn, not UTF-8 or not a row.
    source         TEXT        NOT NULL,
    -- Where it came from, unique so that quarantining it again (a retry
    -- after an outage) keeps one copy: 'insert:<request id>' or
    -- 'spool:<owner>/<segment>:<byte offset>'.
    origin         TEXT        NOT NULL,
    -- The row's request id when it could be read.
    request_id     UUID,
    -- Postgres's error, or why the line was unreadable.
    reason         TEXT        NOT NULL,
    -- The row as JSON, or the spool line as it was on disk (bytea: a line
    -- may hold bytes that no text column accepts).
    payload        BYTEA       NOT NULL,
    CONSTRAINT audit_dead_letter_source_known CHECK (source IN ('insert', 'spool')),
    CONSTRAINT audit_dead_letter_origin_unique UNIQUE (origin)
);

CREATE INDEX audit_dead_letter_at ON audit_dead_letter (quarantined_at DESC, id DESC);

CREATE FUNCTION audit_dead_letter_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_dead_letter is append-only'
        USING ERRCODE = 'restrict_violation', CONSTRAINT = 'audit_dead_letter_append_only';
END;
$$;

CREATE TRIGGER audit_dead_letter_append_only
    BEFORE UPDATE OR DELETE ON audit_dead_letter
    FOR EACH ROW EXECUTE FUNCTION audit_dead_letter_append_only();

-- Roles. The migration runs as the schema owner; the serving processes log
-- in as members of these roles, which own nothing, so they cannot TRUNCATE,
-- ALTER or disable triggers:
--   lorafleet_runtime: the gateway's request path (registry snapshot reads,
--     audit inserts, dead letters);
--   lorafleet_admin: the admin API (registry changes with their
--     admin_changes rows, audit reads).
-- Roles belong to the whole server, so creating them tolerates a concurrent
-- migration of another database, and a role created beforehand by a DBA
-- (then the owner needs no CREATEROLE).
DO $$
DECLARE
    r TEXT;
BEGIN
    FOREACH r IN ARRAY ARRAY['lorafleet_runtime', 'lorafleet_admin'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;
            END;
        END IF;
    END LOOP;
    -- PUBLIC may connect by default; where a DBA revoked that, the owner
    -- may lack the right to grant it, and the DBA grants it instead.
    BEGIN
        EXECUTE format('GRANT CONNECT ON DATABASE %I TO lorafleet_runtime, lorafleet_admin',
                       current_database());
    EXCEPTION WHEN insufficient_privilege THEN
        RAISE NOTICE 'GRANT CONNECT skipped: % may not grant it', current_user;
    END;
END;
$$;

GRANT USAGE ON SCHEMA public TO lorafleet_runtime, lorafleet_admin;

GRANT SELECT ON tenants, api_keys, base_models, adapters, routes, route_revisions, route_weights
    TO lorafleet_runtime;
GRANT SELECT, INSERT ON audit_log TO lorafleet_runtime;
GRANT INSERT ON audit_dead_letter TO lorafleet_runtime;

GRANT SELECT, INSERT, UPDATE
    ON tenants, api_keys, base_models, adapters, routes, route_revisions, route_weights
    TO lorafleet_admin;
GRANT SELECT, INSERT ON admin_changes TO lorafleet_admin;
GRANT SELECT ON audit_log, audit_dead_letter TO lorafleet_admin;
