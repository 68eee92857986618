"""Per-step overhead of the generated Trainer over the raw loop, measured in one process.

Whole-process runs on a small shared machine vary by 10-20% from run to run, which hides a
difference of tens of microseconds. Here both loops run in the same process (world size 1, gloo,
DDP with its reducer), alternating ours, raw, ours, raw ..., each pair on a fresh model and
optimizer, so drift hits both alike. Ours is the project's real data, model, optimizer and Trainer
assembled by its own `main.work` (task.py's loss included), timed by its own `--step-times` report.
Noise only ever adds time, so each run is summarised by its median and by its 10th-percentile step
(the step nothing else got in the way of). Run under torchrun, one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import finish, make_optimizer
from ddp_project.config import parse_args
from ddp_project.main import work
from ddp_project.runtime.environments import World
from ddp_project.runtime.lifeline import Lifeline
from ddp_project.task import MLP, Settings, synthetic_regression
from torch.nn.parallel import DistributedDataParallel as DDP

WARMUP_STEPS = 20  # dropped, as everywhere in the benchmark


def step_stats(ends: list[float]) -> tuple[float, float]:
    """(median, 10th percentile) of the step times in ms, warm-up dropped."""
    ms = [1000 * (b - a) for a, b in zip(ends, ends[1:], strict=False)][WARMUP_STEPS:]
    return statistics.median(ms), statistics.quantiles(ms, n=10)[0]


def ours(argv: list[str], world: World, lifeline: Lifeline, step_times: str) -> tuple[float, float]:
    work(parse_args(argv, Settings), world, "gloo", [torch.device("cpu")], lifeline)
    with open(step_times) as f:
        return step_stats(json.load(f)["step_ends"])


def raw(size: int, batch_size: int, hidden: int, layers: int) -> tuple[float, float]:
    torch.manual_seed(0)
    data = synthetic_regression(size, seed=0)
    x_all, y_all = data.tensors
    model = MLP(hidden, layers)
    ddp, opt = DDP(model), make_optimizer(model.parameters())
    ends = []
    order = torch.randperm(size, generator=torch.Generator().manual_seed(0))
    for start in range(0, size, batch_size):
        idx = order[start:start + batch_size]
        loss = F.mse_loss(ddp(x_all[idx]), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ends.append(time.perf_counter())  # the same clock as the project's StepClock
    return step_stats(ends)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = World(rank=0, local_rank=0, world_size=1, local_world_size=1, launcher="torchrun")
    lifeline = Lifeline(0, 300.0)  # not started: ours runs in this process, signals stay default
    ours_ms, raw_ms = [], []
    with tempfile.TemporaryDirectory() as tmp:
        # The project's defaults, minus what the raw loop does not do either: validation, progress
        # bar, per-epoch checkpoints (the one final save happens after the last timed step).
        argv = ["--epochs", "1", "--batch-size", str(args.batch_size), "--dataset-size",
                str(args.dataset_size), "--hidden-size", str(args.hidden_size), "--num-layers",
                str(args.num_layers), "--val-fraction", "0", "--no-progress", "--save-every", "0",
                "--resume", "never", "--step-times", f"{tmp}/steps.json"]
        for i in range(args.pairs):
            run_dirs = ["--output-dir", f"{tmp}/runs{i}", "--checkpoint-dir", f"{tmp}/ck{i}"]
            ours_ms.append(ours(argv + run_dirs, world, lifeline, f"{tmp}/steps.json"))
            raw_ms.append(raw(args.dataset_size, args.batch_size, args.hidden_size, args.num_layers))
    report = {"pairs": args.pairs, "steps_per_run": -(-args.dataset_size // args.batch_size),
              "ours_ms": ours_ms, "raw_ms": raw_ms}
    for i, name in enumerate(["median", "p10"]):  # median over pairs of ours minus raw, per statistic
        pairs = [(o[i], r[i]) for o, r in zip(ours_ms, raw_ms, strict=True)]
        report[f"overhead_us_{name}"] = statistics.median(1000 * (o - r) for o, r in pairs)
        report[f"ratio_{name}"] = statistics.median(o / r for o, r in pairs)
    with open(args.result, "w") as f:
        json.dump(report, f)
    finish()


if __name__ == "__main__":
    main()
