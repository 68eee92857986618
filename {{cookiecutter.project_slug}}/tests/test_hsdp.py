"""HSDP: fsdp sharded within groups of ranks and replicated across them (--shard-group-size), on
4 gloo processes as 2 x 2: it trains as fsdp and DDP do, each rank holds half of each parameter,
a killed run resumes bit for bit, and its checkpoints load onto other meshes."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    TRAIN,
    assert_same_model,
    final_model,
    kill_a_worker_once_saved,
    made_once,
    needs_numpy,
    ok,
    read_metrics,
    run_cmd,
    skip_unless_example_task,
    summary,
    torchrun,
    torchrun_cmd,
)

from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints, read_meta
from {{ cookiecutter.package_name }}.failures import UsageError
from {{ cookiecutter.package_name }}.parallel import shard_group_size

# 8 steps an epoch at 4 ranks, 16 in all, a checkpoint every 4.
FLAGS = ["--dataset-size", "512", "--batch-size", "16", "--hidden-size", "16", "--epochs", "2",
         "--log-every", "4", "--save-every-steps", "4", "--keep-last", "0"]
HSDP = [*FLAGS, "--model-layout", "fsdp", "--shard-group-size", "2"]


def test_the_default_shard_group_is_one_node():
    assert shard_group_size(0, 16, 8) == 8  # two nodes of 8: HSDP, 2 x 8
    assert shard_group_size(0, 8, 8) == 8  # one node: plain fsdp
    assert shard_group_size(0, 4, 0) == 4  # no launcher told: plain fsdp
    assert shard_group_size(2, 4, 4) == 2
    with pytest.raises(UsageError, match="--shard-group-size 3 must divide the 4 ranks"):
        shard_group_size(3, 4, 4)


# train.py that also writes each parameter's full shape, this rank's shard and the mesh.
WITH_SHARDS = """
import json
import torch.distributed as dist
import {{ cookiecutter.package_name }}.main as entry
from {{ cookiecutter.package_name }}.main import exit_process, main

original = entry.parallelize

def parallelize(*args, **kwargs):
    model = original(*args, **kwargs)
    shards = {name: [list(p.shape), list(p.to_local().shape), list(p.device_mesh.shape)]
              for name, p in model.named_parameters()}
    # A file each: four processes' lines on one pipe can run into each other.
    with open(f"rank{dist.get_rank()}.json", "w") as out:
        json.dump(shards, out)
    return model

entry.parallelize = parallelize
exit_process(main())
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """An HSDP run (2 x 2, 4 epochs) that was never interrupted, started through WITH_SHARDS:
    one launch for the training tests and the shard test (for both xdist workers)."""
    skip_unless_example_task()

    def train(folder: Path) -> None:
        script = folder / "with_shards.py"
        script.write_text(WITH_SHARDS)
        result = ok(run_cmd([*torchrun_cmd(4), str(script), "--no-progress", *HSDP, "--epochs",
                             "4", "--checkpoint-dir", "a", "--output-dir", "runs/a"], folder))
        assert "fsdp: 2 replica group(s) of 2 rank(s) (HSDP)" in result.stdout

    return made_once(tmp_path_factory, "hsdp", train)


# train.py with plain SGD: AdamW divides each step by the gradient's own size, which hides
# gradients summed over the ranks instead of averaged (pytorch#162338 reported such a sum); SGD
# moves twice as far. And each rank builds other weights (a rank-seeded init): fsdp must start
# every rank from rank 0's, as DDP's wrap does, or the shards are pieces of different models.
WITH_SGD = """
import os
import torch
import {{ cookiecutter.package_name }}.task as task
from {{ cookiecutter.package_name }}.main import exit_process, main



class SGD(torch.optim.SGD):
    # With SUMMED=1: on gradients summed over the ranks (the bug the test must catch).

    def step(self, closure=None):
        if os.environ.get("SUMMED"):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(int(os.environ["WORLD_SIZE"]))
        return super().step(closure)


task.configure_optimizer = lambda model, cfg: SGD(model.parameters(), lr=cfg.lr)
build_model = task.build_model

def rank_seeded(cfg):
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(int(os.environ.get("RANK", 0)))
    return model

task.build_model = rank_seeded
exit_process(main())
"""


@pytest.mark.full
@needs_numpy
def test_fsdp_and_hsdp_train_and_average_gradients_as_ddp_does(tmp_path, example_task):
    """Plain SGD, the same data, seed and global batch (64): fsdp on 2 ranks and HSDP on 4 (2 x 2)
    log a one-process data_parallel run's losses and end with its weights (a batch is the same
    samples at any world size with the same global batch: data.py); only the order of the
    reductions differs. The control: HSDP with its gradients summed over the 4 ranks instead
    (SUMMED=1), which the same comparison must tell apart."""
    script = tmp_path / "with_sgd.py"
    script.write_text(WITH_SGD)

    def run(name: str, nproc: int, batch: int, *args: str, **env: str) -> tuple:
        cmd = torchrun_cmd(nproc) if nproc > 1 else [sys.executable]
        ok(run_cmd([*cmd, str(script), "--no-progress", *FLAGS, "--lr", "0.05",
                    "--batch-size", str(batch), *args, "--checkpoint-dir", name,
                    "--output-dir", f"runs/{name}"], tmp_path, **env))
        losses = [r["loss"] for r in read_metrics(tmp_path / f"runs/{name}")]
        return losses, final_model(tmp_path / name)

    def same(a: dict, b: dict) -> bool:
        return all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)

    curve, expected = run("one", 1, 64)
    hsdp = ("--model-layout", "fsdp", "--shard-group-size", "2")
    for name, nproc, batch in (("fsdp", 2, 32), ("hsdp", 4, 16)):
        losses, weights = run(name, nproc, batch, *hsdp)
        assert losses == pytest.approx(curve, rel=1e-4) and same(weights, expected), name
    losses, weights = run("summed", 4, 16, *hsdp, SUMMED="1")
    assert losses[1:] != pytest.approx(curve[1:], rel=1e-4) and not same(weights, expected)


@pytest.mark.full
@needs_numpy
def test_each_rank_holds_half_of_each_parameter(uninterrupted, example_task):
    for rank in range(4):
        shards = json.loads((uninterrupted / f"rank{rank}.json").read_text())
        for name, (full, local, mesh) in shards.items():
            assert mesh == [2, 2], name  # 2 replica groups x 2 shards
            # FSDP2 cuts dim 0 in equal chunks; the last rank's may be short (or empty).
            assert local[0] <= math.ceil(full[0] / 2) and local[1:] == full[1:], name
        assert sum(math.prod(s[1]) for s in shards.values()) > 0


@pytest.mark.full
@needs_numpy
def test_a_killed_hsdp_run_resumes_bit_for_bit(uninterrupted, example_task):
    workdir = uninterrupted
    b = [*HSDP, "--checkpoint-dir", "b", "--output-dir", "runs/b", "--epochs", "4"]
    kill_a_worker_once_saved([*torchrun_cmd(4), TRAIN, "--no-progress", *b], workdir,
                             workdir / "b", 8, worker=3)
    assert max(read_meta(p)["step"] for p in list_checkpoints(workdir / "b")) < 32, "too late"
    ok(torchrun(b, workdir, nproc=4))
    assert_same_model(final_model(workdir / "a"), final_model(workdir / "b"))


@pytest.mark.full
@needs_numpy
@pytest.mark.parametrize("nproc, shard", [(4, "4"), (2, "1")], ids=["as-1x4", "as-2x1"])
def test_an_hsdp_checkpoint_resumes_on_another_mesh(uninterrupted, tmp_path, nproc, shard):
    middle = uninterrupted / "a" / "ckpt_step00000008"
    shutil.copytree(middle, tmp_path / "c" / middle.name)
    args = [*FLAGS, "--model-layout", "fsdp", "--shard-group-size", shard, "--checkpoint-dir", "c"]
    result = ok(torchrun(args, tmp_path, nproc=nproc))
    assert f"resumed from c/{middle.name}" in result.stdout
    assert summary(tmp_path / "runs/latest")["steps"] > 8
