#!/usr/bin/env python3
"""Builds the quantized-base fixtures and their goldens with transformers + PEFT.

Run by hand, never by CI, after make_fixtures.py (it quantizes that
script's `llama-gqa` and `qwen2-tied`):

    python3 -m venv .venv && .venv/bin/pip install torch transformers peft safetensors
    .venv/bin/python worker/engine/scripts/make_quantized_fixtures.py worker/engine/tests/fixtures

It writes, under the fixtures directory, six checkpoints of each model
(`<model>-<format>/`), every linear layer of every decoder layer quantized,
the embeddings, norms, biases and lm_head left as they were (`ignore:
["lm_head"]`):

- `-int8`: compressed-tensors `int-quantized`, int8, symmetric, one f32
  scale per output channel (`weight_scale` `[out, 1]`);
- `-fp8`: compressed-tensors `float-quantized`, FP8 e4m3, one f32 scale
  per output channel;
- `-int4`: compressed-tensors `pack-quantized`, 4 bits, symmetric, one
  bf16 scale per group of 32 inputs (`weight_scale` `[out, in / 32]`),
  eight values to an int32 (each plus 8, column c in bits 4 (c mod 8) of
  word c / 8);
- `-int4-asym`: the same, asymmetric: signed zero points per output and
  group (`weight_zero_point` `[out / 8, in / 32]`, packed eight to an
  int32 along the output, each plus 8);
- `-gptq`: GPTQ 4-bit as AutoGPTQ stores it (`qweight` packed along the
  input, `qzeros` along the output and stored minus one, f16 `scales`,
  `g_idx`), groups of 32, symmetric;
- `-awq`: AWQ 4-bit as AutoAWQ stores it (GEMM layout: `qweight` and
  `qzeros` packed along the output in the order 0 2 4 6 1 3 5 7, f16
  `scales`), groups of 32, with zero points;

and `golden_quantized.json`: for each of them, the base model and every
adapter of its dense model, the greedy tokens and the last prompt
position's logits of transformers + PEFT run in f32 on the weights
dequantized here with the format's formula, (q - zero_point) * scale in
f32. Nothing here shares code with the Rust reader.
"""

import json
import os
import shutil
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import MAX_NEW, PROMPTS  # noqa: E402

from tokenizers import Tokenizer  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The dense fixtures quantized, and every one of their adapters.
SOURCES = {
    "llama-gqa": [
        "qv-r8", "all-linear-rslora", "patterns", "layer1-mlp", "k-r16",
        "o-r2", "down-r12", "qkvo-r4", "gate-up-r8", "layer0-q",
    ],
    "qwen2-tied": ["qv-r8", "all-linear-r4"],
}
GROUP = 32


def quantization_config(fmt, num_bits, kind, strategy, group_size=None, symmetric=True):
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": num_bits,
                    "type": kind,
                    "symmetric": symmetric,
                    "strategy": strategy,
                    "group_size": group_size,
                    "dynamic": False,
                },
                "input_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }


def int8_channel(w):
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8)
    stored = {"weight": q, "weight_scale": scale.to(torch.float32)}
    return stored, q.to(torch.float32) * scale.to(torch.float32)


def fp8_channel(w):
    scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).to(torch.float32)
    q = (w / scale).to(torch.float8_e4m3fn)
    stored = {"weight": q, "weight_scale": scale}
    return stored, q.to(torch.float32) * scale


def int4_group(w):
    out, fan_in = w.shape
    groups = w.reshape(out, fan_in // GROUP, GROUP)
    scale = (groups.abs().amax(dim=2) / 7.0).to(torch.bfloat16)
    s32 = scale.to(torch.float32)
    q = torch.clamp(torch.round(groups / s32.unsqueeze(2)), -8, 7).to(torch.int32).reshape(out, fan_in)
    # Eight values to a word: value + 8 in bits 4 * (c % 8) of word c // 8.
    u = (q + 8).to(torch.int64)
    words = torch.zeros(out, fan_in // 8, dtype=torch.int64)
    for i in range(8):
        words |= u[:, i::8] << (4 * i)
    packed = (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement
    deq = (q.to(torch.float32).reshape(out, fan_in // GROUP, GROUP) * s32.unsqueeze(2)).reshape(out, fan_in)
    stored = {
        "weight_packed": packed,
        "weight_shape": torch.tensor([out, fan_in], dtype=torch.int32),
        "weight_scale": scale,
    }
    return stored, deq


def int4_group_asymmetric(w):
    """compressed-tensors pack-quantized, asymmetric: signed 4-bit values
    q in [-8, 7] and signed zero points z in [-8, 7], w = (q - z) * scale.
    The weights are packed as int4_group's; the zero points too, each plus
    8, but along the output: weight_zero_point [out / 8, groups], output o
    in bits 4 (o % 8) of word row o // 8."""
    out, fan_in = w.shape
    groups = w.reshape(out, fan_in // GROUP, GROUP)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((hi - lo) / 15.0).to(torch.bfloat16)  # [out, groups]
    s32 = scale.to(torch.float32)
    zero = torch.clamp(torch.round(-8.0 - lo / s32), -8, 7)  # [out, groups]
    q = torch.clamp(torch.round(groups / s32.unsqueeze(2)) + zero.unsqueeze(2), -8, 7)
    deq = ((q - zero.unsqueeze(2)) * s32.unsqueeze(2)).reshape(out, fan_in)
    u = (q.reshape(out, fan_in) + 8).to(torch.int64)
    words = torch.zeros(out, fan_in // 8, dtype=torch.int64)
    for i in range(8):
        words |= u[:, i::8] << (4 * i)
    packed = (words - ((words >> 31) << 32)).to(torch.int32)
    stored = {
        "weight_packed": packed,
        "weight_shape": torch.tensor([out, fan_in], dtype=torch.int32),
        "weight_scale": scale,
        "weight_zero_point": pack_rows((zero + 8).to(torch.int32)),
    }
    return stored, deq


def pack_rows(values):
    """Eight 4-bit values along the rows to an int32: row r in bits 4 (r % 8) of word row r // 8."""
    rows, cols = values.shape
    words = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for i in range(8):
        words |= values[i::8, :].to(torch.int64) << (4 * i)
    return (words - ((words >> 31) << 32)).to(torch.int32)


def gptq_group(w):
    """GPTQ as AutoGPTQ stores it (checkpoint_format "gptq"): qweight [in/8, out]
    packed along the input, qzeros [groups, out/8] packed along the output and
    stored minus one, scales [groups, out] in f16, g_idx [in]."""
    out, fan_in = w.shape
    groups = w.reshape(out, fan_in // GROUP, GROUP)
    scale = (groups.abs().amax(dim=2) / 7.0).to(torch.float16)  # [out, groups]
    s32 = scale.to(torch.float32)
    zero = 8
    q = torch.clamp(torch.round(groups / s32.unsqueeze(2)) + zero, 0, 15).to(torch.int32).reshape(out, fan_in)
    qweight = pack_rows(q.t().contiguous())  # [in/8, out]
    zeros = torch.full((fan_in // GROUP, out), zero - 1, dtype=torch.int32)
    qzeros = pack_rows(zeros.t().contiguous()).t().contiguous()  # [groups, out/8]
    g_idx = torch.arange(fan_in, dtype=torch.int32) // GROUP
    deq = ((q.to(torch.float32) - zero).reshape(out, fan_in // GROUP, GROUP) * s32.unsqueeze(2)).reshape(out, fan_in)
    stored = {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().contiguous(), "g_idx": g_idx}
    return stored, deq


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_awq(values):
    """AutoAWQ's GEMM packing of [rows, cols] 4-bit values: word w of a row
    holds column 8 w + AWQ_ORDER[i] in bits 4 i."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, c in enumerate(AWQ_ORDER):
        words |= values[:, c::8].to(torch.int64) << (4 * i)
    return (words - ((words >> 31) << 32)).to(torch.int32)


def awq_group(w):
    """AWQ as AutoAWQ stores it (version "gemm"): asymmetric, scales and zero
    points per group of 32 inputs and output; qweight [in, out/8] and qzeros
    [groups, out/8] packed along the output in AWQ's order, f16 scales."""
    out, fan_in = w.shape
    groups = w.reshape(out, fan_in // GROUP, GROUP)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((hi - lo) / 15.0).to(torch.float16)  # [out, groups]
    s32 = scale.to(torch.float32)
    zero = torch.clamp(torch.round(-lo / s32), 0, 15)
    q = torch.clamp(torch.round(groups / s32.unsqueeze(2)) + zero.unsqueeze(2), 0, 15)
    deq = ((q - zero.unsqueeze(2)) * s32.unsqueeze(2)).reshape(out, fan_in)
    q = q.to(torch.int32).reshape(out, fan_in)
    stored = {
        "qweight": pack_awq(q.t().contiguous()),
        "qzeros": pack_awq(zero.to(torch.int32).t().contiguous()),
        "scales": scale.t().contiguous(),
    }
    return stored, deq


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}

GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True, "checkpoint_format": "gptq"}

FORMATS = {
    "int8": (int8_channel, quantization_config("int-quantized", 8, "int", "channel")),
    "fp8": (fp8_channel, quantization_config("float-quantized", 8, "float", "channel")),
    "int4": (int4_group, quantization_config("pack-quantized", 4, "int", "group", GROUP)),
    "int4-asym": (
        int4_group_asymmetric,
        quantization_config("pack-quantized", 4, "int", "group", GROUP, symmetric=False),
    ),
    "gptq": (gptq_group, GPTQ_CONFIG),
    "awq": (awq_group, AWQ_CONFIG),
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "worker/engine/tests/fixtures"
    golden = {"max_new_tokens": MAX_NEW, "cases": []}
    for source, adapters in SOURCES.items():
        for fmt, (quantize, qconfig) in FORMATS.items():
            write_variant(out, source, adapters, f"{source}-{fmt}", quantize, qconfig, golden)
    with open(os.path.join(out, "golden_quantized.json"), "w") as f:
        json.dump(golden, f)
    print(f"wrote {len(golden['cases'])} golden cases to {out}")


def read_dense(src):
    index = os.path.join(src, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(src, "model.safetensors"))
    dense = {}
    for shard in sorted(set(json.load(open(index))["weight_map"].values())):
        dense.update(load_file(os.path.join(src, shard)))
    return dense


def write_variant(out, source, adapters, variant, quantize, qconfig, golden):
    src = os.path.join(out, source)
    dense = read_dense(src)
    tok = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    stored, dequantized = {}, {}
    for name, t in dense.items():
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        if stem and stem.split(".")[-1] in LINEARS and stem.startswith("model.layers."):
            parts, deq = quantize(t.to(torch.float32))
            for k, v in parts.items():
                stored[f"{stem}.{k}"] = v.contiguous()
            dequantized[name] = deq
        else:
            stored[name] = t
            dequantized[name] = t.to(torch.float32)
    path = os.path.join(out, variant)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    save_file(stored, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = qconfig
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, extra), path)

    # The reference: the dequantized weights as a plain f32 checkpoint.
    ref = os.path.join(out, f".{variant}-dequantized")
    shutil.rmtree(ref, ignore_errors=True)
    os.makedirs(ref)
    save_file({k: v.contiguous() for k, v in dequantized.items()}, os.path.join(ref, "model.safetensors"), metadata={"format": "pt"})
    plain = dict(config)
    del plain["quantization_config"]
    with open(os.path.join(ref, "config.json"), "w") as f:
        json.dump(plain, f)

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
                {"model": variant, "adapter": adapter, "prompt": prompt, "prompt_ids": ids, "greedy": gen, "logits": logits}
            )

    record(AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval(), None)
    for adapter in adapters:
        adir = os.path.join(out, "adapters", source, adapter)
        m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32), adir).eval()
        record(m, adapter)
    shutil.rmtree(ref)


if __name__ == "__main__":
    main()
