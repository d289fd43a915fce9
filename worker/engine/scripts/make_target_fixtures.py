#!/usr/bin/env python3
"""Adapters whose targets PEFT matches by name: a regular expression
`target_modules`, and `exclude_modules` as a list and as a pattern; and
their goldens from PEFT itself.

Run by hand, never by CI, after make_fixtures.py (it adapts that script's
`llama-gqa`):

    python3 -m venv .venv && .venv/bin/pip install torch transformers peft safetensors tokenizers
    .venv/bin/python worker/engine/scripts/make_target_fixtures.py worker/engine/tests/fixtures

(made with peft 0.21.2, transformers 5.17.0, torch 2.14.0.)

It writes `adapters/targets/llama-gqa/<name>/` (apart from the plain
adapters, which other tests take all of) and `golden_targets.json`: for each
adapter and prompt, the greedy tokens and the last prompt position's logits
of transformers + PEFT in f32, and the modules PEFT adapted
(`targeted`), read off the PEFT model. Nothing here shares code with the
Rust engine.
"""

import json
import os
import shutil
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import MAX_NEW, golden_cases, randomize_lora  # noqa: E402

MODEL = "llama-gqa"
ADAPTERS = [
    # A pattern over whole paths: layer 1's attention only.
    ("regex-layer1-attn", dict(r=4, lora_alpha=8, target_modules=r"model\.layers\.1\.self_attn\.(q|k|v|o)_proj")),
    # Every linear layer but the down projections.
    ("all-linear-but-down", dict(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["down_proj"])),
    # A pattern, less what a pattern excludes: layer 0 out.
    (
        "regex-exclude-layer0",
        dict(r=8, lora_alpha=16, target_modules=r".*\.(q_proj|v_proj|up_proj)", exclude_modules=r"model\.layers\.0\..*"),
    ),
]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "worker/engine/tests/fixtures"
    path = os.path.join(out, MODEL)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    golden = {"max_new_tokens": MAX_NEW, "cases": []}
    for i, (name, kwargs) in enumerate(ADAPTERS):
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **kwargs))
        randomize_lora(peft_model, 7000 + i)
        adir = os.path.join(out, "adapters", "targets", MODEL, name)
        shutil.rmtree(adir, ignore_errors=True)
        peft_model.save_pretrained(adir)
        os.remove(os.path.join(adir, "README.md"))
        cfg_path = os.path.join(adir, "adapter_config.json")
        cfg = json.load(open(cfg_path))
        cfg["base_model_name_or_path"] = f"worker/engine/tests/fixtures/{MODEL}"
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
        m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adir).eval()
        targeted = sorted(
            n.removeprefix("base_model.model.") for n, mod in m.named_modules() if hasattr(mod, "lora_A") and len(mod.lora_A) > 0
        )
        for case in golden_cases(m, tok, MODEL, name):
            case["targeted"] = targeted
            golden["cases"].append(case)
    with open(os.path.join(out, "golden_targets.json"), "w") as f:
        json.dump(golden, f)
    print(f"wrote {len(golden['cases'])} golden cases to {out}")


if __name__ == "__main__":
    main()
