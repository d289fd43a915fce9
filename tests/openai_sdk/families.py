#!/usr/bin/env python3
"""Scores a prompt given as token ids, with its greedy completion, through a
lorafleet gateway with the official OpenAI Python SDK (echo and logprobs),
and prints what the SDK parsed as JSON: the log probability of every prompt
and completion token, and the usage.

    OPENAI_API_KEY=... python tests/openai_sdk/families.py BASE_URL/v1 MODEL IDS_JSON MAX_TOKENS TOP
"""

import json
import sys

from openai import OpenAI


def main():
    base_url, model, ids, max_tokens, top = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    client = OpenAI(base_url=base_url, max_retries=0)
    c = client.completions.create(
        model=model, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=top, echo=True
    )
    lp = c.choices[0].logprobs
    print(
        json.dumps(
            {
                "token_logprobs": lp.token_logprobs,
                "top_logprobs": [sorted(t.values(), reverse=True) if t else None for t in lp.top_logprobs],
                "prompt_tokens": c.usage.prompt_tokens,
                "completion_tokens": c.usage.completion_tokens,
                "finish_reason": c.choices[0].finish_reason,
            }
        )
    )


if __name__ == "__main__":
    main()
