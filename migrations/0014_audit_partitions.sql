-- The audit log, partitioned by day on received_at, so that it can hold a
-- billion rows: a query over a time range reads only that range's
-- partitions, and retention drops whole days instead of deleting rows.
--
-- The rows already in the log are not copied. The table that held them
-- becomes the first partition, audit_log_legacy, covering every time before
-- the cutover (a day boundary); from the cutover on, each UTC day has its
-- own partition audit_log_pYYYYMMDD. Attaching the old table reuses its
-- indexes and, through the CHECK constraint audit_log_before_partitions,
-- skips scanning it, so the only lock this migration holds on the log lasts
-- milliseconds. What takes time on a large table (a unique index on
-- (request_id, received_at), validating the CHECK) is done beforehand,
-- without blocking writes, by `lorafleet-gateway migrate`
-- (gateway/src/audit/partitions.rs, prepare_online); on a small or empty
-- table this migration does it itself.
--
-- The unique key becomes (request_id, received_at): a partitioned table's
-- unique constraints include its partition key. A replayed row carries the
-- received_at it was first written with, so a replay still finds its row
-- (INSERT ... ON CONFLICT (request_id, received_at) DO NOTHING).
--
-- Partitions are made ahead and retired by two functions that run as the
-- schema owner (SECURITY DEFINER) and that only lorafleet_admin may call:
-- the serving role can insert rows and read them, nothing else.

DO $$
DECLARE
    cutover TIMESTAMPTZ;
    def TEXT;
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = 'audit_log'::regclass) = 'p' THEN
        RETURN;
    END IF;
    SET LOCAL lock_timeout = '10s';
    -- The cutover: from prepare_online's CHECK when it ran, else two days
    -- from today (UTC), so that rows received until then still belong to
    -- the old table.
    SELECT pg_get_constraintdef(oid) INTO def FROM pg_constraint
     WHERE conrelid = 'audit_log'::regclass AND conname = 'audit_log_before_partitions';
    IF def IS NULL THEN
        cutover := date_trunc('day', now(), 'UTC') + interval '2 days';
        EXECUTE format('ALTER TABLE audit_log ADD CONSTRAINT audit_log_before_partitions
                        CHECK (received_at < %L::timestamptz)', cutover);
    ELSE
        cutover := substring(def FROM '''([^'']+)''')::timestamptz;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = 'audit_log'::regclass
                    AND conname = 'audit_log_request_id_received_at') THEN
        IF EXISTS (SELECT 1 FROM pg_class WHERE relname = 'audit_log_request_id_received_at') THEN
            ALTER TABLE audit_log ADD CONSTRAINT audit_log_request_id_received_at
                UNIQUE USING INDEX audit_log_request_id_received_at;
        ELSE
            ALTER TABLE audit_log ADD CONSTRAINT audit_log_request_id_received_at
                UNIQUE (request_id, received_at);
        END IF;
    END IF;

    -- The old table steps aside under its new name, with its indexes,
    -- constraints and triggers renamed so that the log can take theirs.
    ALTER TABLE audit_log RENAME TO audit_log_legacy;
    ALTER TABLE audit_log_legacy ALTER COLUMN id DROP IDENTITY;
    ALTER TABLE audit_log_legacy RENAME CONSTRAINT audit_log_pkey TO audit_log_legacy_pkey;
    ALTER TABLE audit_log_legacy RENAME CONSTRAINT audit_log_request_id_unique
        TO audit_log_legacy_request_id_unique;
    ALTER INDEX audit_log_tenant_time RENAME TO audit_log_legacy_tenant_time;
    ALTER INDEX audit_log_adapter_time RENAME TO audit_log_legacy_adapter_time;
    ALTER INDEX audit_log_api_key_time RENAME TO audit_log_legacy_api_key_time;
    ALTER INDEX audit_log_received_at_brin RENAME TO audit_log_legacy_received_at_brin;
    ALTER INDEX audit_log_worker_time RENAME TO audit_log_legacy_worker_time;
    -- The log's triggers are cloned onto every partition, this one included.
    DROP TRIGGER audit_log_append_only ON audit_log_legacy;
    DROP TRIGGER audit_log_no_delete ON audit_log_legacy;

    -- ids continue where the old table's left off.
    CREATE SEQUENCE audit_log_id_seq AS BIGINT;
    PERFORM setval('audit_log_id_seq', (SELECT coalesce(max(id), 0) + 1 FROM audit_log_legacy), false);

    -- The same columns, defaults and CHECK constraints as before.
    CREATE TABLE audit_log (LIKE audit_log_legacy INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
        PARTITION BY RANGE (received_at);
    ALTER TABLE audit_log DROP CONSTRAINT audit_log_before_partitions;
    ALTER TABLE audit_log ALTER COLUMN id SET DEFAULT nextval('audit_log_id_seq');
    ALTER SEQUENCE audit_log_id_seq OWNED BY audit_log.id;
    ALTER TABLE audit_log ADD CONSTRAINT audit_log_request_id_unique UNIQUE (request_id, received_at);
    -- Compliance reads by tenant, adapter, key or worker over a time range,
    -- newest first, with keyset pagination on (received_at, id).
    CREATE INDEX audit_log_tenant_time ON audit_log (tenant_id, received_at DESC, id DESC);
    CREATE INDEX audit_log_adapter_time ON audit_log (lora_int_id, received_at DESC, id DESC)
        WHERE lora_int_id IS NOT NULL;
    CREATE INDEX audit_log_api_key_time ON audit_log (api_key_id, received_at DESC, id DESC)
        WHERE api_key_id IS NOT NULL;
    CREATE INDEX audit_log_received_at_brin ON audit_log USING brin (received_at);
    CREATE INDEX audit_log_worker_time ON audit_log (worker_id, received_at DESC, id DESC)
        WHERE worker_id IS NOT NULL;
    CREATE TRIGGER audit_log_append_only BEFORE UPDATE ON audit_log
        FOR EACH ROW EXECUTE FUNCTION audit_log_append_only();
    CREATE TRIGGER audit_log_no_delete BEFORE DELETE ON audit_log
        FOR EACH ROW EXECUTE FUNCTION audit_log_append_only();

    EXECUTE format('ALTER TABLE audit_log ATTACH PARTITION audit_log_legacy
                    FOR VALUES FROM (MINVALUE) TO (%L)', cutover);
END;
$$;

GRANT SELECT, INSERT ON audit_log TO lorafleet_runtime;
GRANT SELECT ON audit_log TO lorafleet_admin;
-- Rows reach a partition only through the log.
REVOKE ALL ON audit_log_legacy FROM lorafleet_runtime, lorafleet_admin;
-- A sequence the serving role draws ids from.
GRANT USAGE ON SEQUENCE audit_log_id_seq TO lorafleet_runtime;

-- The log's partitions, oldest first: name, range and estimated rows.
CREATE FUNCTION audit_log_partitions()
RETURNS TABLE (name TEXT, from_time TIMESTAMPTZ, to_time TIMESTAMPTZ, estimated_rows BIGINT)
LANGUAGE sql STABLE SET search_path = public, pg_temp AS $$
    SELECT c.relname::TEXT,
           CASE WHEN b.bound ~ 'MINVALUE' THEN NULL
                ELSE substring(b.bound FROM 'FROM \(''([^'']+)''\)')::timestamptz END,
           substring(b.bound FROM 'TO \(''([^'']+)''\)')::timestamptz,
           greatest(c.reltuples, 0)::BIGINT
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid
      CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
     WHERE i.inhparent = 'audit_log'::regclass
     ORDER BY 3;
$$;

-- Makes each missing day's partition from the newest one's end up to
-- `days_ahead` days after today (UTC); returns the names made. The lock it
-- needs on the log is waited for at most 2 s (then it fails, to be retried)
-- so that it never holds up inserts for longer.
CREATE FUNCTION audit_log_prepare_partitions(days_ahead INTEGER)
RETURNS SETOF TEXT
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET lock_timeout = '2s' AS $$
DECLARE
    d TIMESTAMPTZ;
    last TIMESTAMPTZ := date_trunc('day', now(), 'UTC') + make_interval(days => days_ahead + 1);
    part TEXT;
BEGIN
    IF days_ahead IS NULL OR days_ahead < 1 OR days_ahead > 366 THEN
        RAISE EXCEPTION 'days_ahead must be between 1 and 366, got %', days_ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT max(p.to_time) INTO d FROM audit_log_partitions() p;
    WHILE d < last LOOP
        part := 'audit_log_p' || to_char(d AT TIME ZONE 'UTC', 'YYYYMMDD');
        EXECUTE format('CREATE TABLE %I PARTITION OF audit_log FOR VALUES FROM (%L) TO (%L)',
                       part, d, d + interval '1 day');
        RETURN NEXT part;
        d := d + interval '1 day';
    END LOOP;
END;
$$;

-- Retention: detaches and drops every partition whose whole range is more
-- than `keep_days` days before today (UTC), and records each in
-- admin_changes (action audit_log.retire_partition) in the same
-- transaction, with who asked and the partition's range and estimated
-- rows. Returns what it dropped.
CREATE FUNCTION audit_log_retire_partitions(keep_days INTEGER, actor TEXT, request_id UUID)
RETURNS TABLE (name TEXT, from_time TIMESTAMPTZ, to_time TIMESTAMPTZ, estimated_rows BIGINT)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET lock_timeout = '2s' AS $$
DECLARE
    horizon TIMESTAMPTZ;
    p RECORD;
BEGIN
    IF keep_days IS NULL OR keep_days < 1 THEN
        RAISE EXCEPTION 'keep_days must be at least 1, got %', keep_days
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF actor IS NULL OR actor = '' THEN
        RAISE EXCEPTION 'actor must name who retires partitions'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    horizon := date_trunc('day', now(), 'UTC') - make_interval(days => keep_days);
    FOR p IN SELECT * FROM audit_log_partitions() a WHERE a.to_time <= horizon LOOP
        EXECUTE format('ALTER TABLE audit_log DETACH PARTITION %I', p.name);
        EXECUTE format('DROP TABLE %I', p.name);
        INSERT INTO admin_changes (actor, role, action, object_type, object_id, before, after, request_id)
        VALUES (actor, 'controller', 'audit_log.retire_partition', 'audit_partition', p.name,
                jsonb_build_object('from', p.from_time, 'to', p.to_time,
                                   'estimated_rows', p.estimated_rows,
                                   'keep_days', keep_days),
                NULL, request_id);
        name := p.name;
        from_time := p.from_time;
        to_time := p.to_time;
        estimated_rows := p.estimated_rows;
        RETURN NEXT;
    END LOOP;
END;
$$;

REVOKE ALL ON FUNCTION audit_log_prepare_partitions(INTEGER) FROM PUBLIC;
REVOKE ALL ON FUNCTION audit_log_retire_partitions(INTEGER, TEXT, UUID) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION audit_log_prepare_partitions(INTEGER) TO lorafleet_admin;
GRANT EXECUTE ON FUNCTION audit_log_retire_partitions(INTEGER, TEXT, UUID) TO lorafleet_admin;

-- A week of partitions from the start, so that rows have somewhere to go
-- before a gateway's admin plane first maintains them.
SELECT count(*) FROM audit_log_prepare_partitions(7);
