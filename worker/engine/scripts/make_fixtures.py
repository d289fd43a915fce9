#!/usr/bin/env python3
"""Builds the engine's golden fixtures with Hugging Face transformers + PEFT.

Run by hand, never by CI:

    python3 -m venv .venv && .venv/bin/pip install torch transformers peft safetensors tokenizers
    .venv/bin/python worker/engine/scripts/make_fixtures.py worker/engine/tests/fixtures

It writes, under the output directory:

- tokenizer files shared by both models (a byte-level BPE trained here, so
  multi-byte characters really are split across tokens);
- `llama-gqa/`: a small random Llama with grouped-query attention, stored
  as two f32 shards with an index;
- `qwen2-tied/`: a small random Qwen2 (q/k/v biases, tied embeddings),
  stored as one bf16 file;
- `adapters/<model>/<name>/`: PEFT LoRA adapters with non-zero A and B that
  cover r, lora_alpha, use_rslora, rank_pattern, alpha_pattern, list and
  "all-linear" targets, and layers_to_transform;
- `golden.json`: for each (model, adapter or base, prompt), the greedy
  tokens and the last prompt position's logits from transformers + PEFT;
- `base_hashes.json` and `artifact_digests.json`: the base hash and the
  artifact digests, computed here independently of the Rust code.
"""

import json
import os
import shutil
import sys

import torch
from peft import LoraConfig, get_peft_model, PeftModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
VOCAB = 384
MAX_NEW = 12

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, there was a little model that served many adapters.",
    "Multi-LoRA serving keeps one base model and swaps small low-rank deltas.",
    "Grüße aus München! Ça va? Déjà vu. Smörgåsbord. naïve café",
    "日本語のテキストも少し。中文也有一点。한국어도 조금.",
    "Emoji: 🚀🔥✨ and symbols ∑ ∫ √ ≤ ≥ ≠ →",
    "def forward(self, x): return x @ self.weight.T + self.bias",
    "SELECT * FROM adapters WHERE lora_int_id = 42;",
] * 20


def build_tokenizer(out):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(os.path.join(out, "tokenizer.json"))
    cfg = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return tok


def save_model(model, path, tok_dir, dtype, shard):
    model = model.to(dtype)
    max_shard = "60KB" if shard else "100MB"
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(tok_dir, name), os.path.join(path, name))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 4]}, f)


def canonical_base_hash(model_dir):
    """The base hash as the engine defines it, computed independently here
    from the raw safetensors files, so the Rust side is checked against it."""
    import hashlib
    import struct

    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, name), "rb") as f:
            raw = f.read()
        (header_len,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + header_len])
        body = raw[8 + header_len :]
        for tname, info in header.items():
            if tname == "__metadata__":
                continue
            start, end = info["data_offsets"]
            tensors[tname] = (info["dtype"], info["shape"], body[start:end])
    h = hashlib.sha256(b"lorafleet-base-hash-v1\n")
    u64 = lambda n: struct.pack("<Q", n)
    for tname in sorted(tensors, key=lambda n: n.encode()):
        dtype, shape, data = tensors[tname]
        h.update(u64(len(tname.encode())) + tname.encode())
        h.update(u64(len(dtype)) + dtype.encode())
        h.update(u64(len(shape)) + b"".join(u64(d) for d in shape))
        h.update(u64(len(data)) + data)
    return h.hexdigest()


def artifact_digest(adapter_dir):
    """The artifact digest as the engine defines it (worker/engine/src/artifact.rs),
    computed independently here."""
    import hashlib
    import struct

    files = []
    for base, _, names in os.walk(adapter_dir):
        for name in names:
            path = os.path.join(base, name)
            files.append((os.path.relpath(path, adapter_dir).replace(os.sep, "/"), path))
    files.sort(key=lambda f: f[0].encode())
    h = hashlib.sha256(b"lorafleet-artifact-v1\n")
    for rel, path in files:
        with open(path, "rb") as f:
            data = f.read()
        h.update(struct.pack("<Q", len(rel.encode())) + rel.encode())
        h.update(struct.pack("<Q", len(data)) + data)
    return h.hexdigest()


def write_base_hashes(out):
    hashes = {m: canonical_base_hash(os.path.join(out, m)) for m in ["llama-gqa", "qwen2-tied"]}
    with open(os.path.join(out, "base_hashes.json"), "w") as f:
        json.dump(hashes, f, indent=2)
    digests = {}
    for model in sorted(os.listdir(os.path.join(out, "adapters"))):
        for name in sorted(os.listdir(os.path.join(out, "adapters", model))):
            digests[f"{model}/{name}"] = artifact_digest(os.path.join(out, "adapters", model, name))
    with open(os.path.join(out, "artifact_digests.json"), "w") as f:
        json.dump(digests, f, indent=2)


def randomize_lora(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


ADAPTERS = {
    "llama-gqa": [
        ("qv-r8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
        ("all-linear-rslora", dict(r=4, lora_alpha=8, use_rslora=True, target_modules="all-linear")),
        (
            "patterns",
            dict(
                r=8,
                lora_alpha=16,
                target_modules=["q_proj", "k_proj", "down_proj"],
                rank_pattern={"k_proj": 2},
                alpha_pattern={"down_proj": 4},
            ),
        ),
        ("layer1-mlp", dict(r=6, lora_alpha=3, target_modules=["o_proj", "gate_proj", "up_proj"], layers_to_transform=[1])),
        ("k-r16", dict(r=16, lora_alpha=32, target_modules=["k_proj"])),
        ("o-r2", dict(r=2, lora_alpha=2, target_modules=["o_proj"])),
        ("down-r12", dict(r=12, lora_alpha=6, target_modules=["down_proj"])),
        ("qkvo-r4", dict(r=4, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
        ("gate-up-r8", dict(r=8, lora_alpha=24, target_modules=["gate_proj", "up_proj"])),
        ("layer0-q", dict(r=4, lora_alpha=8, target_modules=["q_proj"], layers_to_transform=0)),
    ],
    "qwen2-tied": [
        ("qv-r8", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
        ("all-linear-r4", dict(r=4, lora_alpha=4, target_modules="all-linear")),
    ],
}

PROMPTS = [
    "The quick brown fox",
    "Grüße aus München! 🚀",
    "SELECT * FROM adapters",
]


def golden_cases(m, tok, model, adapter):
    """The golden cases of one model (and adapter, or None) on every prompt:
    the last prompt position's logits and the greedy tokens (until EOS 2 or
    4, at most MAX_NEW), the form every fixture script records."""
    cases = []
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
        cases.append({"model": model, "adapter": adapter, "prompt": prompt, "prompt_ids": ids, "greedy": gen, "logits": logits})
    return cases


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "worker/engine/tests/fixtures"
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    tok_dir = os.path.join(out, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    tok = build_tokenizer(tok_dir)
    vocab = tok.get_vocab_size()

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    configs = {
        "llama-gqa": (LlamaConfig(num_key_value_heads=2, rope_theta=10000.0, **common), torch.float32, True),
        "qwen2-tied": (
            Qwen2Config(num_key_value_heads=1, rope_theta=1000000.0, tie_word_embeddings=True, **common),
            torch.bfloat16,
            False,
        ),
    }
    golden = {"max_new_tokens": MAX_NEW, "cases": []}
    for model_name, (config, dtype, shard) in configs.items():
        torch.manual_seed({"llama-gqa": 11, "qwen2-tied": 22}[model_name])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.15)
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.8, 1.2)
        path = os.path.join(out, model_name)
        save_model(model, path, tok_dir, dtype, shard)

        # The reference reads the stored weights back, upcast to f32, as the engine does.
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

        def record(m, adapter):
            golden["cases"].extend(golden_cases(m, tok, model_name, adapter))

        record(base, None)
        for i, (adapter_name, kwargs) in enumerate(ADAPTERS[model_name]):
            fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            peft_model = get_peft_model(fresh, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **kwargs))
            randomize_lora(peft_model, 1000 + i)
            adir = os.path.join(out, "adapters", model_name, adapter_name)
            peft_model.save_pretrained(adir)
            # PEFT writes a boilerplate model card; the fixtures do not need it.
            os.remove(os.path.join(adir, "README.md"))
            loaded = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adir
            ).eval()
            record(loaded, adapter_name)

    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(golden, f)
    write_base_hashes(out)
    print(f"wrote {len(golden['cases'])} golden cases to {out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--base-hashes-only"]:
        write_base_hashes(sys.argv[2])
    else:
        main()
