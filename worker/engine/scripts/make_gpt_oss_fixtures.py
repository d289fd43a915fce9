#!/usr/bin/env python3
"""Builds the GPT-OSS fixtures and their goldens with Hugging Face
transformers + PEFT, beside the other fixtures (it reuses their tokenizer).

Run by hand, never by CI:

    PYTHONHASHSEED=0 .venv/bin/python worker/engine/scripts/make_gpt_oss_fixtures.py worker/engine/tests/fixtures

The model is `openai/gpt-oss-20b`'s `config.json` as the Hub ships it, with
only the sizes shrunk (marked): widths, layers, heads, experts, the
vocabulary (the shared 384-token tokenizer) and token ids, the sliding
window (so that it acts inside a test prompt) and the YaRN scaling's
original context. It writes, under the fixtures directory:

- `gpt-oss/`: the model in bf16 as transformers saves it (the form of the
  bf16 releases): experts as `[experts, in, out]` parameters
  (`mlp.experts.gate_up_proj`, gate and up interleaved, with biases), the
  router with its bias (`mlp.router`), q/k/v/o with biases, a sink logit
  per head (`self_attn.sinks`);
- `gpt-oss-mxfp4/`: the same model as OpenAI released its checkpoints:
  the experts' projections as MXFP4 (`*_blocks`: two E2M1 values a byte,
  low nibble first, 32 values a group along the input; `*_scales`: one
  E8M0 exponent a group), everything else bf16, and the release's
  `quantization_config` (`quant_method: "mxfp4"`, `modules_to_not_convert`).
  The codes are written here by rounding the bf16 experts to the nearest
  E2M1 value under each group's power-of-two scale; the reference is
  transformers' own reader of that format (`Mxfp4Config(dequantize=True)`,
  its `convert_moe_packed_tensors`), so the layout is checked against it;
- `adapters/gpt-oss/<name>/`: PEFT LoRA adapters as PEFT writes them for
  GPT-OSS: on q/k/v/o, and through `target_parameters` on the experts
  (`lora_A` `[r * experts, in]`, `lora_B` `[out, r * experts]`);
- `golden_gpt_oss.json`: for each model (both bases), adapter or base and
  prompt, the last prompt position's logits and the greedy tokens, as
  `golden_moe.json` holds them; one prompt is longer than three windows;
- and adds the bf16 base's hash and the adapters' artifact digests to
  `base_hashes.json` and `artifact_digests.json`.
"""

import json
import os
import shutil
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import MAX_NEW, artifact_digest, canonical_base_hash, golden_cases, randomize_lora  # noqa: E402

LONG_PROMPT = (
    "Once upon a time, there was a little model that served many adapters. "
    "The quick brown fox jumps over the lazy dog."
)

LAYERS = 4  # shrunk: 24

# openai/gpt-oss-20b's config.json, sizes shrunk; every other field as it ships.
CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 2,  # shrunk: 200002
    "experts_per_token": 4,
    "head_dim": 16,  # shrunk: 64
    "hidden_act": "silu",
    "hidden_size": 64,  # shrunk: 2880
    "initial_context_length": 64,  # shrunk: 4096
    "initializer_range": 0.02,
    "intermediate_size": 64,  # shrunk: 2880
    "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2),
    "max_position_embeddings": 2048,  # shrunk: 131072
    "model_type": "gpt_oss",
    "num_attention_heads": 4,  # shrunk: 64
    "num_experts_per_tok": 4,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": 2,  # shrunk: 8
    "num_local_experts": 8,  # shrunk: 32
    "output_router_logits": False,
    "pad_token_id": 0,  # shrunk: 199999
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 64,  # shrunk: 4096
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 8,  # shrunk: 128
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 384,  # shrunk: 201088
}

ADAPTERS = [
    ("attn-qkvo-r8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    (
        "experts-r4",
        dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    ),
    ("down-rslora-r8", dict(r=8, lora_alpha=4, use_rslora=True, target_modules=[], target_parameters=["mlp.experts.down_proj"])),
]

# The E2M1 values of the codes 0..15, as transformers' reader lists them.
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def to_mxfp4(w):
    """An experts parameter `[experts, in, out]` as the release stores it:
    blocks `[experts, out, in / 32, 16]` (uint8, two codes a byte, the
    lower input in the low nibble) and scales `[experts, out, in / 32]`
    (uint8, E8M0: the group's power of two plus 127)."""
    experts, fan_in, out = w.shape
    v = w.float().transpose(1, 2).reshape(experts, out, fan_in // 32, 32)
    amax = v.abs().amax(-1)
    # The smallest power of two that brings the group within E2M1's ±6.
    exp = torch.ceil(torch.log2(amax.clamp(min=2.0**-120) / 6.0)).clamp(-120, 120)
    scaled = v / torch.pow(2.0, exp)[..., None]
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exp + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def cases(m, tok, model, adapter):
    out = golden_cases(m, tok, model, adapter)
    ids = tok.encode(LONG_PROMPT).ids
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = m(x).logits[0, -1].tolist()
        gen = m.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=[2, 4], pad_token_id=0
        )[0, len(ids):].tolist()
    out.append({"model": model, "adapter": adapter, "prompt": LONG_PROMPT, "prompt_ids": ids, "greedy": gen, "logits": logits})
    return out


def write_dir(path, tok_dir, config, tensors):
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 4], "pad_token_id": 0}, f)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(tok_dir, name), os.path.join(path, name))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "worker/engine/tests/fixtures"
    tok_dir = os.path.join(out, "tokenizer")
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    assert tok.get_vocab_size() == CONFIG["vocab_size"]
    bf16_config = {k: v for k, v in CONFIG.items() if k != "quantization_config"}
    bf16_config["torch_dtype"] = "bfloat16"

    torch.manual_seed(77)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**bf16_config), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif "sinks" in name:
                p.normal_(0.0, 1.0)
            elif "gate_up_proj" in name and "bias" not in name:
                # Wide enough that the SwiGLU's clamps at ±7 act.
                p.normal_(0.0, 0.5)
            elif "bias" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}

    base_dir = os.path.join(out, "gpt-oss")
    write_dir(base_dir, tok_dir, bf16_config, state)

    mx_dir = os.path.join(out, "gpt-oss-mxfp4")
    mx = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            blocks, scales = to_mxfp4(v)
            mx[k + "_blocks"], mx[k + "_scales"] = blocks, scales
        else:
            mx[k] = v
    mx_config = dict(CONFIG)
    mx_config["torch_dtype"] = "bfloat16"
    write_dir(mx_dir, tok_dir, mx_config, mx)

    def load_base(path):
        if path == mx_dir:
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True))
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    golden = {"max_new_tokens": MAX_NEW, "cases": []}
    # The adapters, made on the bf16 base.
    adapters_root = os.path.join(out, "adapters", "gpt-oss")
    shutil.rmtree(adapters_root, ignore_errors=True)
    for i, (name, kwargs) in enumerate(ADAPTERS):
        peft_model = get_peft_model(load_base(base_dir), LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **kwargs))
        randomize_lora(peft_model, 7000 + i)
        adir = os.path.join(adapters_root, name)
        peft_model.save_pretrained(adir)
        os.remove(os.path.join(adir, "README.md"))
    for model_name, path in [("gpt-oss", base_dir), ("gpt-oss-mxfp4", mx_dir)]:
        base = load_base(path).eval()
        golden["cases"] += cases(base, tok, model_name, None)
        for name, _ in ADAPTERS:
            loaded = PeftModel.from_pretrained(load_base(path), os.path.join(adapters_root, name)).eval()
            golden["cases"] += cases(loaded, tok, model_name, name)
    # Both bases read the same weights where the codes are exact; the
    # reference dequantized the MXFP4 experts itself.
    with open(os.path.join(out, "golden_gpt_oss.json"), "w") as f:
        json.dump(golden, f)

    hashes_path = os.path.join(out, "base_hashes.json")
    hashes = json.load(open(hashes_path))
    # A quantized base's hash covers its quantization config too (the
    # engine's own); the dense one's is the tensors' alone.
    hashes["gpt-oss"] = canonical_base_hash(base_dir)
    with open(hashes_path, "w") as f:
        json.dump(hashes, f, indent=2)
    digests_path = os.path.join(out, "artifact_digests.json")
    digests = json.load(open(digests_path))
    digests = {k: v for k, v in digests.items() if k.split("/")[0] != "gpt-oss"}
    for name in sorted(os.listdir(adapters_root)):
        digests[f"gpt-oss/{name}"] = artifact_digest(os.path.join(adapters_root, name))
    with open(digests_path, "w") as f:
        json.dump(digests, f, indent=2)
    print(f"wrote {len(golden['cases'])} golden cases to {out}/golden_gpt_oss.json")


if __name__ == "__main__":
    main()
