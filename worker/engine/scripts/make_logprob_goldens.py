#!/usr/bin/env python3
"""Builds the log-probability goldens with Hugging Face transformers + PEFT.

Run by hand, never by CI (the models and adapters are the committed
fixtures; this script only reads them):

    python3 -m venv .venv && .venv/bin/pip install torch transformers peft safetensors tokenizers
    .venv/bin/python worker/engine/scripts/make_logprob_goldens.py worker/engine/tests/fixtures

For every fixture model (dense and MoE), the base and each of its adapters,
and each prompt, it writes to `golden_logprobs.json`:

- `prompt`: for every prompt position after the first, the token there, its
  log probability given the tokens before it, and the TOP most likely tokens
  with theirs (what OpenAI's `echo` with `logprobs` returns);
- `completion`: NEW greedy tokens (argmax, lowest id among ties; stopping at
  an end-of-sequence id), each with its log probability and the TOP most
  likely tokens.

Log probabilities are log_softmax over the whole vocabulary of the f32
logits, before any sampling control, computed here with torch alone.

It also writes `controls`: greedy tokens (CONTROL_NEW of them, past any
end-of-sequence id) under each sampling control that changes the logits,
applied by reference code that is not lorafleet's: transformers'
RepetitionPenaltyLogitsProcessor for `repetition_penalty`, and OpenAI's
published formulas for `frequency_penalty`, `presence_penalty` (over the
completion's tokens) and `logit_bias` (added).
"""

import json
import os
import sys

import torch
from peft import PeftModel
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

PROMPTS = [
    "The quick brown fox",
    "Grüße aus München! 🚀",
]
NEW = 6
TOP = 5
EOS = [2, 4]


def entry(logprobs_row, token):
    values, ids = torch.topk(logprobs_row, TOP)
    # torch.topk's order among equal values is unspecified; ties by lower id.
    top = sorted(zip(ids.tolist(), values.tolist()), key=lambda p: (-p[1], p[0]))
    return {"token": token, "logprob": logprobs_row[token].item(), "top": [[i, v] for i, v in top]}


def record(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        prompt = [entry(lp[p - 1], ids[p]) for p in range(1, len(ids))]
        seq = list(ids)
        completion = []
        row = lp[-1]
        for _ in range(NEW):
            # argmax with the lowest id among ties
            best = row.max()
            token = int((row == best).nonzero()[0].item())
            completion.append(entry(row, token))
            if token in EOS:
                break
            seq.append(token)
            row = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), dim=-1)
    return prompt, completion


CONTROL_NEW = 10
CONTROLS = [
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 1.8},
    {"frequency_penalty": 0.7, "presence_penalty": 0.4, "repetition_penalty": 1.2},
    {"logit_bias": {"7": 6.0, "100": -100.0}},
]


def controlled(model, ids, control):
    seq = list(ids)
    out = []
    rep = control.get("repetition_penalty", 1.0)
    freq = control.get("frequency_penalty", 0.0)
    pres = control.get("presence_penalty", 0.0)
    bias = control.get("logit_bias", {})
    with torch.no_grad():
        for _ in range(CONTROL_NEW):
            logits = model(torch.tensor([seq])).logits[0, -1].float().clone()
            for k, v in bias.items():
                logits[int(k)] += v
            if rep != 1.0:
                logits = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([seq]), logits[None])[0]
            for t in set(out):
                logits[t] -= out.count(t) * freq + pres
            best = logits.max()
            token = int((logits == best).nonzero()[0].item())
            out.append(token)
            seq.append(token)
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "worker/engine/tests/fixtures"
    tok = Tokenizer.from_file(os.path.join(root, "tokenizer", "tokenizer.json"))
    cases = []
    for model_name in ["llama-gqa", "qwen2-tied", "qwen3-moe", "mixtral-moe"]:
        path = os.path.join(root, model_name)
        adapters_dir = os.path.join(root, "adapters", model_name)
        for adapter in [None] + sorted(os.listdir(adapters_dir)):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, os.path.join(adapters_dir, adapter))
            model.eval()
            for text in PROMPTS:
                ids = tok.encode(text).ids
                prompt, completion = record(model, ids)
                cases.append(
                    {
                        "model": model_name,
                        "adapter": adapter,
                        "prompt_ids": ids,
                        "prompt": prompt,
                        "completion": completion,
                    }
                )
    controls = []
    for adapter in [None, "qv-r8"]:
        path = os.path.join(root, "llama-gqa")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, os.path.join(root, "adapters", "llama-gqa", adapter))
        model.eval()
        ids = tok.encode(PROMPTS[0]).ids
        for control in CONTROLS:
            controls.append(
                {"model": "llama-gqa", "adapter": adapter, "prompt_ids": ids, "control": control,
                 "greedy": controlled(model, ids, control), "plain": controlled(model, ids, {})}
            )
    out = os.path.join(root, "golden_logprobs.json")
    with open(out, "w") as f:
        json.dump({"top": TOP, "new_tokens": NEW, "cases": cases, "controls": controls}, f)
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
