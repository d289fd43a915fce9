-- Mixture-of-Experts base models: Mixtral and Qwen3-MoE join the
-- architectures the registry accepts (the engine runs them on the CPU
-- backend, with LoRA on their attention projections).
ALTER TABLE base_models DROP CONSTRAINT base_models_architecture_known;
ALTER TABLE base_models ADD CONSTRAINT base_models_architecture_known
    CHECK (architecture IN ('llama', 'mistral', 'qwen2', 'mixtral', 'qwen3_moe'));
