-- GPT-OSS (`gpt_oss`: attention sinks, alternating sliding and full
-- layers, a Mixture of Experts with biases and a clamped SwiGLU, from its
-- bf16 or its MXFP4 checkpoint) joins the architectures the registry
-- accepts.
ALTER TABLE base_models DROP CONSTRAINT base_models_architecture_known;
ALTER TABLE base_models ADD CONSTRAINT base_models_architecture_known
    CHECK (architecture IN ('llama', 'mistral', 'qwen2', 'qwen3', 'phi3', 'gemma2', 'gemma3_text',
                            'gemma3', 'mixtral', 'qwen3_moe', 'gpt_oss'));
