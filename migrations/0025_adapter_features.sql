-- What an adapter version does beyond plain LoRA, as registration read it
-- from its adapter_config.json: 'dora' (use_dora) and 'lora_bias'. A
-- worker that cannot serve a feature refuses the adapter by name when it
-- loads it; the admin API and the console show them. Empty for versions
-- registered before features were recorded (plain LoRA then: DoRA and
-- lora_bias were refused at registration).
ALTER TABLE adapters
    ADD COLUMN features TEXT[] NOT NULL DEFAULT '{}',
    ADD CONSTRAINT adapters_features_known CHECK (
        features <@ ARRAY['dora', 'lora_bias']::TEXT[]
        AND array_position(features, NULL) IS NULL
    );

-- As 0021's: the features are as immutable as the digest.
CREATE OR REPLACE FUNCTION adapters_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'adapter lora_int_id % cannot be deleted; retire it instead', OLD.lora_int_id
            USING ERRCODE = 'restrict_violation', CONSTRAINT = 'adapters_immutable';
    END IF;
    IF (NEW.lora_int_id, NEW.name, NEW.version, NEW.base_model_id, NEW.tenant_id, NEW.rank,
        NEW.alpha, NEW.use_rslora, NEW.target_modules, NEW.artifact_uri, NEW.artifact_sha256,
        NEW.artifact_bytes, NEW.artifact_files, NEW.features, NEW.created_at)
       IS DISTINCT FROM
       (OLD.lora_int_id, OLD.name, OLD.version, OLD.base_model_id, OLD.tenant_id, OLD.rank,
        OLD.alpha, OLD.use_rslora, OLD.target_modules, OLD.artifact_uri, OLD.artifact_sha256,
        OLD.artifact_bytes, OLD.artifact_files, OLD.features, OLD.created_at) THEN
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
