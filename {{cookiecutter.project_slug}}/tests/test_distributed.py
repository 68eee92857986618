"""The pure parts of distributed setup: who am I, which backend, which devices, which init URL."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.config import parse_args
from {{ cookiecutter.package_name }}.distributed import (
    SetupError,
    World,
    assign_devices,
    expand_nodelist,
    file_uri,
    find_free_port,
    resolve_backend,
    resolve_init_method,
    resolve_world,
    windows_env,
)
from {{ cookiecutter.package_name }}.train import run

TORCHRUN_ENV = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "abc"}


def test_torchrun_environment():
    world = resolve_world(TORCHRUN_ENV)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (3, 1, 4, 2)
    assert (world.launcher, world.master_addr, world.master_port) == ("torchrun", "10.0.0.1", 29400)


def test_local_rank_variable_wins_over_legacy_flag():
    assert resolve_world(TORCHRUN_ENV, local_rank_flag=0).local_rank == 1
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_RANK"}
    world = resolve_world(env, local_rank_flag=1)
    assert (world.local_rank, world.launcher) == (1, "launch")


def test_missing_local_rank_is_explained():
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_RANK"}
    with pytest.raises(SetupError, match="LOCAL_RANK"):
        resolve_world(env)


def test_rank_outside_world_is_explained():
    with pytest.raises(SetupError, match="outside a world"):
        resolve_world({**TORCHRUN_ENV, "RANK": "4"})


def test_no_launcher_is_a_world_of_one():
    world = resolve_world({})
    assert (world.rank, world.world_size, world.launcher) == (0, 1, "none")
    assert world.master_port and world.master_port > 0


def test_slurm_environment():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    world = resolve_world(env)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (5, 1, 8, 4)
    assert (world.launcher, world.master_addr, world.master_port) == ("slurm", "gpu07", 15000 + 4242)


def test_slurm_without_srun_is_explained():
    with pytest.raises(SetupError, match="srun"):
        resolve_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1"})


def test_slurm_mismatched_task_counts_are_explained():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
    with pytest.raises(SetupError, match="--ntasks-per-node"):
        resolve_world(env)
    with pytest.raises(SetupError, match="SLURM_LOCALID=2"):
        resolve_world({**env, "SLURM_NTASKS": "4", "SLURM_LOCALID": "2"})


def test_torchrun_inside_slurm_uses_torchrun_variables():
    env = {**TORCHRUN_ENV, "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert resolve_world(env).launcher == "torchrun"


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_backend_auto_and_refusals():
    assert resolve_backend("auto", cuda_count=0, nccl_available=True) == "gloo"
    assert resolve_backend("auto", cuda_count=2, nccl_available=True) == "nccl"
    assert resolve_backend("auto", cuda_count=2, nccl_available=False) == "gloo"
    with pytest.raises(SetupError, match="--backend gloo"):
        resolve_backend("nccl", cuda_count=0, nccl_available=True)
    with pytest.raises(SetupError, match="Windows"):
        resolve_backend("nccl", cuda_count=1, nccl_available=True, platform="win32")


@pytest.mark.parametrize("local_rank, local_world, cuda, layout, visible, expected", [
    (1, 2, 0, "data_parallel", None, ["cpu"]),
    (1, 2, 2, "data_parallel", None, ["cuda:1"]),
    (1, 2, 8, "data_parallel", "0,1,2,3,4,5,6,7", ["cuda:1"]),
    (0, 1, 1, "data_parallel", None, ["cuda:0"]),
    (3, 4, 1, "data_parallel", "3", ["cuda:0"]),  # --gpus-per-task=1: each process sees its own GPU
    (1, 2, 4, "model_parallel_2", None, ["cuda:2", "cuda:3"]),
    (0, 2, 0, "model_parallel_2", None, ["cpu", "cpu"]),
    (1, 2, 2, "model_parallel_2", "2,3", ["cuda:0", "cuda:1"]),  # --gpus-per-task=2
])
def test_assign_devices(local_rank, local_world, cuda, layout, visible, expected):
    devices = assign_devices(local_rank, local_world, cuda, layout, visible_devices=visible)
    assert devices == [torch.device(d) for d in expected]


def test_assign_devices_refuses_too_few_gpus():
    with pytest.raises(SetupError, match="need 4 GPUs .* 2 are visible; start fewer processes"):
        assign_devices(0, 4, 2, "data_parallel")
    # Two processes and one GPU that nobody split up: they would share it ("Duplicate GPU detected").
    with pytest.raises(SetupError, match="need 2 GPUs"):
        assign_devices(1, 2, 1, "data_parallel", visible_devices=None)
    with pytest.raises(SetupError, match="--stage-devices"):
        assign_devices(0, 2, 3, "model_parallel_2")


def test_stage_devices_override():
    assert assign_devices(0, 1, 1, "model_parallel_2", ["cuda:0", "cuda:0"]) == [torch.device("cuda:0")] * 2
    with pytest.raises(SetupError, match="only 1 CUDA"):
        assign_devices(0, 1, 1, "model_parallel_2", ["cuda:0", "cuda:1"])


def test_init_method_urls(tmp_path: Path):
    world = World(0, 0, 2, 2, "spawn", "127.0.0.1", 12345, "run1")
    assert resolve_init_method("env", world, tmp_path) == "env://"
    assert resolve_init_method("tcp", world, tmp_path) == "tcp://127.0.0.1:12345"
    assert resolve_init_method("tcp://h:1", world, tmp_path) == "tcp://h:1"
    url = resolve_init_method("file", world, tmp_path / "rdzv")
    assert url == (tmp_path / "rdzv" / "store-run1").resolve().as_uri() and (tmp_path / "rdzv").is_dir()
    assert resolve_init_method(str(tmp_path / "x" / "store"), world, tmp_path).startswith("file:///")
    with pytest.raises(SetupError, match="three slashes"):
        resolve_init_method("file://tmp/store", world, tmp_path)


def test_stale_and_fresh_store_files(tmp_path: Path):
    world = World(0, 0, 2, 2, "spawn", "127.0.0.1", 1, "r")
    fresh = tmp_path / "fresh"
    fresh.write_bytes(b"a peer of this launch wrote this a moment ago")
    assert resolve_init_method(str(fresh), world, tmp_path) == fresh.resolve().as_uri()
    os.utime(fresh, (0, 0))
    with pytest.raises(SetupError, match="left over from an earlier run"):
        resolve_init_method(str(fresh), world, tmp_path)


def test_windows_branches(tmp_path: Path):
    assert resolve_backend("auto", cuda_count=2, nccl_available=True, platform="win32") == "gloo"
    assert windows_env("win32", "2.4.1+cu121") == {"USE_LIBUV": "0"}
    assert windows_env("win32", "2.3.1") == {}
    assert windows_env("linux", "2.13.0") == {}
    assert file_uri("C:\\runs\\rendezvous\\store", platform="win32") == "file:///C:/runs/rendezvous/store"
    assert file_uri("\\\\server\\share\\store", platform="win32") == "file://server/share/store"
    world = World(0, 0, 1, 1, "none", "127.0.0.1", 1, "w")
    # Without a launcher, Windows meets through a file instead of a TCP store.
    assert resolve_init_method("env", world, tmp_path, platform="win32").startswith("file:///")
    assert resolve_init_method("env", replace(world, launcher="torchrun"), tmp_path, platform="win32") == "env://"


def test_windows_path_trains_with_platform_patched(monkeypatch, tmp_path: Path):
    import torch._dynamo  # noqa: F401  (imported lazily by DDP; it reads sysconfig, which a patched platform breaks)

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.delenv("USE_LIBUV", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = parse_args(["--epochs", "1", "--dataset-size", "64", "--no-progress", "--init-method", "env"])
    summary = run(cfg, World(0, 0, 1, 1, "none", "127.0.0.1", find_free_port(), "win-test"))
    assert summary["backend"] == "gloo" and summary["steps"] == 2
    assert os.environ["USE_LIBUV"] == "0"
    assert not list((tmp_path / "runs/latest/rendezvous").iterdir()), "the store file was not removed"
