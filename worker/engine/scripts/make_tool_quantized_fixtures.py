#!/usr/bin/env python3
"""Quantized checkpoints written by the tools themselves, and their goldens
read back by those tools' own readers.

Run by hand, never by CI, after make_fixtures.py (it quantizes that
script's `llama-gqa`):

    python3 -m venv .venv && .venv/bin/pip install llmcompressor peft
    .venv/bin/python worker/engine/scripts/make_tool_quantized_fixtures.py worker/engine/tests/fixtures

(made with llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers
5.17.0, peft 0.21.2, torch 2.14.0 on the CPU).

It writes `llama-gqa-tool-<scheme>/` (every scheme, from the f32
`llama-gqa`) and `qwen2-tied-tool-<scheme>/` (the 8-bit packed, FP8 block
and transformers FP8 ones, from the bf16 `qwen2-tied` as stored: bf16
scales, q/k/v biases, the embeddings tied to the lm_head), each a
checkpoint as the tool saves it:

- compressed-tensors, by llm-compressor's `oneshot` with one
  `QuantizationModifier` (round to nearest, no calibration data), every
  decoder `Linear` quantized, `lm_head` ignored, for each scheme below. The
  schemes are llm-compressor's presets with the group and block sizes
  shrunk to the 64- and 96-wide test model (`W8A16` is groups of 128 and
  `FP8_BLOCK` blocks of 128 x 128 at full size; `fp8-block` keeps the
  preset's 128 x 128, one partial block per matrix);
- transformers' own `fp8` format (`quant_method: "fp8"`, `weight_block_size`,
  `weight_scale_inv`), the format of the official Qwen3-*-FP8 and DeepSeek
  releases, quantized by transformers' `Fp8Quantize` (the conversion its
  `FineGrainedFP8Config` applies on the GPU, called here on the CPU).

and `golden_tool_quantized.json`: for each checkpoint, the base model and
two adapters of its dense model, the greedy tokens and the last prompt
position's logits of transformers + PEFT on the checkpoint as transformers
loads it: `CompressedTensorsConfig(dequantize=True)` (the weights
decompressed by compressed-tensors; input activations still quantized on
the fly where the scheme asks, as its forward does) and
`FineGrainedFP8Config(dequantize=True)` (the weights dequantized by
transformers, activations as they are). Nothing here shares code with the
Rust reader.
"""

import json
import os
import shutil
import sys

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from peft import PeftModel
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM,
    CompressedTensorsConfig,
    FineGrainedFP8Config,
)
from transformers.integrations.finegrained_fp8 import Fp8Quantize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import MAX_NEW, golden_cases  # noqa: E402

# dense model -> (the dtype it is stored in, its adapters, its schemes)
SOURCES = {
    "llama-gqa": (torch.float32, ["qv-r8", "all-linear-rslora"], None),
    "qwen2-tied": (torch.bfloat16, ["qv-r8", "all-linear-r4"], ["w8a16", "w8a16-asym", "fp8-block32", "hf-fp8"]),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weights(**kw):
    return QuantizationArgs(**kw)


# name -> (weights, input activations): the presets, sizes shrunk.
SCHEMES = {
    # W8A16: 8-bit int weights, pack-quantized (four to an int32).
    "w8a16": (weights(num_bits=8, type="int", strategy="group", group_size=32, symmetric=True), None),
    "w8a16-asym": (weights(num_bits=8, type="int", strategy="group", group_size=32, symmetric=False), None),
    "w8a16-channel": (weights(num_bits=8, type="int", strategy="channel", symmetric=True), None),
    # W4A16 and W4A16_ASYM.
    "w4a16": (weights(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True), None),
    "w4a16-asym": (weights(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False), None),
    # INT8_W8A8: int8 weights per channel, int8 activations per token.
    "w8a8": (
        weights(num_bits=8, type="int", strategy="channel", symmetric=True),
        weights(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True),
    ),
    # FP8_DYNAMIC: FP8 weights per channel, FP8 activations per token.
    "fp8-dynamic": (
        weights(num_bits=8, type="float", strategy="channel", symmetric=True),
        weights(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True),
    ),
    # FP8_BLOCK: FP8 weights per block, FP8 activations per group of inputs.
    "fp8-block32": (
        weights(num_bits=8, type="float", strategy="block", block_structure=[32, 32], symmetric=True),
        weights(num_bits=8, type="float", strategy="group", group_size=32, symmetric=True, dynamic=True),
    ),
    "fp8-block": (
        weights(num_bits=8, type="float", strategy="block", block_structure=[128, 128], symmetric=True),
        None,
    ),
}

# transformers' fp8 at the test model's size (blocks must divide the matrix).
HF_FP8_BLOCK = (32, 32)


def copy_tokenizer(src, path):
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, extra), path)


def write_compressed(out, source, name, w, a):
    src = os.path.join(out, source)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=SOURCES[source][0])
    scheme = QuantizationScheme(targets=["Linear"], weights=w, input_activations=a)
    oneshot(model=model, recipe=QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    path = os.path.join(out, name)
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path, save_compressed=True)
    copy_tokenizer(src, path)
    return path


class _Quantizer:
    """What `Fp8Quantize` reads of the quantizer that owns it."""

    def __init__(self, config):
        self.quantization_config = config


def write_transformers_fp8(out, source, name):
    src = os.path.join(out, source)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=SOURCES[source][0])
    config = FineGrainedFP8Config(weight_block_size=HF_FP8_BLOCK, modules_to_not_convert=["lm_head"])
    quantize = Fp8Quantize(_Quantizer(config))
    stored = {}
    tied = model.config.tie_word_embeddings
    for key, t in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue
        stem = key[: -len(".weight")] if key.endswith(".weight") else None
        if stem and stem.startswith("model.layers.") and stem.split(".")[-1] in LINEARS:
            stored.update(quantize._quantize_one(key, t))
        else:
            stored[key] = t
    path = os.path.join(out, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    save_file({k: v.contiguous() for k, v in stored.items()}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    # As the official releases write it.
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(HF_FP8_BLOCK),
        "modules_to_not_convert": ["lm_head"],
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for extra in ("generation_config.json",):
        shutil.copy(os.path.join(src, extra), path)
    copy_tokenizer(src, path)
    return path


def record(golden, tok, source, name, path, qconfig):
    def load():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=qconfig).eval()

    def run(m, adapter):
        golden["cases"].extend(golden_cases(m, tok, name, adapter))

    run(load(), None)
    for adapter in SOURCES[source][1]:
        adir = os.path.join(os.path.dirname(path), "adapters", source, adapter)
        run(PeftModel.from_pretrained(load(), adir).eval(), adapter)


def main():
    torch.manual_seed(0)
    out = sys.argv[1] if len(sys.argv) > 1 else "worker/engine/tests/fixtures"
    golden = {"max_new_tokens": MAX_NEW, "cases": []}
    for source, (_, _, only) in SOURCES.items():
        tok = Tokenizer.from_file(os.path.join(out, source, "tokenizer.json"))
        for scheme, (w, a) in SCHEMES.items():
            if only is None or scheme in only:
                name = f"{source}-tool-{scheme}"
                path = write_compressed(out, source, name, w, a)
                record(golden, tok, source, name, path, CompressedTensorsConfig(dequantize=True))
        if only is None or "hf-fp8" in only:
            name = f"{source}-tool-hf-fp8"
            path = write_transformers_fp8(out, source, name)
            record(golden, tok, source, name, path, FineGrainedFP8Config(dequantize=True))
    with open(os.path.join(out, "golden_tool_quantized.json"), "w") as f:
        json.dump(golden, f)
    print(f"wrote {len(golden['cases'])} golden cases to {out}")


if __name__ == "__main__":
    main()
