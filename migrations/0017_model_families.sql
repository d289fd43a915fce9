-- Model families: Qwen3 (dense) and Phi-3 / Phi-4 (`phi3`) join the
-- architectures the registry accepts. Llama 3.x is `llama`, now with its
-- RoPE scaling read from the checkpoint.
ALTER TABLE base_models DROP CONSTRAINT base_models_architecture_known;
ALTER TABLE base_models ADD CONSTRAINT base_models_architecture_known
    CHECK (architecture IN ('llama', 'mistral', 'qwen2', 'qwen3', 'phi3', 'mixtral', 'qwen3_moe'));
