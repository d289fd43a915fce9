#!/usr/bin/env python3
"""Runs the two small local tasks in `tasks/` with lm-evaluation-harness and
writes what each request scored or generated, per task and document, as
JSON.

Against Hugging Face transformers + PEFT (the goldens; run by hand, needs
torch, transformers and peft beside lm-eval):

    python tests/lm_eval/run.py hf MODEL_DIR ADAPTER_DIR tests/lm_eval/goldens.json

Against a lorafleet gateway, through lm-eval's OpenAI-compatible clients
(the key in OPENAI_API_KEY):

    python tests/lm_eval/run.py gateway BASE_URL MODEL TOKENIZER_DIR OUT.json

`gateway` runs the multiple-choice task (loglikelihood requests: `echo`
with `logprobs`) and the generate-until task through `local-completions`,
and the generate-until task again through `local-chat-completions`.
"""

import json
import os
import sys

import lm_eval
from lm_eval.tasks import TaskManager

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = os.path.join(HERE, "tasks")


def run(model, model_args, tasks, **kw):
    # The tasks' data files are named relative to their folder.
    os.chdir(TASKS)
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=TASKS),
        batch_size=1,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
        **kw,
    )
    results = {}
    for task, samples in out["samples"].items():
        per_doc = {}
        for s in samples:
            if s["doc"].get("choices") is not None and task.endswith("_mc"):
                # One (loglikelihood, is_greedy) per choice.
                per_doc[str(s["doc_id"])] = [r[0][0] for r in s["resps"]]
            else:
                per_doc[str(s["doc_id"])] = s["resps"][0][0]
        results[task] = per_doc
    return results


def main():
    mode = sys.argv[1]
    if mode == "hf":
        model_dir, adapter_dir, out = (os.path.abspath(p) for p in sys.argv[2:5])
        results = run(
            "hf",
            f"pretrained={model_dir},peft={adapter_dir},dtype=float32,device=cpu",
            ["lorafleet_mc", "lorafleet_gen"],
        )
    elif mode == "gateway":
        base_url, model, tokenizer, out = sys.argv[2], sys.argv[3], os.path.abspath(sys.argv[4]), os.path.abspath(sys.argv[5])
        # As the hf backend does with this tokenizer: BOS first.
        common = f"model={model},tokenizer_backend=huggingface,tokenizer={tokenizer},add_bos_token=True,num_concurrent=1,max_retries=1"
        results = run(
            "local-completions",
            f"base_url={base_url}/v1/completions,{common}",
            ["lorafleet_mc", "lorafleet_gen"],
        )
        chat = run(
            "local-chat-completions",
            f"base_url={base_url}/v1/chat/completions,{common}",
            ["lorafleet_gen"],
            apply_chat_template=True,
        )
        results["lorafleet_gen_chat"] = chat["lorafleet_gen"]
    else:
        sys.exit(f"unknown mode {mode!r}: hf or gateway")
    with open(out, "w") as f:
        json.dump(results, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(json.dumps(results, ensure_ascii=False))


if __name__ == "__main__":
    main()
