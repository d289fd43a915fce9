#!/usr/bin/env python3
"""Benchmark (c): the decode-throughput workload of benchmark (b), through
Hugging Face transformers + PEFT on the CPU, as the baseline lorafleet is
compared with. Run by hand after benchmark (b) has written the STAND-IN
model and adapters (under target/bench-standin):

    target/peft-venv/bin/python worker/engine/benches/peft_baseline.py target/bench-standin 1,8,64,512

Same requests as (b): 512 requests, 8 prompt tokens, 8 new tokens, greedy,
adapter r % N. transformers has no continuous batching, so requests run in
static batches of 32 (lorafleet's max_num_seqs in (b)), each batch mixing
adapters through PEFT's `adapter_names`. Adapters are loaded before timing.

The model is (b)'s f32 stand-in (`model-f32`), computed in float32, which is
the arithmetic lorafleet's CPU engine does. PEFT_MODEL=model-bf16 takes the
bf16 stand-in (LORAFLEET_BENCH_DTYPE=bf16 in (b)); PEFT_DTYPE=bfloat16
computes in bf16 instead. The last column is the CPU time the hypervisor gave to
other guests during the row (Linux /proc/stat), as in (b).

On a GPU (the baseline of `cuda_decode`; `deploy/gpu-check.sh` runs it there):

    PEFT_DEVICE=cuda PEFT_MODEL=model-bf16 PEFT_DTYPE=bfloat16 \
        python3 worker/engine/benches/peft_baseline.py <standin>/llama-3.2-1b-shape 1,8,64,512
"""

import os
import sys
import time

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

REQUESTS = 512
PROMPT = 8
NEW = 8
BATCH = 32


def stolen_cpu_seconds():
    try:
        with open("/proc/stat") as f:
            cpu = next(line for line in f if line.startswith("cpu "))
        return int(cpu.split()[8]) / 100.0
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def main():
    root = sys.argv[1]
    counts = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "1,8,64,512").split(",")]
    model_dir = os.path.join(root, os.environ.get("PEFT_MODEL", "model-f32"))
    dtype = getattr(torch, os.environ.get("PEFT_DTYPE", "float32"))
    device = os.environ.get("PEFT_DEVICE", "cpu")
    torch.set_num_threads(os.cpu_count())
    print(f"transformers + PEFT baseline on {device}, STAND-IN model {os.path.basename(model_dir)} computed in {dtype}, "
          f"{REQUESTS} requests x {NEW} new tokens, static batches of {BATCH}, {torch.get_num_threads()} threads")
    print("| adapters | generated tokens | seconds | tokens/s | stolen CPU s |")
    print("|---:|---:|---:|---:|---:|")
    adapters = sorted(os.listdir(os.path.join(root, "adapters")))
    for n in counts:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        model = PeftModel.from_pretrained(
            base, os.path.join(root, "adapters", adapters[0]), adapter_name="a0"
        )
        for i in range(1, n):
            model.load_adapter(os.path.join(root, "adapters", adapters[i]), adapter_name=f"a{i}")
        model = model.to(device).eval()
        prompts = [[(r * 31 + k * 7) % 380 + 3 for k in range(PROMPT)] for r in range(REQUESTS)]
        names = [f"a{r % n}" for r in range(REQUESTS)]
        generated = 0
        stolen_before = stolen_cpu_seconds()
        start = time.perf_counter()
        with torch.no_grad():
            for b in range(0, REQUESTS, BATCH):
                ids = torch.tensor(prompts[b : b + BATCH], device=device)
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    adapter_names=names[b : b + BATCH],
                    max_new_tokens=NEW,
                    min_new_tokens=NEW,
                    do_sample=False,
                    pad_token_id=0,
                )
                generated += (out.shape[1] - PROMPT) * out.shape[0]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        secs = time.perf_counter() - start
        stolen_after = stolen_cpu_seconds()
        stolen = "n/a" if stolen_before is None else f"{stolen_after - stolen_before:.1f}"
        print(f"| {n} | {generated} | {secs:.2f} | {generated / secs:.1f} | {stolen} |", flush=True)


if __name__ == "__main__":
    main()
