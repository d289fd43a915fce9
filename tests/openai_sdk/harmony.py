#!/usr/bin/env python3
"""Asks a harmony model (GPT-OSS) through a lorafleet gateway with the
official OpenAI Python SDK, whole and streamed, and prints what the SDK
parsed as JSON: each answer's `reasoning_content`, `content`, tool calls
and finish reason (forced calls and a constrained answer among them), and
the refusals.

    OPENAI_API_KEY=... python tests/openai_sdk/harmony.py BASE_URL/v1 MODEL
"""

import json
import sys

import openai
from openai import OpenAI

WEATHER = {
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
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def whole(client, model, messages, **kw):
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=160, temperature=0, **kw)
    m = r.choices[0].message
    return {
        "reasoning_content": (m.model_extra or {}).get("reasoning_content"),
        "content": m.content,
        "tool_calls": [{"name": c.function.name, "arguments": c.function.arguments, "id": c.id} for c in m.tool_calls or []],
        "finish_reason": r.choices[0].finish_reason,
        "prompt_tokens": r.usage.prompt_tokens,
    }


def streamed(client, model, messages, **kw):
    out = {"reasoning_content": "", "content": "", "tool_calls": [], "finish_reason": None}
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=160, temperature=0, stream=True, **kw
    ):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        out["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
        out["content"] += d.content or ""
        for c in d.tool_calls or []:
            out["tool_calls"].append({"name": c.function.name, "arguments": c.function.arguments})
        out["finish_reason"] = chunk.choices[0].finish_reason or out["finish_reason"]
    return out


def refusal(client, model, messages, **kw):
    try:
        client.chat.completions.create(model=model, messages=messages, max_tokens=8, **kw)
    except openai.BadRequestError as e:
        return e.body.get("param") if isinstance(e.body, dict) else None
    return "accepted"


def main():
    base_url, model = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base_url, max_retries=0)
    hello = [{"role": "user", "content": "Say hello."}]
    out = {
        "hello": whole(client, model, hello),
        "hello_streamed": streamed(client, model, hello),
        "hello_low": whole(client, model, hello, reasoning_effort="low"),
        "hello_high": whole(client, model, hello, reasoning_effort="high"),
        "weather": whole(client, model, ASK, tools=[WEATHER]),
        "weather_streamed": streamed(client, model, ASK, tools=[WEATHER]),
    }
    call = out["weather"]["tool_calls"][0] if out["weather"]["tool_calls"] else {"id": "x", "name": "?", "arguments": "{}"}
    answered = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
    ]
    out["weather_result"] = whole(client, model, answered, tools=[WEATHER])
    out["refused_effort"] = refusal(client, model, hello, reasoning_effort="extreme")
    out["hello_python"] = whole(client, model, hello, extra_body={"chat_template_kwargs": {"builtin_tools": ["python"]}})
    out["refused_kwargs"] = refusal(client, model, hello, extra_body={"chat_template_kwargs": {"messages": []}})
    named = {"type": "function", "function": {"name": "get_weather"}}
    out["forced_call"] = whole(client, model, ASK, tools=[WEATHER], tool_choice=named)
    out["forced_call_streamed"] = streamed(client, model, ASK, tools=[WEATHER], tool_choice="required")
    out["chosen"] = whole(client, model, hello, extra_body={"guided_choice": ["yes", "no"]})
    lark = 'start: answer "!"\nanswer: "hi" | "hello there"\n'
    out["grammar"] = whole(client, model, hello, extra_body={"guided_grammar": lark})
    out["refused_grammar"] = refusal(client, model, hello, extra_body={"guided_grammar": "start: ("})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
