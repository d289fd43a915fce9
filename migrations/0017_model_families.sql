-- Model families: Qwen3 (dense), Phi-3 / Phi-4 (`phi3`), Gemma 2 and Gemma 3
-- (`gemma3_text`, and `gemma3`: a multimodal checkpoint served as its
-- language model) join the architectures the registry accepts. Llama 3.x
-- is `llama`, now with its RoPE scaling read from the checkpoint.
ALTER TABLE base_models DROP CONSTRAINT base_models_architecture_known;
ALTER TABLE base_models ADD CONSTRAINT base_models_architecture_known
    CHECK (architecture IN ('llama', 'mistral', 'qwen2', 'qwen3', 'phi3', 'gemma2', 'gemma3_text',
                            'gemma3', 'mixtral', 'qwen3_moe'));

-- Phi-3's adapters target its fused modules: one LoRA pair on `qkv_proj`
-- (q, k and v) and one on `gate_up_proj` (gate and up).
ALTER TABLE adapters DROP CONSTRAINT adapters_target_modules_known;
ALTER TABLE adapters ADD CONSTRAINT adapters_target_modules_known CHECK (
    cardinality(target_modules) > 0
    AND target_modules <@ ARRAY['q_proj', 'k_proj', 'v_proj', 'o_proj',
                                'gate_proj', 'up_proj', 'down_proj',
                                'qkv_proj', 'gate_up_proj']::TEXT[]
    AND array_position(target_modules, NULL) IS NULL
);
