#!/usr/bin/env python3
"""The baseline of `moe_decode`: the same MoE decode workload through
Hugging Face transformers + PEFT on the CPU. Run by hand after
`cargo bench -p lorafleet-engine --bench moe_decode` has written the
STAND-IN model and adapters:

    .venv/bin/python worker/engine/benches/peft_moe_baseline.py target/bench-standin/qwen3-moe-shape 1,8,64

Same requests as `moe_decode`: 128 requests, 8 prompt tokens, 8 new tokens,
greedy, request r on adapter r % N. PEFT cannot mix adapters with expert
LoRA in one batch (`lora.ParamWrapper does not support mixed adapter
batches`), so each adapter's requests run as their own static batches of up
to 32 (lorafleet's max_num_seqs), which only favours PEFT. The model is the
bf16 stand-in computed in float32 (PEFT_DTYPE=bfloat16 computes in bf16).
PEFT_DEVICE=cuda runs it on the GPU (`deploy/gpu-check.sh` does, beside
`moe_decode` on the CUDA backend).
"""

import os
import sys
import time

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

REQUESTS = 128
PROMPT = 8
NEW = 8
BATCH = 32
DEVICE = os.environ.get("PEFT_DEVICE", "cpu")


def prompt(r):
    return [((r * 31 + k * 7) % 380 + 3) for k in range(PROMPT)]


def run(model, groups):
    """groups: [(adapter name or None, [request ids])]; returns tokens/s."""
    generated = 0
    started = time.perf_counter()
    for name, ids in groups:
        if name is not None:
            model.set_adapter(name)
        for i in range(0, len(ids), BATCH):
            x = torch.tensor([prompt(r) for r in ids[i : i + BATCH]], device=DEVICE)
            with torch.no_grad():
                if name is None:
                    with model.disable_adapter():
                        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                             max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0)
                else:
                    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                         max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0)
            generated += (out.shape[1] - PROMPT) * out.shape[0]
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    return generated / (time.perf_counter() - started)


def main():
    root = sys.argv[1]
    counts = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "1,8,64").split(",")]
    dtype = getattr(torch, os.environ.get("PEFT_DTYPE", "float32"))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(os.path.join(root, "model-bf16"), dtype=dtype).to(DEVICE).eval()
    adapters = sorted(os.listdir(os.path.join(root, "adapters")))[: max(counts)]
    loaded = time.perf_counter()
    model = PeftModel.from_pretrained(base, os.path.join(root, "adapters", adapters[0]), adapter_name=adapters[0])
    for a in adapters[1:]:
        model.load_adapter(os.path.join(root, "adapters", a), adapter_name=a)
    model.to(DEVICE).eval()
    print(f"{len(adapters)} adapters loaded in {time.perf_counter() - loaded:.1f} s; {DEVICE}, {torch.get_num_threads()} threads, {dtype}")
    print("| adapters | tokens/s |")
    print("|---:|---:|")
    print(f"| 0 (base model) | {run(model, [(None, list(range(REQUESTS)))]):.1f} |")
    for n in counts:
        groups = [(adapters[a], [r for r in range(REQUESTS) if r % n == a]) for a in range(n)]
        print(f"| {n} | {run(model, groups):.1f} |")


if __name__ == "__main__":
    main()
