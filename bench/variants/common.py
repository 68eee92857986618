"""Shared by the hand-written variants: the baked project's data and model (so every variant trains
the same thing), step timing, and the result file. Run under torchrun.

CPU: gloo, fp32, wall-clock step ends. GPU (`--device cuda`): NCCL, bf16 autocast, and each step's
time measured between CUDA events (the host clock would only time kernel launches).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
from ddp_project.meters import StepClock  # the project's own clock: every variant timed alike
from ddp_project.runtime.workarounds import exit_process

STARTED_AT = time.time()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset-size", type=int, default=0)  # the images workload reads a folder
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--data", default=None)
    p.add_argument("--result", required=True)
    return p.parse_args()


def setup(args: argparse.Namespace):
    """Process group, the project's synthetic data (on CPU) and its MLP (on the device)."""
    # Here, not at the top: the images variant imports this file from a classification project.
    from ddp_project.task import MLP, synthetic_regression

    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)) if args.device == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = synthetic_regression(args.dataset_size, seed=0)
    model = MLP(args.hidden_size, args.num_layers).to(device)
    return data, model, device


def make_optimizer(params, device: torch.device | None = None) -> torch.optim.Optimizer:
    """The generated project's optimizer with its defaults (--lr 3e-3, --weight-decay 0; the fused
    kernel, on a GPU and on the CPU)."""
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0, fused=True)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 on a GPU (the GPU mode's precision), plain fp32 on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def finish() -> None:
    """Leave the process group and end the process the way the generated project does (see its
    exit_process: a DDP's gloo group can abort interpreter shutdown). Nothing here is timed."""
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_process(0)


def write_result(clock: StepClock, path: str, **extra) -> None:
    """Rank 0 writes the step times (and on a GPU the CUDA-event times) as the project does."""
    report = clock.report(STARTED_AT)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump({**report, "world_size": dist.get_world_size(), "pid": os.getpid(), **extra}, f)
