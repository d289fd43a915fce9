#!/usr/bin/env python3
"""Builds the harmony fixture: a tiny GPT-OSS that speaks OpenAI's harmony
chat format, with the chat template GPT-OSS ships, and its goldens.

Run by hand, never by CI:

    PYTHONHASHSEED=0 .venv/bin/python worker/engine/scripts/make_harmony_fixtures.py \
        worker/engine/tests/fixtures TEMPLATE [--reuse]

With `--reuse` the model already in `gpt-oss-harmony/` is not trained
again, only checked and its goldens written (training takes minutes; it
is seeded, so a run without `--reuse` makes the same weights).

TEMPLATE is GPT-OSS's `chat_template.jinja` as OpenAI ships it with
`openai/gpt-oss-20b` and `-120b` (the same file). The copy used is the one
in llama-cpp-python 0.3.36's source distribution on PyPI,
`vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja`; its SHA-256
is checked below.

The model is `make_gpt_oss_fixtures.py`'s tiny GPT-OSS (the real config
with only the sizes shrunk), its vocabulary the shared 384-token tokenizer
with harmony's special tokens added after it (`<|start|>`, `<|channel|>`,
`<|message|>`, `<|end|>`, `<|return|>`, `<|call|>`, `<|constrain|>` and
`<|endoftext|>`, as `o200k_harmony` names them). A random model does not
speak harmony, and GPT-OSS's own weights are 13 GB, so this one is trained
here, a few hundred steps on three conversations rendered by the template
through transformers (each under several dates, since the template writes
today's, and under each reasoning effort), until transformers' greedy
decoding of the saved checkpoint (f32, as trained) answers each one exactly:

- `greeting`: an analysis message, then a final one;
- `weather`: with a `get_weather` tool, an analysis message, then a call
  in the commentary channel (`to=functions.get_weather`, `<|constrain|>json`)
  ending in `<|call|>`;
- `weather-result`: the same chat with the call and the tool's answer in
  it, then a final answer.

It writes `gpt-oss-harmony/` (`chat_template.jinja` beside the tokenizer
files, as transformers saves a template now) and `golden_harmony.json`:
for each conversation its messages, tools and reasoning effort, the text
transformers renders (with the date it rendered), the prompt ids, the
last prompt position's logits, the greedy ids and, parsed from them by
the harmony grammar (not by our code), each message's channel, recipient
and text.
"""

import datetime
import hashlib
import json
import os
import shutil
import sys

import torch
from tokenizers import AddedToken, Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_gpt_oss_fixtures import CONFIG  # noqa: E402

TEMPLATE_SHA256 = "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"

# o200k_harmony's special tokens this format uses, in the order they are
# added after the shared vocabulary.
HARMONY = ["<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"]
VOCAB = 392  # shrunk: 201088

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "description": "The city."}},
            "required": ["location"],
        },
    },
}

CONVERSATIONS = [
    {
        "name": "greeting",
        "messages": [{"role": "user", "content": "Say hello."}],
        "tools": None,
        "answer": "<|channel|>analysis<|message|>A short greeting.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>",
    },
    {
        "name": "weather",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "answer": "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}<|call|>',
    },
    {
        "name": "weather-result",
        "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
        "tools": [WEATHER_TOOL],
        "answer": "<|channel|>analysis<|message|>It is sunny.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Sunny and 21 C in Paris.<|return|>",
    },
]

# Rendered only (no answer trained): the reasoning before a past call, given
# back as the template reads it (`thinking`).
RENDER_ONLY = [
    {
        "name": "weather-thinking",
        "messages": [
            CONVERSATIONS[2]["messages"][0],
            dict(CONVERSATIONS[2]["messages"][1], thinking="Need the weather tool."),
            CONVERSATIONS[2]["messages"][2],
        ],
        "tools": [WEATHER_TOOL],
    },
]

EFFORTS = [None, "low", "high"]
TRAIN_DATES = ["2025-01-17", "2025-08-05", "2026-03-30", "2026-12-02", "2027-06-11", "2028-10-24"]
UNSEEN_DATES = ["2026-12-19", "2029-02-08"]


def render(tok, conv, effort, date):
    """The template's text for a conversation, as transformers renders it,
    on `date` (the template asks strftime_now for today's)."""
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    text = tok.apply_chat_template(conv["messages"], tools=conv["tools"], add_generation_prompt=True, tokenize=False, **kwargs)
    today = datetime.date.today().strftime("%Y-%m-%d")
    assert f"Current date: {today}\n" in text
    return text.replace(f"Current date: {today}\n", f"Current date: {date}\n")


def rendering(tok, conv, effort, date):
    """A chat, its inputs and the text and ids transformers renders for it."""
    text = render(tok, conv, effort, date)
    return {
        "name": conv["name"],
        "messages": conv["messages"],
        "tools": conv["tools"],
        "reasoning_effort": effort,
        "date": date,
        "rendered": text,
        "prompt_ids": tok.encode(text, add_special_tokens=False),
    }


def parse_harmony(tok, ids):
    """The messages of a harmony answer that starts after `<|start|>assistant`:
    (header, text) for each, as the format defines them: a header up to
    `<|message|>`, a body up to `<|end|>`, `<|call|>` or `<|return|>`."""
    special = {tok.convert_tokens_to_ids(t): t for t in HARMONY}
    messages, header, body, in_body = [], [], [], False
    for i in ids:
        t = special.get(i)
        if t == "<|message|>":
            in_body = True
        elif t in ("<|end|>", "<|call|>", "<|return|>"):
            messages.append({"header": tok.decode(header), "text": tok.decode(body), "end": t})
            header, body, in_body = [], [], False
        elif t == "<|start|>":
            pass
        elif in_body:
            body.append(i)
        else:
            header.append(i)
    out = []
    for m in messages:
        h = m["header"]
        # `assistant` opens every message after the first.
        h = h[len("assistant"):] if h.startswith("assistant") else h
        channel = h.split("<|channel|>", 1)[1] if "<|channel|>" in h else h
        recipient = None
        if " to=" in channel:
            channel, rest = channel.split(" to=", 1)
            recipient = rest.split(" ", 1)[0]
        out.append({"channel": channel.strip(), "recipient": recipient, "text": m["text"], "end": m["end"]})
    return out


def main():
    out = sys.argv[1]
    template = open(sys.argv[2]).read()
    assert hashlib.sha256(template.encode()).hexdigest() == TEMPLATE_SHA256, "not the template GPT-OSS ships"
    reuse = sys.argv[3:] == ["--reuse"]
    tok_dir = os.path.join(out, "tokenizer")
    model_dir = os.path.join(out, "gpt-oss-harmony")
    if not reuse:
        shutil.rmtree(model_dir, ignore_errors=True)
        os.makedirs(model_dir)

    raw = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY])
    assert raw.get_vocab_size() == VOCAB
    raw.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": "<s>",
                "eos_token": "<|return|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 2048,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            f,
            indent=2,
        )
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(template)
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    assert tok.chat_template == template
    ids_of = {t: tok.convert_tokens_to_ids(t) for t in HARMONY}

    config = {k: v for k, v in CONFIG.items() if k != "quantization_config"}
    config.update(
        {
            "vocab_size": VOCAB,
            "eos_token_id": ids_of["<|return|>"],  # shrunk: 200002
            "pad_token_id": ids_of["<|endoftext|>"],  # shrunk: 199999
            # f32, as trained: the answers are exact in these weights,
            # which bf16's rounding does not keep.
            "torch_dtype": "float32",
        }
    )
    eos = [ids_of["<|return|>"], ids_of["<|endoftext|>"], ids_of["<|call|>"]]  # 200002, 199999, 200012

    # The training set: every conversation under every effort and date.
    examples = []
    for conv in CONVERSATIONS:
        answer = tok.encode(conv["answer"], add_special_tokens=False)
        for effort in EFFORTS:
            for date in TRAIN_DATES:
                prompt = tok.encode(render(tok, conv, effort, date), add_special_tokens=False)
                examples.append((prompt, answer))

    if not reuse:
        train(model_dir, config, examples)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": eos, "pad_token_id": ids_of["<|endoftext|>"]}, f)
    check_and_write_goldens(out, model_dir, tok, eos, ids_of)


def train(model_dir, config, examples):
    """Trains the tiny GPT-OSS from a seeded start until every example's
    answer has a loss under 3e-4, and saves it."""
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "bias" in name or "sinks" in name:
                p.zero_()
            else:
                p.normal_(0.0, 0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = torch.Generator().manual_seed(5678)

    def loss_of(prompt, answer):
        x = torch.tensor([prompt + answer])
        labels = torch.tensor([[-100] * len(prompt) + answer])
        return model(x, labels=labels).loss

    for step in range(3000):
        model.train()
        opt.zero_grad()
        batch = torch.randperm(len(examples), generator=rng)[:4].tolist()
        for i in batch:
            (loss_of(*examples[i]) / len(batch)).backward()
        opt.step()
        if step % 50 == 49:
            model.eval()
            with torch.no_grad():
                worst = max(loss_of(*e).item() for e in examples)
            print(f"step {step + 1}: worst loss {worst:.5f}", flush=True)
            if worst < 3e-4:
                break
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)


def check_and_write_goldens(out, model_dir, tok, eos, ids_of):
    """Checks that transformers' greedy decoding of the saved model answers
    every chat as trained, on the training dates and on unseen ones, and
    writes the goldens."""
    # The reference: the saved checkpoint, read back by transformers.
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def greedy(ids):
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = ref(x).logits[0, -1].tolist()
            gen = ref.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=128, eos_token_id=eos, pad_token_id=eos[1]
            )[0, len(ids):].tolist()
        return logits, gen

    golden = {"eos_token_ids": eos, "special": ids_of, "cases": [], "renders": []}
    for conv in CONVERSATIONS:
        want = tok.encode(conv["answer"], add_special_tokens=False)
        for effort in EFFORTS:
            for date in TRAIN_DATES[-1:] + UNSEEN_DATES:
                text = render(tok, conv, effort, date)
                ids = tok.encode(text, add_special_tokens=False)
                logits, gen = greedy(ids)
                assert gen == want, f"{conv['name']} ({effort}, {date}): {tok.decode(gen)!r}"
            golden["cases"].append(
                {
                    "name": conv["name"],
                    "reasoning_effort": effort,
                    "prompt_ids": ids,
                    "logits": logits,
                    "greedy": gen,
                    "answer": parse_harmony(tok, gen),
                }
            )
            golden["renders"].append(rendering(tok, conv, effort, date))
    for conv in RENDER_ONLY:
        golden["renders"].append(rendering(tok, conv, None, UNSEEN_DATES[0]))
    with open(os.path.join(out, "golden_harmony.json"), "w") as f:
        json.dump(golden, f)
    print(f"wrote {len(golden['cases'])} cases; every one answers as trained, on unseen dates too")


if __name__ == "__main__":
    main()
