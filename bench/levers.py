"""What each lever of the language-model task is worth: tokens/s, MFU and peak memory per GPU.

    python bench/levers.py               # one GPU: GPT-2 small, within --budget-s (about 7 minutes)
    python bench/levers.py --wheels DIR  # no network: cookiecutter from a wheel folder
    python bench/levers.py --cpu         # the same rows at gpt2-tiny on 2 CPU processes (a check
                                         # that every row runs; its timings say little)

Rows, each one run of bench/run.py's variants (raw: variants/raw_lm.py, the same model code; ours:
the baked project's train.py), one lever changed at a time from the row above it or from the
preset (configs/gpt2-small.toml: micro-batch 64, compiled, the loss inside the model):
- the loss on a float32 copy of the logits (before) against the loss inside the compiled model;
- micro-batch 12, 32 and 64;
- eager against compiled;
- each attention backend SDPA can take (GPU only), against SDPA's own choice;
- ours against raw at the preset (within 2 %), and with --activation-checkpointing;
- a model that does not fit without activation checkpointing (GPT-2 XL's shape, eager, micro-batch
  24, or 48 on a GPU of over 100 GB), without it and with it.
A row that fails (out of memory) says so; rows past the budget are not run. Output: --out/levers.md
and levers.json, and the table printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gpu_check import cookiecutter_from
from run import HERE, WORKLOADS, bake, describe_machine, gpu_error, run_variant, token_costs, token_rate

PRESET = {"batch-size": 64, "dataset-size": 64 * 48}
# GPT-2 XL's shape, eager: about 2.8 GB of activations a sequence in bf16 beside 25 GB of weights,
# gradients and AdamW state; micro-batch 24 should not fit 80 GB without checkpointing (48: 141 GB).
XL = {"hidden-size": 1600, "num-layers": 48, "num-heads": 25, "compile": False, "batch-size": 24,
      "dataset-size": 24 * 32}
XL_AC = {**XL, "activation-checkpointing": True}
ROWS = [  # (lever, variant, changes from the gpt2 workload)
    ("loss on float32 logits (before)", "raw", {"batch-size": 12, "dataset-size": 12 * 64,
                                                "loss": "fp32-logits"}),
    ("loss inside the compiled model", "raw", {"batch-size": 12, "dataset-size": 12 * 64}),
    ("micro-batch 32", "raw", {"batch-size": 32, "dataset-size": 32 * 48}),
    ("micro-batch 64 (the preset)", "raw", PRESET),
    ("eager (no --compile)", "raw", {**PRESET, "compile": False}),
    ("eager, loss on float32 logits", "raw", {**PRESET, "compile": False, "loss": "fp32-logits"}),
    ("SDPA: flash only", "raw", {**PRESET, "sdpa": "flash"}),
    ("SDPA: cuDNN only", "raw", {**PRESET, "sdpa": "cudnn"}),
    ("SDPA: memory-efficient only", "raw", {**PRESET, "sdpa": "efficient"}),
    ("ours at the preset", "ours", PRESET),
    ("ours, --activation-checkpointing", "ours", {**PRESET, "activation-checkpointing": True}),
    ("GPT-2 XL shape, eager", "ours", XL),
    ("GPT-2 XL shape, eager, --activation-checkpointing", "ours", XL_AC),
]
SHAPE = ("hidden-size", "num-layers", "num-heads", "seq-len", "vocab-size", "tie-embeddings")
CPU = {"hidden-size": 64, "num-layers": 2, "num-heads": 4, "seq-len": 64, "vocab-size": 256,
       "compile": False}  # gpt2-tiny's shape, every row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gpt2-tiny on 2 CPU processes")
    parser.add_argument("--budget-s", type=float, default=420, help="rows start only within it")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "levers")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="a folder of wheels to install cookiecutter from (no network)")
    args = parser.parse_args()
    why = None if args.cpu else gpu_error() and (
        "levers.py measures on one CUDA GPU and this machine has none; --cpu runs its rows at "
        "gpt2-tiny on 2 CPU processes")
    if why or (why := cookiecutter_from(args.wheels, args.out / "site", os.environ)):
        print(f"error: {why}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    big_gpu = {}
    if not args.cpu:
        import torch

        if torch.cuda.get_device_properties(0).total_memory > 100e9:  # an H200's 141 GB
            big_gpu = {"batch-size": 48, "dataset-size": 48 * 32}
    args.out.mkdir(parents=True, exist_ok=True)
    project = bake(args.out / "baked-language_model", "language_model")
    lines = [f"machine: {describe_machine(not args.cpu)}", "",
             "| lever | variant | tokens/s | MFU | peak memory per GPU | vs the row above |",
             "|---|---|---|---|---|---|"]
    results, previous, known_costs = [], None, {}
    for lever, variant, changes in ROWS:
        if args.cpu and "sdpa" in changes:
            continue  # flash and cuDNN attention are CUDA kernels
        workload = {**WORKLOADS["gpt2"], **changes, **(CPU if args.cpu else {})}
        if changes in (XL, XL_AC):
            workload.update(big_gpu)
        if variant == "ours":  # flags of raw_lm.py only
            workload = {k: v for k, v in workload.items() if k not in ("loss", "sdpa")}
        if args.cpu:
            workload["dataset-size"] = 2 * 32 * workload["batch-size"]  # 32 steps a rank
        if time.monotonic() > deadline - 30:
            lines.append(f"| {lever} | {variant} | not run: out of time | | | |")
            continue
        try:
            out = run_variant(variant, workload, project, args.out / "work" / variant, None,
                              not args.cpu)
        except RuntimeError as exc:
            oom = "out of memory" in str(exc).lower()
            lines.append(f"| {lever} | {variant} | {'out of memory' if oom else 'failed'} | | | |")
            results.append({"lever": lever, "variant": variant, "error": str(exc)[-2000:]})
            print(lines[-1], flush=True)
            continue
        flags = {k: v for k, v in workload.items() if k not in ("loss", "sdpa")}
        key = tuple(workload.get(k) for k in SHAPE)  # GPT-2 small's or XL's: a subprocess each
        costs = known_costs[key] = known_costs.get(key) or token_costs(project, flags)
        tokens, mfu = token_rate(out["samples_per_s"], costs, 2 if args.cpu else 1)
        memory = out.get("peak_mem_mb_per_rank")
        vs = f"{tokens / previous:.3f}x" if previous else ""
        lines.append(f"| {lever} | {variant} | {tokens:,.0f} | "
                     f"{f'{100 * mfu:.1f} %' if mfu is not None else 'n/a'} | "
                     f"{f'{memory / 1024:.1f} GiB' if memory else 'n/a'} | {vs} |")
        print(lines[-1], flush=True)
        results.append({"lever": lever, "variant": variant, "workload": workload,
                        "tokens_per_s": tokens, "mfu": mfu, **out})
        previous = tokens
    table = "\n".join(lines)
    (args.out / "levers.md").write_text(table + "\n")
    (args.out / "levers.json").write_text(json.dumps(results, indent=1))
    print(f"\n{table}\nwrote {args.out / 'levers.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
