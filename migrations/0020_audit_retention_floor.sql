-- A floor under audit retention, kept inside the database: the admin
-- plane's role (lorafleet_admin) may retire partitions older than
-- `keep_days`, but never with `keep_days` below this floor, so a stolen
-- admin login or a mistyped flag cannot erase recent history. Only the
-- schema owner (the migration role) changes the floor; the admin role can
-- read it.
CREATE TABLE audit_retention_floor (
    only_row      BOOLEAN PRIMARY KEY DEFAULT true,
    min_keep_days INTEGER NOT NULL,
    CONSTRAINT audit_retention_floor_one_row CHECK (only_row),
    CONSTRAINT audit_retention_floor_positive CHECK (min_keep_days >= 1)
);
INSERT INTO audit_retention_floor (min_keep_days) VALUES (30);

REVOKE ALL ON audit_retention_floor FROM PUBLIC;
GRANT SELECT ON audit_retention_floor TO lorafleet_admin;

-- As 0014's, refusing `keep_days` below the floor.
CREATE OR REPLACE FUNCTION audit_log_retire_partitions(keep_days INTEGER, actor TEXT, request_id UUID)
RETURNS TABLE (name TEXT, from_time TIMESTAMPTZ, to_time TIMESTAMPTZ, estimated_rows BIGINT)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET lock_timeout = '2s' AS $$
DECLARE
    horizon TIMESTAMPTZ;
    floor_days INTEGER;
    p RECORD;
BEGIN
    IF keep_days IS NULL OR keep_days < 1 THEN
        RAISE EXCEPTION 'keep_days must be at least 1, got %', keep_days
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT min_keep_days INTO floor_days FROM audit_retention_floor;
    IF floor_days IS NOT NULL AND keep_days < floor_days THEN
        RAISE EXCEPTION 'keep_days % is below the retention floor of % days (audit_retention_floor, set by the schema owner)',
            keep_days, floor_days
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
