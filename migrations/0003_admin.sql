-- The admin plane's own record: one row per change an admin made through
-- the admin API, with who, what, when, and the object before and after.
-- Like the audit log, it is append-only.

CREATE TABLE admin_changes (
    id          BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- The admin token's subject and role.
    actor       TEXT        NOT NULL,
    role        TEXT        NOT NULL,
    -- What was done, such as "tenant.create" or "route.promote".
    action      TEXT        NOT NULL,
    -- The object it was done to, such as ("route", "acme/support").
    object_type TEXT        NOT NULL,
    object_id   TEXT        NOT NULL,
    -- NULL before a creation. Secrets never appear here: an API key is
    -- recorded by its prefix.
    before      JSONB,
    after       JSONB,
    -- The admin request's id, also in its response and logs.
    request_id  UUID        NOT NULL,
    CONSTRAINT admin_changes_actor_present CHECK (actor <> ''),
    CONSTRAINT admin_changes_action_format CHECK (action ~ '^[a-z_]+\.[a-z_]+$')
);

CREATE INDEX admin_changes_at ON admin_changes (at DESC, id DESC);
CREATE INDEX admin_changes_object ON admin_changes (object_type, object_id, at DESC);

CREATE FUNCTION admin_changes_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'admin_changes is append-only'
        USING ERRCODE = 'restrict_violation', CONSTRAINT = 'admin_changes_append_only';
END;
$$;

CREATE TRIGGER admin_changes_append_only
    BEFORE UPDATE OR DELETE ON admin_changes
    FOR EACH ROW EXECUTE FUNCTION admin_changes_append_only();

-- The audit log is append-only for deletes too, not only for updates.
CREATE TRIGGER audit_log_no_delete
    BEFORE DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION audit_log_append_only();

-- Compliance filters by model and worker within a tenant's time range; the
-- tenant index narrows to the range, these serve the fleet-wide questions.
CREATE INDEX audit_log_worker_time ON audit_log (worker_id, received_at DESC, id DESC)
    WHERE worker_id IS NOT NULL;
