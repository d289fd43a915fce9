#!/usr/bin/env python3
"""Parses every log-probability shape of a lorafleet gateway with the official
OpenAI Python SDK, whole and streamed, and fails on anything it cannot read.

    OPENAI_API_KEY=... python tests/openai_sdk/check.py BASE_URL/v1 MODEL
"""

import json
import sys

from openai import OpenAI


def main():
    base_url, model = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base_url, max_retries=0)

    c = client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=4, temperature=0, logprobs=3, echo=True
    )
    lp = c.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs[0] is None, lp
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:]), lp.token_logprobs
    assert all(len(t) >= 3 for t in lp.top_logprobs[1:]), lp.top_logprobs
    assert c.choices[0].text.startswith("The quick brown fox"), c.choices[0].text
    assert c.usage.completion_tokens == 4, c.usage

    tokens = []
    for chunk in client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=4, temperature=0, logprobs=3, echo=True, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
    assert tokens == lp.tokens, (tokens, lp.tokens)

    messages = [{"role": "user", "content": "Grüße aus München!"}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4, content
    for t in content:
        assert isinstance(t.logprob, float) and isinstance(t.bytes, list), t
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob, t

    streamed = []
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [t.token for t in streamed] == [t.token for t in content], (streamed, content)
    assert [t.logprob for t in streamed] == [t.logprob for t in content]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    choice = {"type": "function", "function": {"name": "weather"}}
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=120, temperature=1.0, seed=1, tools=tools, tool_choice=choice
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "weather", r
    assert isinstance(json.loads(call.function.arguments)["city"], str), call
    names = []
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=120, temperature=1.0, seed=1, tools=tools, tool_choice=choice,
        stream=True,
    ):
        for c in chunk.choices:
            names += [t.function.name for t in (c.delta.tool_calls or [])]
    assert names == ["weather"], names
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=60, temperature=1.0, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
    )
    assert json.loads(r.choices[0].message.content)["answer"] in ("yes", "no"), r
    print("openai sdk: ok")


if __name__ == "__main__":
    main()
