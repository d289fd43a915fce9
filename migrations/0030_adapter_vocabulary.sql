-- Adapters with rows of their own in the embedding layers:
-- `modules_to_save` (embed_tokens or lm_head saved whole) and
-- `trainable_token_indices` (some tokens' rows). Their features join the
-- ones a version may record, and `vocab_size` records the vocabulary its
-- saved layers have (their rows; null where it saves none and uses the
-- base model's). Workers refuse a vocabulary other than the base's by
-- name when they load the adapter.
ALTER TABLE adapters DROP CONSTRAINT adapters_features_known;
ALTER TABLE adapters ADD CONSTRAINT adapters_features_known CHECK (
    features <@ ARRAY['dora', 'lora_bias', 'embed_tokens', 'lm_head',
                      'modules_to_save', 'trainable_tokens']::TEXT[]
    AND array_position(features, NULL) IS NULL
);

ALTER TABLE adapters
    ADD COLUMN vocab_size INTEGER,
    ADD CONSTRAINT adapters_vocab_size_positive CHECK (vocab_size IS NULL OR vocab_size > 0);

-- As 0025's: the vocabulary is as immutable as the digest.
CREATE OR REPLACE FUNCTION adapters_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'adapter lora_int_id % cannot be deleted; retire it instead', OLD.lora_int_id
            USING ERRCODE = 'restrict_violation', CONSTRAINT = 'adapters_immutable';
    END IF;
    IF (NEW.lora_int_id, NEW.name, NEW.version, NEW.base_model_id, NEW.tenant_id, NEW.rank,
        NEW.alpha, NEW.use_rslora, NEW.target_modules, NEW.artifact_uri, NEW.artifact_sha256,
        NEW.artifact_bytes, NEW.artifact_files, NEW.features, NEW.vocab_size, NEW.created_at)
       IS DISTINCT FROM
       (OLD.lora_int_id, OLD.name, OLD.version, OLD.base_model_id, OLD.tenant_id, OLD.rank,
        OLD.alpha, OLD.use_rslora, OLD.target_modules, OLD.artifact_uri, OLD.artifact_sha256,
        OLD.artifact_bytes, OLD.artifact_files, OLD.features, OLD.vocab_size, OLD.created_at) THEN
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
