"""Helpers for tests that start real training processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(PROJECT_ROOT / "train.py")


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"):
        env.pop(name, None)  # never inherit a world from the shell running the tests
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_cmd(cmd: list[str], cwd: Path, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    """Run a command to completion; a hang fails the test instead of blocking the suite."""
    return subprocess.run(cmd, cwd=cwd, env=child_env(**env), capture_output=True, text=True, timeout=timeout)


def torchrun(args: list[str], cwd: Path, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", TRAIN,
           "--no-progress", *args]
    return run_cmd(cmd, cwd, timeout)


def python_train(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return run_cmd([sys.executable, TRAIN, "--no-progress", *args], cwd, timeout)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def read_metrics(output_dir: Path, key: str = "loss") -> list[dict]:
    """The records of metrics.jsonl that carry `key`: training logs ("loss") or evaluations ("val_loss")."""
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if key in r]


def final_model(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    from {{ cookiecutter.package_name }}.checkpoint import list_checkpoints, load_checkpoint

    return load_checkpoint(list_checkpoints(checkpoint_dir)[0])["model"]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A folder for PATH with `python` and `torchrun` of this interpreter, as the scripts expect."""
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "python").symlink_to(sys.executable)
    write_script(folder / "torchrun", f'exec "{sys.executable}" -m torch.distributed.run "$@"')
    return folder


def write_script(path: Path, body: str) -> Path:
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)
    return path


def path_with(folder: Path) -> str:
    return f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
