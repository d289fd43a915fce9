-- LoRA on the token embeddings (`embed_tokens`) and on the lm_head: their
-- names join the modules an adapter version may list, and the features
-- it records ('embed_tokens', 'lm_head'), beside 'dora' and 'lora_bias'.
ALTER TABLE adapters DROP CONSTRAINT adapters_target_modules_known;
ALTER TABLE adapters ADD CONSTRAINT adapters_target_modules_known CHECK (
    cardinality(target_modules) > 0
    AND target_modules <@ ARRAY['q_proj', 'k_proj', 'v_proj', 'o_proj',
                                'gate_proj', 'up_proj', 'down_proj',
                                'qkv_proj', 'gate_up_proj',
                                'embed_tokens', 'lm_head']::TEXT[]
    AND array_position(target_modules, NULL) IS NULL
);

ALTER TABLE adapters DROP CONSTRAINT adapters_features_known;
ALTER TABLE adapters ADD CONSTRAINT adapters_features_known CHECK (
    features <@ ARRAY['dora', 'lora_bias', 'embed_tokens', 'lm_head']::TEXT[]
    AND array_position(features, NULL) IS NULL
);
