"""Shared pieces of the template's tests: valid answer combinations, baking, the expected file set."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHOICES = {name: value for name, value in json.loads((ROOT / "cookiecutter.json").read_text()).items()
           if isinstance(value, (list, bool))}
# Booleans are prompts with a default; both values are valid answers.
CHOICES = {name: (value if isinstance(value, list) else [False, True]) for name, value in CHOICES.items()}


def pytest_configure(config):
    # pytest-cookies bakes `--template` (default "."): make that this repository wherever pytest runs from.
    if getattr(config.option, "template", None) == ".":
        config.option.template = str(ROOT)


def is_valid(answers: dict) -> bool:
    """Combinations SPEC §2 says cannot work are not offered (test_hooks checks they are refused)."""
    return not (answers.get("windows_support") and answers.get("backend") == "nccl")


def pairwise_combinations() -> list[dict]:
    """A small set of valid answer combinations in which every pair of choices appears at least once."""
    names = list(CHOICES)
    candidates = [dict(zip(names, values, strict=True)) for values in itertools.product(*CHOICES.values())]
    candidates = [c for c in candidates if is_valid(c)]

    def pairs(combo: dict) -> set:
        return {((a, combo[a]), (b, combo[b])) for a, b in itertools.combinations(names, 2)}

    uncovered = set().union(*(pairs(c) for c in candidates))
    chosen = [candidates[0]]  # the defaults come first in every choice list
    uncovered -= pairs(candidates[0])
    while uncovered:
        best = max(candidates, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


def expected_files(package: str, answers: dict) -> set[str]:
    files = {
        ".gitignore", "README.md", "pyproject.toml", "requirements.txt", "train.py",
        "scripts/train_local.sh", "scripts/train_multinode.sh", "scripts/plot_metrics.py",
        "tests/conftest.py", "tests/test_checkpoint.py", "tests/test_cli.py", "tests/test_data.py",
        "tests/test_distributed.py", "tests/test_features.py", "tests/test_launchers.py", "tests/test_layouts.py",
        "tests/test_nccl.py", "tests/test_recovery.py", "tests/test_train.py",
    }
    files |= {f"{package}/{name}.py" for name in
              ("__init__", "checkpoint", "config", "data", "distributed", "doctor", "metrics", "model", "train",
               "trainer")}
    if answers.get("slurm", True):
        files |= {"scripts/slurm/torchrun.sbatch", "scripts/slurm/srun.sbatch", "tests/test_slurm.py"}
    if answers.get("windows_support", False):
        files.add("scripts/train_windows.ps1")
    if answers.get("github_actions", True):
        files.add(".github/workflows/ci.yml")
    return files


def project_files(project: Path) -> set[str]:
    return {p.relative_to(project).as_posix() for p in project.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts}


def run(cmd: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        full_env.pop(name, None)
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def check_ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    output = f"{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    assert result.returncode == 0, f"{result.args}\nexit {result.returncode}\n{output}"
    return result


@pytest.fixture
def bake(cookies):
    """Bake with `answers` and return the project folder, failing the test on any bake error."""

    def _bake(**answers) -> Path:
        result = cookies.bake(extra_context=answers)
        assert result.exit_code == 0 and result.exception is None, result.exception
        return result.project_path

    return _bake


PYTHON = sys.executable
