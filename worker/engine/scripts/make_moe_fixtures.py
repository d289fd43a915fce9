#!/usr/bin/env python3
"""Adds the Mixture-of-Experts fixtures beside the dense ones, with
Hugging Face transformers + PEFT, leaving the dense fixtures as they are.

Run by hand, never by CI, after make_fixtures.py (it reuses its tokenizer):

    .venv/bin/python worker/engine/scripts/make_moe_fixtures.py worker/engine/tests/fixtures

It writes, under the fixtures directory:

- `qwen3-moe/`: a small random Qwen3-MoE (4 experts, top 2, no top-k
  renormalization, q/k norms), f32;
- `mixtral-moe/`: a small random Mixtral (4 experts, top 2), bf16;
- `adapters/<model>/<name>/`: PEFT LoRA adapters on their attention
  projections (list targets, rank and alpha patterns, rsLoRA), on their
  experts and router (`target_parameters` on the fused expert tensors,
  PEFT's form on transformers 5), on both, and "all-linear" (which PEFT
  writes as the attention modules plus the experts and the router);
- `golden_moe.json`: as `golden.json`, for these models and adapters;
- and adds their base hashes and artifact digests to `base_hashes.json`
  and `artifact_digests.json`.
"""

import json
import os
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import (  # noqa: E402
    MAX_NEW,
    PROMPTS,
    artifact_digest,
    canonical_base_hash,
    randomize_lora,
    save_model,
)

ADAPTERS = {
    "qwen3-moe": [
        ("qv-r8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
        ("kv-r16", dict(r=16, lora_alpha=8, target_modules=["k_proj", "v_proj"])),
        (
            "experts-r4",
            dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
        ),
        ("all-linear-r4", dict(r=4, lora_alpha=12, target_modules="all-linear")),
        (
            "experts-only-r8",
            dict(r=8, lora_alpha=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
        ),
        (
            "patterns",
            dict(
                r=8,
                lora_alpha=16,
                target_modules=["q_proj", "k_proj", "o_proj"],
                rank_pattern={"k_proj": 2},
                alpha_pattern={"o_proj": 4},
            ),
        ),
    ],
    "mixtral-moe": [
        ("qkvo-r4", dict(r=4, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
        ("o-r6-rslora", dict(r=6, lora_alpha=12, use_rslora=True, target_modules=["o_proj"])),
        ("down-r8-rslora", dict(r=8, lora_alpha=4, use_rslora=True, target_modules=[], target_parameters=["mlp.experts.down_proj"])),
        (
            "router-gate-up-r2",
            dict(r=2, lora_alpha=4, target_modules=["v_proj"], target_parameters=["mlp.gate.weight", "mlp.experts.gate_up_proj"]),
        ),
    ],
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "worker/engine/tests/fixtures"
    tok_dir = os.path.join(out, "tokenizer")
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    common = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    configs = {
        "qwen3-moe": (
            Qwen3MoeConfig(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=48,
                intermediate_size=96,
                head_dim=16,
                norm_topk_prob=False,
                rope_theta=10000.0,
                **common,
            ),
            torch.float32,
        ),
        "mixtral-moe": (
            MixtralConfig(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, rope_theta=1000000.0, **common),
            torch.bfloat16,
        ),
    }
    golden = {"max_new_tokens": MAX_NEW, "cases": []}
    for model_name, (config, dtype) in configs.items():
        torch.manual_seed({"qwen3-moe": 33, "mixtral-moe": 44}[model_name])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.15)
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.8, 1.2)
        path = os.path.join(out, model_name)
        save_model(model, path, tok_dir, dtype, False)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

        def record(m, adapter):
            for prompt in PROMPTS:
                ids = tok.encode(prompt).ids
                x = torch.tensor([ids])
                with torch.no_grad():
                    logits = m(x).logits[0, -1].tolist()
                    gen = m.generate(
                        x,
                        attention_mask=torch.ones_like(x),
                        do_sample=False,
                        max_new_tokens=MAX_NEW,
                        eos_token_id=[2, 4],
                        pad_token_id=0,
                    )[0, len(ids):].tolist()
                golden["cases"].append(
                    {"model": model_name, "adapter": adapter, "prompt": prompt, "prompt_ids": ids, "greedy": gen, "logits": logits}
                )

        record(base, None)
        for i, (adapter_name, kwargs) in enumerate(ADAPTERS[model_name]):
            fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            peft_model = get_peft_model(fresh, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **kwargs))
            randomize_lora(peft_model, 2000 + i)
            adir = os.path.join(out, "adapters", model_name, adapter_name)
            peft_model.save_pretrained(adir)
            os.remove(os.path.join(adir, "README.md"))
            loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adir).eval()
            record(loaded, adapter_name)

    with open(os.path.join(out, "golden_moe.json"), "w") as f:
        json.dump(golden, f)
    hashes_path = os.path.join(out, "base_hashes.json")
    hashes = json.load(open(hashes_path))
    for m in configs:
        hashes[m] = canonical_base_hash(os.path.join(out, m))
    with open(hashes_path, "w") as f:
        json.dump(hashes, f, indent=2)
    digests_path = os.path.join(out, "artifact_digests.json")
    digests = json.load(open(digests_path))
    digests = {k: v for k, v in digests.items() if k.split("/")[0] not in configs}
    for m in configs:
        for name in sorted(os.listdir(os.path.join(out, "adapters", m))):
            digests[f"{m}/{name}"] = artifact_digest(os.path.join(out, "adapters", m, name))
    with open(digests_path, "w") as f:
        json.dump(digests, f, indent=2)
    print(f"wrote {len(golden['cases'])} golden cases to {out}/golden_moe.json")


if __name__ == "__main__":
    main()
