"""How far transformers + PEFT themselves land from the f32 golden logits
when the same models and adapters run in bf16 and f16.

The CUDA backend's bf16 and f16 modes are checked against the f32 golden
logits. A fixed tolerance says little on its own: these fixture models have
random weights, whose logits a 16-bit type moves further than a trained
model's. So the check is: the engine in a 16-bit type is no further from
the f32 reference than the reference implementation itself in that type.
This script records the reference implementation's error per golden case.

Run where torch, transformers and peft are installed, on a GPU if there is
one (that is how a bf16 model is served):

    python3 worker/engine/scripts/reduced_precision.py \
        worker/engine/tests/fixtures worker/engine/tests/fixtures/reduced_precision.json

The error is the one the Rust tests use: max |a - b| / max |b| over the last
prompt position's logits.

Each case is measured twice per type: as PEFT loads an adapter by default
(`autocast_adapter_dtype=True`: the LoRA weights upcast to f32 and the LoRA
path computed in f32), recorded as `bf16` / `f16`, and with the LoRA
weights in the model's own type (`autocast_adapter_dtype=False`), recorded
as `bf16_adapter_in_type` / `f16_adapter_in_type`. The CUDA backend's f32
adapter slots (its default) compute as the first; `--lora-dtype bf16` or
`f16` slots (as vLLM holds LoRA weights) as the second.
"""

import json
import os
import sys

import peft
import torch
import transformers
from peft import PeftModel
from transformers import AutoModelForCausalLM

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


def main():
    fixtures = sys.argv[1] if len(sys.argv) > 1 else "worker/engine/tests/fixtures"
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(fixtures, "reduced_precision.json")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with open(os.path.join(fixtures, "golden.json")) as f:
        golden = json.load(f)

    models = {}

    def model(name, adapter, dtype, upcast):
        key = (name, adapter, dtype, upcast)
        if key not in models:
            m = AutoModelForCausalLM.from_pretrained(os.path.join(fixtures, name), dtype=dtype)
            if adapter is not None:
                m = PeftModel.from_pretrained(
                    m,
                    os.path.join(fixtures, "adapters", name, adapter),
                    autocast_adapter_dtype=upcast,
                )
                lora_dtypes = {str(p.dtype) for n, p in m.named_parameters() if "lora_" in n}
                print(f"{name}/{adapter} in {dtype}, upcast={upcast}: LoRA weights in {sorted(lora_dtypes)}")
            models[key] = m.to(device).eval()
        return models[key]

    cases = []
    for case in golden["cases"]:
        entry = {"model": case["model"], "adapter": case["adapter"], "prompt": case["prompt"]}
        want = torch.tensor(case["logits"], dtype=torch.float64)
        for label, dtype in DTYPES.items():
            for suffix, upcast in (("", True), ("_adapter_in_type", False)):
                ids = torch.tensor([case["prompt_ids"]], device=device)
                with torch.no_grad():
                    got = model(case["model"], case["adapter"], dtype, upcast)(ids).logits[0, -1]
                got = got.to(torch.float64).cpu()
                entry[label + suffix] = float((got - want).abs().max() / want.abs().max())
        cases.append(entry)

    report = {
        "what": "relative error of transformers + PEFT in each dtype against the f32 golden logits",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "cases": cases,
    }
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    for label in [d + s for d in DTYPES for s in ("", "_adapter_in_type")]:
        errs = [c[label] for c in cases]
        print(f"{label}: max {max(errs):.4f}, mean {sum(errs) / len(errs):.4f} over {len(errs)} cases")


if __name__ == "__main__":
    main()
