"""NCCL on real GPUs: skipped cleanly on machines without CUDA devices or without NCCL."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from conftest import (
    TRAIN,
    assert_same_model,
    final_model,
    ok,
    python_train,
    run_cmd,
    summary,
    torchrun_cmd,
)

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
    result = ok(run_cmd([*torchrun_cmd(n), str(script)], workdir, gpus=True))
    assert result.stdout.count("all_reduce ok") == n


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("layout", ["data_parallel", "fsdp"])
def test_nccl_training(workdir, precision, layout):
    n = torch.cuda.device_count()
    ok(run_cmd([*torchrun_cmd(n), TRAIN, "--no-progress", "--backend", "nccl", "--epochs", "2",
                "--dataset-size", "1024", "--precision", precision, "--model-layout", layout,
                "--step-times", "steps.json"], workdir, gpus=True))
    done = summary(workdir / "runs/latest")
    assert done["backend"] == "nccl" and done["world_size"] == n and done["final_loss"] > 0
    assert done["peak_mem_mb"][0] > 0
    steps = json.loads((workdir / "steps.json").read_text())
    assert len(steps["cuda_step_ms"]) == len(steps["step_ends"]) - 1
    assert min(steps["cuda_step_ms"]) > 0


def test_nccl_model_parallel_on_one_gpu(workdir):
    ok(python_train(["--backend", "nccl", "--model-layout", "model_parallel_2", "--stage-devices",
                     "cuda:0,cuda:0", "--epochs", "1", "--dataset-size", "512"], workdir,
                    gpus=True))
    done = summary(workdir / "runs/latest")
    assert done["backend"] == "nccl" and done["final_loss"] is not None


@pytest.mark.compile
def test_nccl_compile(workdir):
    ok(python_train(["--backend", "nccl", "--compile", "--epochs", "1", "--dataset-size", "512"],
                    workdir, timeout=600, gpus=True))
    assert summary(workdir / "runs/latest")["steps"] > 0


def test_nccl_resume_is_exact_on_the_gpu(workdir):
    args = ["--backend", "nccl", "--epochs", "2", "--dataset-size", "512", "--deterministic"]
    ok(python_train([*args, "--checkpoint-dir", "a"], workdir, gpus=True))
    ok(python_train([*args, "--checkpoint-dir", "b", "--max-steps", "11"], workdir, gpus=True))
    ok(python_train([*args, "--checkpoint-dir", "b"], workdir, gpus=True))
    assert_same_model(final_model(workdir / "a"), final_model(workdir / "b"))


def test_data_on_the_gpu_trains_to_the_same_weights_as_copied_batches(workdir):
    args = ["--backend", "nccl", "--epochs", "2", "--dataset-size", "512", "--deterministic"]
    ok(python_train([*args, "--checkpoint-dir", "a"], workdir, gpus=True))
    ok(python_train([*args, "--checkpoint-dir", "b", "--data-on-device", "never"], workdir,
                    gpus=True))
    assert_same_model(final_model(workdir / "a"), final_model(workdir / "b"))
