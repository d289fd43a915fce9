#!/usr/bin/env python3
"""Adapters with LoRA on the token embeddings (`embed_tokens`:
`lora_embedding_A` `[r, vocab]`, `lora_embedding_B` `[hidden, r]`) and on
the lm_head (`lora_A` `[r, hidden]`, `lora_B` `[vocab, r]`), made by PEFT,
and their goldens from PEFT itself.

Run by hand, never by CI, after make_fixtures.py (it adapts that script's
`llama-gqa` and `qwen2-tied`):

    python3 -m venv .venv && .venv/bin/pip install torch transformers peft safetensors tokenizers
    .venv/bin/python worker/engine/scripts/make_embedding_fixtures.py worker/engine/tests/fixtures

(made with peft 0.21.2, transformers 5.24.0, torch 2.15.0.) With
`--models gemma3-1b,gemma2-2b` it makes those models' adapters alone and
puts their cases into the existing `golden_embedding.json` in place of
theirs, the others' left as they are.

PEFT saves the embedding layers whole beside their factors when they are
targeted (`save_embedding_layers`: `embed_tokens.base_layer.weight`,
`lm_head.base_layer.weight`), and loads those copies over the model's: here
they are the base's own values, as after any LoRA training (the base is
frozen). It writes `adapters/embedding/<model>/<name>/` (apart from the
plain adapters, which other tests take all of), A and B random, and
`golden_embedding.json`: for each adapter and prompt, the greedy tokens
and the last prompt position's logits of transformers + PEFT in f32.
Nothing here shares code with the Rust engine.
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

ADAPTERS = {
    "llama-gqa": [
        ("embed-r4", dict(r=4, lora_alpha=8, target_modules=["embed_tokens"])),
        ("head-qv-r8", dict(r=8, lora_alpha=16, target_modules=["lm_head", "q_proj", "v_proj"])),
        ("embed-head-rslora", dict(r=6, lora_alpha=12, use_rslora=True, target_modules=["embed_tokens", "lm_head", "o_proj"])),
    ],
    # Tied embeddings: the lm_head and embed_tokens share their weight, each
    # LoRA its own.
    "qwen2-tied": [("embed-head-r4", dict(r=4, lora_alpha=4, target_modules=["embed_tokens", "lm_head", "k_proj"]))],
    # Gemma scales its embeddings by sqrt(hidden) (transformers' scaled
    # embedding module, `embed_scale`): PEFT scales the LoRA output by the
    # same factor. Gemma 2 also soft-caps its final logits, after the
    # lm_head LoRA.
    "gemma3-1b": [("embed-r4", dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]))],
    "gemma2-2b": [("embed-head-r4", dict(r=4, lora_alpha=4, target_modules=["embed_tokens", "lm_head"]))],
}


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--models")]
    only = [a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--models=")]
    only = only[0] if only else None
    out = args[0] if args else "worker/engine/tests/fixtures"
    golden_path = os.path.join(out, "golden_embedding.json")
    golden = {"max_new_tokens": MAX_NEW, "cases": []}
    if only is not None:
        golden = json.load(open(golden_path))
        golden["cases"] = [c for c in golden["cases"] if c["model"] not in only]
    for i, (model, adapters) in enumerate(ADAPTERS.items()):
        if only is not None and model not in only:
            continue
        path = os.path.join(out, model)
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        for j, (name, kwargs) in enumerate(adapters):
            base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            peft_model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **kwargs))
            randomize_lora(peft_model, 9500 + 10 * i + j)
            adir = os.path.join(out, "adapters", "embedding", model, name)
            shutil.rmtree(adir, ignore_errors=True)
            peft_model.save_pretrained(adir)
            os.remove(os.path.join(adir, "README.md"))
            cfg_path = os.path.join(adir, "adapter_config.json")
            cfg = json.load(open(cfg_path))
            cfg["base_model_name_or_path"] = f"worker/engine/tests/fixtures/{model}"
            cfg["target_modules"] = sorted(cfg["target_modules"])
            with open(cfg_path, "w") as f:
                json.dump(cfg, f, indent=2)
            m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adir).eval()
            golden["cases"].extend(golden_cases(m, tok, model, name))
    with open(golden_path, "w") as f:
        json.dump(golden, f)
    print(f"wrote {len(golden['cases'])} golden cases to {golden_path}")


if __name__ == "__main__":
    main()
