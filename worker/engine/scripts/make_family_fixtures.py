#!/usr/bin/env python3
"""Builds the model-family fixtures and their goldens with Hugging Face
transformers + PEFT, beside the other fixtures (it reuses their tokenizer).

Run by hand, never by CI:

    PYTHONHASHSEED=0 .venv/bin/python worker/engine/scripts/make_family_fixtures.py worker/engine/tests/fixtures

(PEFT writes `target_modules` in set order; a fixed hash seed writes the
same bytes each run.)

Each family starts from the `config.json` its checkpoints ship on the Hub
(transformers 4's form: `rope_theta` beside `rope_scaling`), with only the
sizes shrunk: hidden and MLP widths, layers, heads, vocabulary (the shared
384-token tokenizer) and token ids, and the RoPE scaling's original
context, shrunk so that the scaling acts inside a test prompt. That
`config.json` is what is committed and what transformers reads back for the
goldens. It writes, under the fixtures directory:

- `llama32-tied/`: Llama 3.2 1B Instruct's config (RoPE `llama3` scaling,
  tied embeddings, `eos_token_id` a list), bf16;
- `qwen3-yarn/`: Qwen3 8B's config (q/k norms, `head_dim` 32 with hidden
  64 and 4 heads, so not hidden / heads) with the YaRN scaling Qwen
  documents for long contexts, f32;
- `phi4/`: Phi-4's config (`phi3`: fused `qkv_proj` and `gate_up_proj`,
  plain RoPE), f32;
- `phi35-mini/`: Phi-3.5-mini's config (LongRoPE, multi-head attention,
  a sliding window, shrunk so it acts in the long prompt), f32;
- `phi4-mini/`: Phi-4-mini's config (LongRoPE with `partial_rotary_factor`
  0.75, tied embeddings), f32. LongRoPE's `short_factor` and `long_factor`
  hold one factor per rotary pair, so they are shrunk with the heads: every
  sixth of the shipped long factors, and a short ramp of the same shape;
- `gemma3-1b/`: Gemma 3 1B's config (`gemma3_text`: sliding layers with
  their own RoPE base, every sixth layer global, q/k norms, (1 + w) norms
  around attention and the MLP, GeGLU, `query_pre_attn_scalar`, embeddings
  scaled by √hidden, tied), six layers so one is global, f32;
- `gemma3-4b/`: Gemma 3 4B's text config (the global layers' RoPE scaled
  `linear` by 8), its `config.json` as transformers 5 writes it
  (`layer_types`, `rope_parameters` nested by layer type), f32;
- `llama2-dynamic/`: Llama 2 7B's config with the dynamic NTK scaling
  transformers documents for extending its context (factor 4), its
  context shrunk to 64 so the long prompt is past it; its greedy tokens
  are generated with the KV cache, since transformers' dynamic NTK
  rotates each forward pass by the frequencies of its own length and keeps
  the keys it cached;
- `gemma3-4b-mm/`: Gemma 3 4B's multimodal checkpoint (`gemma3`:
  `text_config` lists only what differs from transformers' defaults, the
  language model's weights under `language_model.`, a vision tower shrunk
  to one layer), served as its language model; its adapter targets
  `q_proj` and `v_proj` by name, which PEFT also applies to the vision
  tower's attention;
- `gemma2-2b/`: Gemma 2 2B's config (alternating sliding and global layers,
  attention and final-logit soft-capping), f32;
- `adapters/<model>/<name>/`: PEFT LoRA adapters on each family's usual
  targets (Phi-4's fused modules included);
- `golden_families.json`: for each (model, adapter or base, prompt), every
  prompt token's log probability with the TOP most likely tokens, and NEW
  greedy tokens with theirs, as `golden_logprobs.json` holds them; one
  prompt is at least 96 tokens long, and one ends three tokens short of
  the shrunk original context, so its greedy tokens cross it (where
  LongRoPE switches to its long factors and transformers' Phi-3 recomputes
  the whole sequence with them);
- and adds their base hashes and artifact digests to `base_hashes.json` and
  `artifact_digests.json`.
"""

import json
import os
import shutil
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3ForConditionalGeneration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import artifact_digest, canonical_base_hash, randomize_lora  # noqa: E402

TOP = 5
NEW = 8

# The Hub's config.json of each family, sizes shrunk (the shrunk fields are
# marked); every other field as the checkpoint ships it.
SHRINK = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=384)

CONFIGS = {
    # meta-llama/Llama-3.2-1B-Instruct
    "llama32-tied": (
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,  # shrunk: 128000
            "eos_token_id": [2, 3, 4],  # shrunk: [128001, 128008, 128009]
            "head_dim": 16,  # shrunk: 64
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "max_position_embeddings": 2048,  # shrunk: 131072
            "mlp_bias": False,
            "model_type": "llama",
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 64,  # shrunk: 8192
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.45.0.dev0",
            "use_cache": True,
        },
        torch.bfloat16,
        101,
    ),
    # Qwen/Qwen3-8B, with the rope_scaling Qwen documents for YaRN
    "qwen3-yarn": (
        {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,  # shrunk: 151643
            "eos_token_id": 4,  # shrunk: 151645
            "head_dim": 32,  # shrunk: 128
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "max_position_embeddings": 512,  # shrunk: 40960
            "max_window_layers": 36,
            "model_type": "qwen3",
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 48,  # shrunk: 32768
            },
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0",
            "use_cache": True,
            "use_sliding_window": False,
        },
        torch.float32,
        102,
    ),
    # microsoft/phi-4
    "phi4": (
        {
            "architectures": ["Phi3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,  # shrunk: 100257
            "embd_pdrop": 0.0,
            "eos_token_id": 4,  # shrunk: 100265
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "max_position_embeddings": 512,  # shrunk: 16384
            "model_type": "phi3",
            "original_max_position_embeddings": 512,  # shrunk: 16384
            "pad_token_id": 0,  # shrunk: 100349
            "resid_pdrop": 0.0,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 250000,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.47.0",
            "use_cache": True,
        },
        torch.float32,
        103,
    ),
    # microsoft/Phi-3.5-mini-instruct (auto_map left out: transformers runs phi3 natively)
    "phi35-mini": (
        {
            "architectures": ["Phi3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "embd_pdrop": 0.0,
            "eos_token_id": 4,  # shrunk: 32000
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "max_position_embeddings": 2048,  # shrunk: 131072
            "model_type": "phi3",
            "num_key_value_heads": 4,  # multi-head attention, as shipped
            "original_max_position_embeddings": 64,  # shrunk: 4096
            "pad_token_id": 0,  # shrunk: 32000
            "resid_pdrop": 0.0,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "long_factor": [1.08, 1.62, 7.7, 28.57, 42.32, 57.93, 62.71, 64.07],  # shrunk: 48 factors
                "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.45, 1.8, 2.2],  # shrunk: 48 factors
                "type": "longrope",
            },
            "rope_theta": 10000.0,
            "sliding_window": 48,  # shrunk: 262144
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.43.3",
            "use_cache": True,
        },
        torch.float32,
        104,
    ),
    # microsoft/Phi-4-mini-instruct
    "phi4-mini": (
        {
            "architectures": ["Phi3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,  # shrunk: 199999
            "embd_pdrop": 0.0,
            "eos_token_id": 4,  # shrunk: 199999
            "full_attn_mod": 1,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "interpolate_factor": 1,
            "lm_head_bias": False,
            "max_position_embeddings": 2048,  # shrunk: 131072
            "mlp_bias": False,
            "model_type": "phi3",
            "original_max_position_embeddings": 64,  # shrunk: 4096
            "pad_token_id": 0,  # shrunk: 199999
            "partial_rotary_factor": 0.75,
            "resid_pdrop": 0.0,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "long_factor": [1.0, 1.8, 5.3, 19.0, 47.7, 61.0],  # shrunk: 48 factors
                "short_factor": [1.0, 1.05, 1.15, 1.4, 1.9, 2.6],  # shrunk: 48 factors
                "type": "longrope",
            },
            "rope_theta": 10000.0,
            "sliding_window": 262144,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.45.0",
            "use_cache": True,
        },
        torch.float32,
        105,
    ),
    # google/gemma-3-1b-it
    "gemma3-1b": (
        {
            "architectures": ["Gemma3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_logit_softcapping": None,
            "bos_token_id": 1,  # shrunk: 2
            "cache_implementation": "hybrid",
            "eos_token_id": [2, 4],  # shrunk: [1, 106]
            "final_logit_softcapping": None,
            "head_dim": 16,  # shrunk: 256
            "hidden_activation": "gelu_pytorch_tanh",
            "initializer_range": 0.02,
            "max_position_embeddings": 2048,  # shrunk: 32768
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,  # shrunk: 26 (six, so that one is global)
            "num_key_value_heads": 1,
            "pad_token_id": 0,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": 16,  # shrunk: 512
            "sliding_window_pattern": 6,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.50.0.dev0",
            "use_cache": True,
        },
        torch.float32,
        106,
    ),
    # google/gemma-3-4b-it's text_config; config.json as transformers 5 writes it
    "gemma3-4b": (
        {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,  # shrunk: 2
            "eos_token_id": [2, 4],  # shrunk: [1, 106]
            "final_logit_softcapping": None,
            "head_dim": 16,  # shrunk: 256
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 2048,  # shrunk: 131072
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,  # shrunk: 34
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "rope_theta": 1000000.0,
            "sliding_window": 24,  # shrunk: 1024
            "sliding_window_pattern": 6,
        },
        torch.float32,
        107,
    ),
    # meta-llama/Llama-2-7b-hf, with rope_scaling as transformers documents dynamic NTK
    "llama2-dynamic": (
        {
            "architectures": ["LlamaForCausalLM"],
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "max_position_embeddings": 64,  # shrunk: 4096
            "model_type": "llama",
            "num_key_value_heads": 4,  # multi-head attention, as shipped
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {"type": "dynamic", "factor": 4.0},
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
            "transformers_version": "4.31.0.dev0",
            "use_cache": True,
        },
        torch.float32,
        109,
    ),
    # google/gemma-3-4b-it (multimodal)
    "gemma3-4b-mm": (
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "boi_token_index": 5,  # shrunk: 255999
            "eoi_token_index": 6,  # shrunk: 256000
            "eos_token_id": [2, 4],  # shrunk: [1, 106]
            "image_token_index": 7,  # shrunk: 262144
            "initializer_range": 0.02,
            "mm_tokens_per_image": 4,  # shrunk: 256
            "model_type": "gemma3",
            "text_config": {
                "head_dim": 16,  # shrunk: the default 256
                "hidden_size": 64,  # shrunk: 2560
                "intermediate_size": 96,  # shrunk: 10240
                "model_type": "gemma3_text",
                "num_attention_heads": 4,  # shrunk: the default 8
                "num_hidden_layers": 6,  # shrunk: 34
                "num_key_value_heads": 2,  # shrunk: the default 4
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 16,  # shrunk: 1024
                "vocab_size": 384,  # shrunk: the default 262208
            },
            "torch_dtype": "bfloat16",
            "transformers_version": "4.50.0.dev0",
            "vision_config": {
                "hidden_size": 32,  # shrunk: 1152
                "image_size": 28,  # shrunk: 896
                "intermediate_size": 64,  # shrunk: 4304
                "model_type": "siglip_vision_model",
                "num_attention_heads": 2,  # shrunk: 16
                "num_hidden_layers": 1,  # shrunk: 27
                "patch_size": 14,
                "vision_use_head": False,
            },
        },
        torch.float32,
        110,
    ),
    # google/gemma-2-2b
    "gemma2-2b": (
        {
            "architectures": ["Gemma2ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_logit_softcapping": 50.0,
            "bos_token_id": 1,  # shrunk: 2
            "cache_implementation": "hybrid",
            "eos_token_id": [2, 4],  # shrunk: [1, 107]
            "final_logit_softcapping": 30.0,
            "head_dim": 16,  # shrunk: 256
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "initializer_range": 0.02,
            "max_position_embeddings": 2048,  # shrunk: 8192
            "model_type": "gemma2",
            "num_hidden_layers": 4,  # shrunk: 26
            "pad_token_id": 0,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "sliding_window": 16,  # shrunk: 4096
            "torch_dtype": "float32",
            "transformers_version": "4.42.4",
            "use_cache": True,
        },
        torch.float32,
        108,
    ),
}

# Written by transformers itself, not as the Hub ships it.
WRITTEN_BY_TRANSFORMERS = {"gemma3-4b"}

ADAPTERS = {
    "llama32-tied": [
        ("qkvo-r8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
        ("all-linear-r4", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    ],
    "qwen3-yarn": [
        ("qv-r8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
        ("all-linear-r4", dict(r=4, lora_alpha=12, use_rslora=True, target_modules="all-linear")),
    ],
    "phi4": [
        ("qkv-o-r8", dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj"])),
        ("all-linear-r4", dict(r=4, lora_alpha=8, target_modules="all-linear")),
        (
            "gate-up-patterns",
            dict(r=6, lora_alpha=12, target_modules=["gate_up_proj", "down_proj"], rank_pattern={"down_proj": 2}),
        ),
    ],
    "phi35-mini": [
        ("qkv-o-r8", dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj"])),
        ("all-linear-r4", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    ],
    "gemma3-1b": [
        ("qkvo-r8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
        ("all-linear-r4", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    ],
    "gemma3-4b": [
        ("qv-r8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
        ("mlp-r4", dict(r=4, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"])),
    ],
    "llama2-dynamic": [
        ("qv-r8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
        ("all-linear-r4", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    ],
    "gemma3-4b-mm": [
        ("qv-r8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
        ("o-gate-r4", dict(r=4, lora_alpha=8, target_modules=["o_proj", "gate_proj"])),
    ],
    "gemma2-2b": [
        ("qkvo-r4", dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
        ("all-linear-r8", dict(r=8, lora_alpha=8, target_modules="all-linear")),
    ],
    "phi4-mini": [
        ("qkv-gate-up-r8", dict(r=8, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"])),
        ("o-down-r4", dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "down_proj"])),
    ],
}

PROMPTS = [
    "The quick brown fox",
    # At least 96 tokens: past every shrunk original context.
    "Once upon a time, there was a little model that served many adapters. "
    "Multi-LoRA serving keeps one base model and swaps small low-rank deltas. "
    "def forward(self, x): return x @ self.weight.T + self.bias "
    "SELECT * FROM adapters WHERE lora_int_id = 42; Grüße aus München! Ça va? "
    "The quick brown fox jumps over the lazy dog.",
]


def entry(row, token):
    values, ids = torch.topk(row, TOP)
    top = sorted(zip(ids.tolist(), values.tolist()), key=lambda p: (-p[1], p[0]))
    return {"token": token, "logprob": row[token].item(), "top": [[i, v] for i, v in top]}


def record(model, ids, eos):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        prompt = [entry(lp[p - 1], ids[p]) for p in range(1, len(ids))]
        seq, completion, row = list(ids), [], lp[-1]
        for _ in range(NEW):
            best = row.max()
            token = int((row == best).nonzero()[0].item())
            completion.append(entry(row, token))
            if token in eos:
                break
            seq.append(token)
            row = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), dim=-1)
    return prompt, completion


def model_class(config):
    """The class transformers serves a config's checkpoints with: a
    multimodal Gemma 3 is its image-text model (text-only inputs here)."""
    if config.model_type == "gemma3":
        return Gemma3ForConditionalGeneration
    return AutoModelForCausalLM


def record_cached(model, ids, eos):
    """As `record`, the greedy tokens generated with the KV cache: one
    forward pass over the prompt, then one per token."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        lp = torch.log_softmax(out.logits[0].float(), dim=-1)
        prompt = [entry(lp[p - 1], ids[p]) for p in range(1, len(ids))]
        cache, completion, row = out.past_key_values, [], lp[-1]
        for _ in range(NEW):
            best = row.max()
            token = int((row == best).nonzero()[0].item())
            completion.append(entry(row, token))
            if token in eos:
                break
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            row = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
    return prompt, completion


# Generated with the KV cache, each prompt on a freshly loaded model (the
# rotary module keeps the longest length it has seen).
CACHED = {"llama2-dynamic"}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "worker/engine/tests/fixtures"
    tok_dir = os.path.join(out, "tokenizer")
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    assert tok.get_vocab_size() == SHRINK["vocab_size"]
    long_ids = tok.encode(PROMPTS[1]).ids
    assert len(long_ids) >= 96, len(long_ids)
    # Three tokens short of the shrunk original context of 64.
    prompts = [tok.encode(PROMPTS[0]).ids, long_ids, long_ids[:61]]
    golden = {"top": TOP, "new_tokens": NEW, "cases": []}
    for model_name, (hub, dtype, seed) in CONFIGS.items():
        if "text_config" not in hub:
            hub = {**SHRINK, **hub}
        path = os.path.join(out, model_name)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hub, f, indent=2, sort_keys=True)
        config = AutoConfig.from_pretrained(path)
        torch.manual_seed(seed)
        cls = model_class(config)
        model = cls(config) if cls is Gemma3ForConditionalGeneration else cls.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.8, 1.2)
                else:
                    p.normal_(0.0, 0.15)
        model.to(dtype).save_pretrained(path, safe_serialization=True)
        # The Hub's config.json, not the one transformers 5 writes back.
        if model_name not in WRITTEN_BY_TRANSFORMERS:
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(hub, f, indent=2, sort_keys=True)
        for name in ["tokenizer.json", "tokenizer_config.json"]:
            shutil.copy(os.path.join(tok_dir, name), os.path.join(path, name))
        eos = hub["eos_token_id"] if isinstance(hub["eos_token_id"], list) else [hub["eos_token_id"]]
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": hub.get("bos_token_id", 1), "eos_token_id": eos}, f)

        def run(m, adapter, reload=None):
            m.eval()
            for ids in prompts:
                if model_name in CACHED:
                    m = reload().eval()
                    prompt, completion = record_cached(m, ids, eos)
                else:
                    prompt, completion = record(m, ids, eos)
                golden["cases"].append(
                    {"model": model_name, "adapter": adapter, "prompt_ids": ids, "prompt": prompt, "completion": completion}
                )

        def base_model():
            return model_class(config).from_pretrained(path, dtype=torch.float32)

        run(base_model(), None, base_model)
        shutil.rmtree(os.path.join(out, "adapters", model_name), ignore_errors=True)
        for i, (adapter_name, kwargs) in enumerate(ADAPTERS[model_name]):
            fresh = base_model()
            peft_model = get_peft_model(fresh, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **kwargs))
            randomize_lora(peft_model, 3000 + 10 * seed + i)
            adir = os.path.join(out, "adapters", model_name, adapter_name)
            peft_model.save_pretrained(adir)
            os.remove(os.path.join(adir, "README.md"))
            def adapted(adir=adir):
                return PeftModel.from_pretrained(base_model(), adir)

            run(adapted(), adapter_name, adapted)

    with open(os.path.join(out, "golden_families.json"), "w") as f:
        json.dump(golden, f)
    hashes_path = os.path.join(out, "base_hashes.json")
    hashes = json.load(open(hashes_path))
    for m in CONFIGS:
        hashes[m] = canonical_base_hash(os.path.join(out, m))
    with open(hashes_path, "w") as f:
        json.dump(hashes, f, indent=2)
    digests_path = os.path.join(out, "artifact_digests.json")
    digests = {k: v for k, v in json.load(open(digests_path)).items() if k.split("/")[0] not in CONFIGS}
    for m in CONFIGS:
        for name in sorted(os.listdir(os.path.join(out, "adapters", m))):
            digests[f"{m}/{name}"] = artifact_digest(os.path.join(out, "adapters", m, name))
    with open(digests_path, "w") as f:
        json.dump(digests, f, indent=2)
    print(f"wrote {len(golden['cases'])} golden cases to {out}/golden_families.json")


if __name__ == "__main__":
    main()
