#!/usr/bin/env python3
"""Adapters that carry more than LoRA factors, made by PEFT, and their
goldens from PEFT itself:

- `modules_to_save` of `lm_head` and `embed_tokens`: a whole trained copy
  of the layer (`base_model.model.lm_head.weight`,
  `base_model.model.model.embed_tokens.weight`), which PEFT uses in place
  of the model's for that adapter;
- `trainable_token_indices`: new values for some rows of the embeddings
  (`….embed_tokens.token_adapter.trainable_tokens_delta` `[n, hidden]`),
  and of the lm_head too where the model ties the two or the dict names
  it.

Run by hand, never by CI, after make_fixtures.py (it adapts that script's
`llama-gqa`, `qwen2-tied` and make_moe_fixtures.py's `mixtral-moe`):

    python3 -m venv .venv && .venv/bin/pip install torch transformers peft safetensors tokenizers
    .venv/bin/python worker/engine/scripts/make_saved_module_fixtures.py worker/engine/tests/fixtures

(`--tool-only` remakes only the adapter that ships its own tokenizer,
`--grown-only` only the one whose vocabulary is grown past the base's.)

(made with peft 0.21.2, transformers 5.24.0, torch 2.15.0.)

The saved copies are the base's values moved by noise (as training would
move them), and the trainable rows random, so each adapter's tokens differ
from the base's. The token rows are tokens of the golden prompts, so they
are read on the way in. It writes `adapters/saved/<model>/<name>/` and
`golden_saved.json`: for each adapter and prompt, the greedy tokens and the
last prompt position's logits of transformers + PEFT in f32. Nothing here
shares code with the Rust engine.
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
from make_fixtures import MAX_NEW, PROMPTS, golden_cases, randomize_lora  # noqa: E402


def prompt_tokens(tok, k):
    """k distinct token ids of the golden prompts, a few from each."""
    seen = []
    for p in PROMPTS:
        for t in tok.encode(p).ids[1:4]:
            if t not in seen:
                seen.append(t)
    return sorted(seen[:k])


ADAPTERS = {
    "llama-gqa": [
        ("head-qv-r4", lambda tok: dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])),
        ("embed-head-o-r4", lambda tok: dict(r=4, lora_alpha=4, target_modules=["o_proj"], modules_to_save=["embed_tokens", "lm_head"])),
        ("tokens-q-r4", lambda tok: dict(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=prompt_tokens(tok, 5))),
        (
            "tokens-dict-r2",
            lambda tok: dict(
                r=2,
                lora_alpha=4,
                target_modules=["k_proj"],
                trainable_token_indices={"embed_tokens": prompt_tokens(tok, 3), "lm_head": [7, 11, 200]},
            ),
        ),
    ],
    # Tied embeddings: trainable rows change the lm_head's rows too (PEFT
    # ties them); a saved lm_head is the adapter's own, the embeddings stay
    # the base's.
    "qwen2-tied": [
        ("tokens-tied-r4", lambda tok: dict(r=4, lora_alpha=8, target_modules=["v_proj"], trainable_token_indices=prompt_tokens(tok, 4))),
        ("head-r4", lambda tok: dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])),
    ],
    "mixtral-moe": [
        ("head-tokens-r4", lambda tok: dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"], trainable_token_indices=prompt_tokens(tok, 3))),
    ],
}


def save_adapter(peft_model, adir, model):
    """Saves as PEFT does, then points the config at the fixture base (and
    sorts its targets, so the file does not depend on set order)."""
    shutil.rmtree(adir, ignore_errors=True)
    peft_model.save_pretrained(adir)
    os.remove(os.path.join(adir, "README.md"))
    cfg_path = os.path.join(adir, "adapter_config.json")
    c = json.load(open(cfg_path))
    c["base_model_name_or_path"] = f"worker/engine/tests/fixtures/{model}"
    c["target_modules"] = sorted(c["target_modules"])
    with open(cfg_path, "w") as f:
        json.dump(c, f, indent=2)


def move_saved(model, seed):
    """Moves the saved copies and the trainable rows off their initial
    values (PEFT starts both as copies of the base's)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
            elif "trainable_tokens_delta" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


# An adapter that ships its own tokenizer: the base's, with the row of a
# rare token (383, "wap") given to a new one, `<tool>`, as Unsloth renames
# Llama 3's reserved tokens; that row trained in the embeddings and the
# lm_head, so the adapter reads and writes `<tool>`.
TOOL_ID, TOOL = 383, "<tool>"
TOOL_PROMPTS = ["Call <tool> now", "The quick brown fox"]


def tool_tokenizer(base_path, adir):
    tok = json.load(open(os.path.join(base_path, "tokenizer.json")))
    # The row's old piece leaves the vocabulary, with the merges that make
    # or use it (the tokenizer refuses an added token on a taken id).
    vocab = tok["model"]["vocab"]
    old = next(p for p, i in vocab.items() if i == TOOL_ID)
    del vocab[old]

    def pair(m):
        return m.split(" ") if isinstance(m, str) else m

    tok["model"]["merges"] = [m for m in tok["model"]["merges"] if old not in pair(m) and "".join(pair(m)) != old]
    tok["added_tokens"].append(
        {"id": TOOL_ID, "content": TOOL, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": False}
    )
    with open(os.path.join(adir, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    return Tokenizer.from_file(os.path.join(adir, "tokenizer.json"))


def make_tool_adapter(out):
    """`adapters/saved/llama-gqa/tool-token-r4` and
    `golden_adapter_tokenizer.json`: per prompt, the ids the adapter's
    tokenizer gives and the base's, transformers + PEFT's last-position
    logits and greedy tokens on the adapter's ids, and those tokens as the
    adapter's tokenizer decodes them."""
    model = "llama-gqa"
    path = os.path.join(out, model)
    base_tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    adir = os.path.join(out, "adapters", "saved", model, "tool-token-r4")
    for seed in range(9900, 9950):
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        cfg = LoraConfig(
            task_type="CAUSAL_LM",
            lora_dropout=0.0,
            r=4,
            lora_alpha=8,
            target_modules=["q_proj"],
            trainable_token_indices={"embed_tokens": [TOOL_ID], "lm_head": [TOOL_ID]},
        )
        peft_model = get_peft_model(base, cfg)
        randomize_lora(peft_model, seed)
        move_saved(peft_model, seed + 100)
        save_adapter(peft_model, adir, model)
        tok = tool_tokenizer(path, adir)
        m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adir).eval()
        cases = []
        for prompt in TOOL_PROMPTS:
            ids = tok.encode(prompt).ids
            x = torch.tensor([ids])
            with torch.no_grad():
                logits = m(x).logits[0, -1].tolist()
                gen = m.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=[2, 4], pad_token_id=0)[0, len(ids):].tolist()
            cases.append({
                "prompt": prompt,
                "prompt_ids": ids,
                "base_prompt_ids": base_tok.encode(prompt).ids,
                "greedy": gen,
                "text": tok.decode(gen, skip_special_tokens=True),
                "logits": logits,
            })
        # The new token is read (the first prompt) and written (some answer).
        if TOOL_ID in cases[0]["prompt_ids"] and any(TOOL_ID in c["greedy"] for c in cases):
            with open(os.path.join(out, "golden_adapter_tokenizer.json"), "w") as f:
                json.dump({"adapter": "tool-token-r4", "token": TOOL, "id": TOOL_ID, "cases": cases}, f)
            print(f"tool-token-r4 with seed {seed}")
            return
    raise SystemExit("no seed made the adapter write its new token")


# An adapter trained on a vocabulary grown past the base's, as Unsloth,
# Axolotl and LLaMA-Factory make one when they add chat tokens: the tokens
# appended to the tokenizer, `resize_token_embeddings`, and both layers in
# `modules_to_save` (so the new rows are saved, whole).
NEW_TOKENS = ["<|tool_call|>", "<|tool_result|>", "<think>"]
GROWN_PROMPTS = ["<think> The quick brown fox", "Call <|tool_call|> now", "SELECT * FROM adapters"]


def grown_tokenizer(base_path, adir, first_id):
    tok = json.load(open(os.path.join(base_path, "tokenizer.json")))
    for i, t in enumerate(NEW_TOKENS):
        # The tool markers special (skipped when decoding), <think> text.
        tok["added_tokens"].append(
            {"id": first_id + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": i < 2}
        )
    with open(os.path.join(adir, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    return Tokenizer.from_file(os.path.join(adir, "tokenizer.json"))


def make_grown_adapter(out):
    """`adapters/saved/llama-gqa/grown-vocab-r4` and
    `golden_grown_vocab.json`: per prompt, the adapter tokenizer's ids,
    transformers + PEFT's last-position logits (over the grown vocabulary)
    and greedy tokens, on a base resized as its users load it
    (`resize_token_embeddings` to the adapter's rows, then the adapter)."""
    model = "llama-gqa"
    path = os.path.join(out, model)
    base_rows = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    rows = base_rows + len(NEW_TOKENS)
    adir = os.path.join(out, "adapters", "saved", model, "grown-vocab-r4")

    def resized():
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        # transformers draws the new rows from the old ones' distribution.
        torch.manual_seed(0)
        m.resize_token_embeddings(rows)
        return m

    for seed in range(9960, 10060):
        cfg = LoraConfig(
            task_type="CAUSAL_LM",
            lora_dropout=0.0,
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            modules_to_save=["embed_tokens", "lm_head"],
        )
        peft_model = get_peft_model(resized(), cfg)
        randomize_lora(peft_model, seed)
        move_saved(peft_model, seed + 100)
        # The new rows trained further than the old ones moved.
        g = torch.Generator().manual_seed(seed + 200)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "modules_to_save" in name:
                    p[base_rows:].add_(torch.randn(p[base_rows:].shape, generator=g) * 0.15)
        save_adapter(peft_model, adir, model)
        tok = grown_tokenizer(path, adir, base_rows)
        m = PeftModel.from_pretrained(resized(), adir).eval()
        cases = []
        for prompt in GROWN_PROMPTS:
            ids = tok.encode(prompt).ids
            x = torch.tensor([ids])
            with torch.no_grad():
                logits = m(x).logits[0, -1].tolist()
                gen = m.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=[2, 4], pad_token_id=0)[0, len(ids):].tolist()
            assert len(logits) == rows
            cases.append({
                "model": model,
                "adapter": "grown-vocab-r4",
                "prompt": prompt,
                "prompt_ids": ids,
                "greedy": gen,
                "text": tok.decode(gen, skip_special_tokens=True),
                "logits": logits,
            })
        # New tokens are read (the first two prompts) and written (some answer).
        read = all(any(t >= base_rows for t in c["prompt_ids"]) for c in cases[:2])
        if read and any(t >= base_rows for c in cases for t in c["greedy"]):
            with open(os.path.join(out, "golden_grown_vocab.json"), "w") as f:
                json.dump({"adapter": "grown-vocab-r4", "rows": rows, "tokens": NEW_TOKENS, "max_new_tokens": MAX_NEW, "cases": cases}, f)
            print(f"grown-vocab-r4 with seed {seed}")
            return
    raise SystemExit("no seed made the adapter write a new token")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = args[0] if args else "worker/engine/tests/fixtures"
    if "--tool-only" in sys.argv:
        make_tool_adapter(out)
        return
    if "--grown-only" in sys.argv:
        make_grown_adapter(out)
        return
    golden = {"max_new_tokens": MAX_NEW, "cases": []}
    for i, (model, adapters) in enumerate(ADAPTERS.items()):
        path = os.path.join(out, model)
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        for j, (name, kwargs) in enumerate(adapters):
            base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            peft_model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **kwargs(tok)))
            randomize_lora(peft_model, 9700 + 10 * i + j)
            move_saved(peft_model, 9800 + 10 * i + j)
            adir = os.path.join(out, "adapters", "saved", model, name)
            save_adapter(peft_model, adir, model)
            m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adir).eval()
            cases = golden_cases(m, tok, model, name)
            # The adapter must change what the model does.
            plain = golden_cases(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok, model, None)
            assert any(a["greedy"] != b["greedy"] for a, b in zip(cases, plain)), name
            golden["cases"].extend(cases)
    with open(os.path.join(out, "golden_saved.json"), "w") as f:
        json.dump(golden, f)
    print(f"wrote {len(golden['cases'])} golden cases to {out}/golden_saved.json")
    make_tool_adapter(out)
    make_grown_adapter(out)


if __name__ == "__main__":
    main()
