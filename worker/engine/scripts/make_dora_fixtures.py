#!/usr/bin/env python3
"""DoRA adapters made by PEFT, and their goldens from PEFT itself.

Run by hand, never by CI, after make_fixtures.py, make_moe_fixtures.py and
make_tool_quantized_fixtures.py (it adapts their models):

    python3 -m venv .venv && .venv/bin/pip install torch transformers peft safetensors tokenizers
    .venv/bin/python worker/engine/scripts/make_dora_fixtures.py worker/engine/tests/fixtures

(made with peft 0.21.2, transformers 5.17.0, torch 2.14.0.)

It writes `adapters/dora/<model>/dora-*/` (apart from the plain adapters, which
other tests take all of): PEFT LoRA adapters with `use_dora:
true`, A, B and the magnitude vector (`lora_magnitude_vector`) all moved
off their initial values (a fresh DoRA adapter's magnitude is exactly the
base's column norm, which would hide a wrong norm), and
`golden_dora.json`: for each (model, adapter or base, prompt) the greedy
tokens and the last prompt position's logits of transformers + PEFT in
f32. The adapters of a quantized base (llama-gqa-tool-w8a16) are made on
the checkpoint as transformers loads it (compressed-tensors decompressing
it), so PEFT's norm is of the dequantized weights. Nothing here shares
code with the Rust engine.
"""

import json
import os
import shutil
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import MAX_NEW, golden_cases  # noqa: E402

# model -> (the dense model whose adapters directory holds them, [(name, LoraConfig kwargs)])
ADAPTERS = {
    "llama-gqa": (
        "llama-gqa",
        [
            ("dora-qv-r8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
            ("dora-all-linear-rslora", dict(r=4, lora_alpha=8, use_rslora=True, target_modules="all-linear")),
        ],
    ),
    "qwen2-tied": (
        "qwen2-tied",
        # q/k/v carry biases.
        [("dora-qkv-r4", dict(r=4, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))],
    ),
    "mixtral-moe": (
        "mixtral-moe",
        # DoRA on the attention of a Mixture-of-Experts model.
        [("dora-attn-r4", dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))],
    ),
    "llama-gqa-tool-w8a16": (
        "llama-gqa",
        [("dora-w8a16-qv-r4", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))],
    ),
}


def load(path):
    cfg = json.load(open(os.path.join(path, "config.json")))
    extra = {}
    if cfg.get("quantization_config", {}).get("quant_method") == "compressed-tensors":
        extra["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra)


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif "lora_magnitude_vector" in name:
                # Near the base's norms, but not equal to them.
                p.mul_(1.0 + 0.3 * torch.randn(p.shape, generator=g))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "worker/engine/tests/fixtures"
    golden = {"max_new_tokens": MAX_NEW, "cases": []}
    for i, (model_name, (adapter_model, adapters)) in enumerate(ADAPTERS.items()):
        path = os.path.join(out, model_name)
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))

        def record(m, adapter):
            golden["cases"].extend(golden_cases(m, tok, model_name, adapter))

        record(load(path).eval(), None)
        for j, (name, kwargs) in enumerate(adapters):
            peft_model = get_peft_model(load(path), LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, use_dora=True, **kwargs))
            randomize(peft_model, 5000 + 100 * i + j)
            adir = os.path.join(out, "adapters", "dora", adapter_model, name)
            shutil.rmtree(adir, ignore_errors=True)
            peft_model.save_pretrained(adir)
            os.remove(os.path.join(adir, "README.md"))
            # The base the adapter declares, written as the other fixtures' are.
            cfg_path = os.path.join(adir, "adapter_config.json")
            cfg = json.load(open(cfg_path))
            cfg["base_model_name_or_path"] = f"worker/engine/tests/fixtures/{model_name}"
            with open(cfg_path, "w") as f:
                json.dump(cfg, f, indent=2)
            record(PeftModel.from_pretrained(load(path), adir).eval(), name)
    with open(os.path.join(out, "golden_dora.json"), "w") as f:
        json.dump(golden, f)
    print(f"wrote {len(golden['cases'])} golden cases to {out}")


if __name__ == "__main__":
    main()
