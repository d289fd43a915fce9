#!/usr/bin/env python3
"""Trains the demo base model and its adapters, and records their goldens.

Run by hand, never by CI (CI uses the committed artifacts):

    apt-get install bible-kjv
    python3 -m venv .venv && .venv/bin/pip install torch transformers peft safetensors tokenizers
    .venv/bin/python deploy/demo/train.py deploy/demo

The training text is the King James Version of the Bible as Debian's
`bible-kjv-text` package ships it (read through its `bible` program); the
text's copyright has expired (deploy/demo/README.md). Everything is seeded
(SEED below), and runs on 2 CPU cores in about half an hour.

It writes, under the output directory:

- `kjv-small/`: a small Llama (grouped-query attention, tied embeddings)
  with a byte-level BPE tokenizer trained on the same text, stored in bf16;
- `adapters/kjv-small/<name>/`: PEFT LoRA adapters (rank <= 16) trained on
  the same verses rewritten three ways, so that each continues a prompt in
  its own visible style:
  - `shout` (and `shout-v2`, a second version for a canary): in capitals;
  - `telegram`: in lower case, every stop written STOP;
  - `verse`: in short lines of four words;
- `golden.json`: for each (adapter or base, prompt), the greedy tokens and
  text from transformers + PEFT, run in f32 on the stored bf16 weights;
- `digests.json`: the base hash and the artifact digests, computed here
  independently of the Rust code.
"""

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "worker", "engine", "scripts"))
from make_fixtures import artifact_digest, canonical_base_hash  # noqa: E402

SEED = 20261124
MODEL = "kjv-small"
VOCAB = 2048
SEQ = 128
BATCH = 32
BASE_STEPS = int(os.environ.get("DEMO_BASE_STEPS", "900"))
ADAPTER_STEPS = int(os.environ.get("DEMO_ADAPTER_STEPS", "200"))
MAX_NEW = 24
SPECIALS = ["<unk>", "<s>", "</s>"]
PROMPTS = ["And God said", "Blessed are the", "In the beginning"]

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def verses():
    """The KJV, one verse per line, without the references."""
    if shutil.which("bible") is None:
        sys.exit("the `bible` program is missing: apt-get install bible-kjv")
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True)
    lines = [re.sub(r"^\S+?\d+:\d+\s+", "", l).strip() for l in out.stdout.splitlines()]
    lines = [l for l in lines if l]
    assert len(lines) > 30000, f"only {len(lines)} verses"
    return lines


def shout(v):
    return v.upper()


def telegram(v):
    v = re.sub(r"\s*[,;:.?!]+", " STOP", v.lower())
    return re.sub(r"\s+", " ", v).strip()


def verse(v):
    words = v.split()
    return "\n".join(" ".join(words[i : i + 4]) for i in range(0, len(words), 4)) + "\n"


STYLES = {"shout": shout, "telegram": telegram, "verse": verse}
# name -> (style, LoRA settings, seed offset)
ADAPTERS = {
    "shout": ("shout", dict(r=8, lora_alpha=16), 1),
    "shout-v2": ("shout", dict(r=16, lora_alpha=16), 2),
    "telegram": ("telegram", dict(r=8, lora_alpha=16), 3),
    "verse": ("verse", dict(r=8, lora_alpha=16), 4),
}


def build_tokenizer(lines, out):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = list(lines) + [f(l) for f in STYLES.values() for l in lines[::3]]
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 512,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            f,
            indent=2,
        )
    return tok


def ids(tok, text):
    """Token ids of text without the BOS the post-processor adds."""
    return tok.encode(text, add_special_tokens=False).ids


class Stream:
    """Training windows: BOS, then SEQ tokens of running text."""

    def __init__(self, tok, lines, style, rng):
        self.tok, self.lines, self.style, self.rng = tok, lines, style, rng
        self.bos = tok.token_to_id("<s>")

    def sample(self):
        while True:
            i = self.rng.randrange(len(self.lines) - 12)
            if self.style is None:
                # The base sees every style too (a tenth of its windows
                # each, whole windows), as a pretrained model has seen
                # capitals and verse; it continues a plain prompt plainly.
                style = self.rng.choices([None] + list(STYLES.values()), weights=[7, 1, 1, 1])[0]
                text = "\n".join(style(l) if style else l for l in self.lines[i : i + 12])
            else:
                # A prompt in plain text, continued in the style: what the
                # adapter is asked at serving time.
                words = self.lines[i].split()
                n = self.rng.randint(1, min(6, len(words)))
                head = " ".join(words[:n])
                rest = self.style(" ".join(words[n:])) if n < len(words) else ""
                text = head + (" " + rest if rest else "") + "\n"
                text += "\n".join(self.style(l) for l in self.lines[i + 1 : i + 12])
            t = ids(self.tok, text)
            if len(t) >= SEQ:
                return [self.bos] + t[:SEQ]

    def batch(self):
        return torch.tensor([self.sample() for _ in range(BATCH)])


def train(model, stream, steps, lr, label):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0 if label != "base" else 0.01)
    warm = max(1, steps // 20)
    start = time.time()
    model.train()
    for step in range(steps):
        scale = min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * max(scale, 0.05)
        x = stream.batch()
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"{label}: step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()
    return loss.item()


def generate(model, tok, prompt):
    x = torch.tensor([tok.encode(prompt).ids])
    out = []
    margins = []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = model(input_ids=x).logits[0, -1]
            top = torch.topk(logits, 2)
            margins.append((top.values[0] - top.values[1]).item())
            nxt = int(top.indices[0])
            out.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return out, min(margins)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(__file__)
    torch.manual_seed(SEED)
    torch.set_num_threads(os.cpu_count() or 2)
    lines = verses()
    model_dir = os.path.join(out, MODEL)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.makedirs(model_dir)
    tok = build_tokenizer(lines, model_dir)

    # The base model, on the plain text.
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    print(f"base: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)
    base_loss = train(model, Stream(tok, lines, None, random.Random(SEED)), BASE_STEPS, 3e-3, "base")
    model.to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)

    # The adapters, each on a fresh copy of the stored (bf16) base.
    adapter_root = os.path.join(out, "adapters", MODEL)
    shutil.rmtree(adapter_root, ignore_errors=True)
    losses = {"base": base_loss}
    for name, (style, lora, offset) in ADAPTERS.items():
        torch.manual_seed(SEED + offset)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            lora_dropout=0.0,
            **lora,
        )
        peft_model = get_peft_model(base, config)
        stream = Stream(tok, lines, STYLES[style], random.Random(SEED + offset))
        losses[name] = train(peft_model, stream, ADAPTER_STEPS, 5e-3, name)
        path = os.path.join(adapter_root, name)
        # The base by name, not by this machine's path.
        peft_model.peft_config["default"].base_model_name_or_path = MODEL
        peft_model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
        # PEFT's empty model card is not part of the artifact.
        os.remove(os.path.join(path, "README.md"))

    # Goldens: f32 compute on the stored bf16 weights, as the engine runs them.
    golden = {"model": MODEL, "max_new_tokens": MAX_NEW, "seed": SEED, "cases": []}
    for adapter in [None] + list(ADAPTERS):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        m = base if adapter is None else PeftModel.from_pretrained(base, os.path.join(adapter_root, adapter))
        m = m.float().eval()
        for prompt in PROMPTS:
            tokens, margin = generate(m, tok, prompt)
            text = tok.decode(tokens)
            golden["cases"].append(
                {"adapter": adapter, "prompt": prompt, "tokens": tokens, "text": text, "min_margin": margin}
            )
            print(f"[{adapter or 'base'}] {prompt!r} -> {text!r} (margin {margin:.4f})", flush=True)
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
    digests = {"base_hash": canonical_base_hash(model_dir), "adapters": {}}
    for name in ADAPTERS:
        digests["adapters"][name] = artifact_digest(os.path.join(adapter_root, name))
    with open(os.path.join(out, "digests.json"), "w") as f:
        json.dump(digests, f, indent=2)
    print(json.dumps({"final_losses": losses}), flush=True)


if __name__ == "__main__":
    main()
