"""NCCL on real GPUs. Skipped cleanly on machines without CUDA devices or without NCCL."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import TRAIN, ok, python_train, run_cmd

pytestmark = [
    pytest.mark.nccl,
    pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                       reason="needs CUDA GPUs and a PyTorch build with NCCL"),
]

ALL_REDUCE = """
import os, torch, torch.distributed as dist
rank = int(os.environ["RANK"]); local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
t = torch.full((4,), float(rank + 1), device="cuda")
dist.all_reduce(t)
n = dist.get_world_size()
assert torch.equal(t.cpu(), torch.full((4,), n * (n + 1) / 2)), t
print("all_reduce ok", rank, t.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_nccl_all_reduce(workdir):
    script = workdir / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    n = torch.cuda.device_count()
    result = ok(run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         f"--nproc-per-node={n}", str(script)], workdir))
    assert result.stdout.count("all_reduce ok") == n


def test_nccl_ddp_training(workdir):
    n = torch.cuda.device_count()
    ok(run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", TRAIN,
                "--no-progress", "--backend", "nccl", "--epochs", "2", "--dataset-size", "1024", "--precision", "bf16",
                "--step-times", "steps.json"], workdir))
    summary = json.loads((workdir / "runs/latest/summary.json").read_text())
    assert summary["backend"] == "nccl" and summary["world_size"] == n
    steps = json.loads((workdir / "steps.json").read_text())
    assert len(steps["cuda_step_ms"]) == len(steps["step_ends"]) - 1 and min(steps["cuda_step_ms"]) > 0


def test_nccl_model_parallel_on_one_gpu(workdir):
    ok(python_train(["--backend", "nccl", "--model-layout", "model_parallel_2", "--stage-devices",
                     "cuda:0,cuda:0", "--epochs", "1", "--dataset-size", "512"], workdir))
    summary = json.loads((workdir / "runs/latest/summary.json").read_text())
    assert summary["backend"] == "nccl" and summary["final_loss"] is not None
