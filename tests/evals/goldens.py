#!/usr/bin/env python3
"""Scores an evaluation set with lm-evaluation-harness's `hf` backend
(transformers + PEFT, f32 on the CPU) for each adapter named, and writes
every item's result and each adapter's score as JSON: the goldens of
`tests/tests/eval_rollouts.rs`. Independent of lorafleet's code: the items
are read from the set file here, scored by lm-eval, and judged below with
Python's own `re` and string comparison.

Run by hand (needs torch, transformers, peft and lm-eval):

    python tests/evals/goldens.py deploy/demo/kjv-small \\
        deploy/demo/adapters/kjv-small tests/evals/shout.jsonl \\
        tests/evals/goldens.json shout shout-v2 telegram

A multiple-choice line is scored as an lm-eval `multiple_choice` task with
no delimiter between the prompt and a choice (the set's choices carry their
own leading space); a generation line as a `generate_until` task, greedy,
with the line's `max_tokens` and `stop` (default 32 and a newline). A line
with `messages` (one user message: what lm-eval's chat template path
sends) runs in a second pass with `apply_chat_template=True`; the chat set
of `tests/tests/eval_rollouts.rs` is made on the `llama-gqa` fixture:

    python tests/evals/goldens.py worker/engine/tests/fixtures/llama-gqa \
        worker/engine/tests/fixtures/adapters/llama-gqa tests/evals/chat.jsonl \
        tests/evals/chat-goldens.json qv-r8 o-r2
"""

import json
import os
import re
import sys
import tempfile

import lm_eval
from lm_eval.tasks import TaskManager


def text_of(item):
    """The prompt lm-eval is given: the text, or the one user message."""
    if "messages" in item:
        (m,) = item["messages"]
        assert m["role"] == "user", "lm-eval's chat path sends one user message"
        return m["content"]
    return item["prompt"]


def tasks_for(lines, folder):
    """Writes one task per kind (and per generation setting), returning
    {task name: [line index, ...]}."""
    mc, gen = [], {}
    for i, item in lines:
        if "choices" in item:
            mc.append((i, {"question": text_of(item), "choices": item["choices"], "answer": item["answer"]}))
        else:
            key = (item.get("max_tokens", 32), tuple(item.get("stop", ["\n"])))
            gen.setdefault(key, []).append((i, {"prompt": text_of(item), "expected": item["expected"]}))
    order = {}

    def write(name, docs, yaml):
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            for _, d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
            f.write(yaml)
        order[name] = [i for i, _ in docs]

    if mc:
        write("evalset_mc", mc, "\n".join([
            "task: evalset_mc", "dataset_path: json",
            "dataset_kwargs:", "  data_files:", "    test: evalset_mc.jsonl",
            "test_split: test", "output_type: multiple_choice",
            "doc_to_text: '{{question}}'", "doc_to_choice: '{{choices}}'",
            "doc_to_target: '{{answer}}'", "target_delimiter: ''",
            "metric_list:", "  - metric: acc", ""]))
    for n, ((max_tokens, stop), docs) in enumerate(sorted(gen.items())):
        name = f"evalset_gen{n}"
        write(name, docs, "\n".join([
            f"task: {name}", "dataset_path: json",
            "dataset_kwargs:", "  data_files:", f"    test: {name}.jsonl",
            "test_split: test", "output_type: generate_until",
            "doc_to_text: '{{prompt}}'", "doc_to_target: '{{expected}}'",
            "target_delimiter: ''",
            "generation_kwargs:", f"  until: {json.dumps(list(stop))}",
            f"  max_gen_toks: {max_tokens}", "  do_sample: false", "  temperature: 0",
            "metric_list:", "  - metric: exact_match", ""]))
    return order


def score(model_dir, adapter_dir, folder, order, chat):
    os.chdir(folder)
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},peft={adapter_dir},dtype=float32,device=cpu",
        tasks=sorted(order),
        task_manager=TaskManager(include_path=folder),
        batch_size=1, log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
        apply_chat_template=chat,
    )
    got = {}
    for task, samples in out["samples"].items():
        for s in samples:
            line = order[task][s["doc_id"]]
            if task == "evalset_mc":
                got[line] = {"loglikelihoods": [r[0][0] for r in s["resps"]]}
            else:
                got[line] = {"answer": s["resps"][0][0]}
    return got


def judge(item, result):
    if "choices" in item:
        lls = result["loglikelihoods"]
        chosen = max(range(len(lls)), key=lambda i: (lls[i], -i))
        return chosen == item["answer"]
    answer = result["answer"]
    if item.get("match") == "regex":
        return re.search(item["expected"], answer) is not None
    return answer.strip() == item["expected"].strip()


def main():
    model_dir, adapters_dir, set_file, out_file = (os.path.abspath(p) for p in sys.argv[1:5])
    names = sys.argv[5:]
    with open(set_file) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    goldens = {"set": os.path.basename(set_file), "adapters": {}}
    for name in names:
        got = {}
        for chat in (False, True):
            part = [(i, l) for i, l in enumerate(lines) if ("messages" in l) == chat]
            if not part:
                continue
            with tempfile.TemporaryDirectory() as folder:
                order = tasks_for(part, folder)
                got.update(score(model_dir, os.path.join(adapters_dir, name), folder, order, chat))
        items = []
        for i, item in enumerate(lines):
            r = got[i]
            r["correct"] = judge(item, r)
            items.append(r)
        right = sum(r["correct"] for r in items)
        goldens["adapters"][name] = {"items": items, "right": right, "score": right / len(items)}
        print(name, f"{right}/{len(items)}", file=sys.stderr)
    with open(out_file, "w") as f:
        json.dump(goldens, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
