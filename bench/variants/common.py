"""Shared by the hand-written variants: the baked project's data and model (so every variant trains
the same thing), step timing, and the result file. Run under torchrun."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from ddp_project.data import synthetic_regression
from ddp_project.model import MLP

STARTED_AT = time.time()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset-size", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--result", required=True)
    return p.parse_args()


def setup(args: argparse.Namespace):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = synthetic_regression(args.dataset_size, seed=0)
    model = MLP(args.hidden_size, args.num_layers)
    return data, model


class StepClock:
    """Wall-clock time at the end of every optimizer step (CPU: no device to synchronise)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def tick(self) -> None:
        self.ends.append(time.time())

    def write(self, path: str, **extra) -> None:
        if dist.get_rank() == 0:
            with open(path, "w") as f:
                json.dump({"started_at": STARTED_AT, "step_ends": self.ends, "world_size": dist.get_world_size(),
                           "pid": os.getpid(), **extra}, f)
