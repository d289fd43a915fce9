-- What an adapter's artifact held when it was registered: its bytes and
-- its files (objects, in a store). A worker fetching it refuses, from the
-- store's listing, an artifact that holds more, before reading a byte of
-- it. Null for versions registered before sizes were recorded (the
-- fetch's flags bound those).
ALTER TABLE adapters
    ADD COLUMN artifact_bytes BIGINT,
    ADD COLUMN artifact_files INTEGER,
    ADD CONSTRAINT adapters_artifact_size_recorded CHECK (
        (artifact_bytes IS NULL) = (artifact_files IS NULL)
        AND (artifact_bytes IS NULL OR artifact_bytes >= 0)
        AND (artifact_files IS NULL OR artifact_files >= 1)
    );

-- As 0001's: the recorded size is as immutable as the digest.
CREATE OR REPLACE FUNCTION adapters_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'adapter lora_int_id % cannot be deleted; retire it instead', OLD.lora_int_id
            USING ERRCODE = 'restrict_violation', CONSTRAINT = 'adapters_immutable';
    END IF;
    IF (NEW.lora_int_id, NEW.name, NEW.version, NEW.base_model_id, NEW.tenant_id, NEW.rank,
        NEW.alpha, NEW.use_rslora, NEW.target_modules, NEW.artifact_uri, NEW.artifact_sha256,
        NEW.artifact_bytes, NEW.artifact_files, NEW.created_at)
       IS DISTINCT FROM
       (OLD.lora_int_id, OLD.name, OLD.version, OLD.base_model_id, OLD.tenant_id, OLD.rank,
        OLD.alpha, OLD.use_rslora, OLD.target_modules, OLD.artifact_uri, OLD.artifact_sha256,
        OLD.artifact_bytes, OLD.artifact_files, OLD.created_at) THEN
        RAISE EXCEPTION 'adapter lora_int_id % is immutable; register a new version instead', OLD.lora_int_id
            USING ERRCODE = 'restrict_violation', CONSTRAINT = 'adapters_immutable';
    END IF;
    IF OLD.state = 'retired' AND NEW.state = 'active' THEN
        RAISE EXCEPTION 'adapter lora_int_id % is retired and cannot be reactivated', OLD.lora_int_id
            USING ERRCODE = 'restrict_violation', CONSTRAINT = 'adapters_immutable';
    END IF;
    RETURN NEW;
END;
$$;
