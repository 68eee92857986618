"""Shared pieces of the template's tests: valid answer combinations, baking, the expected file set,
and fresh virtual environments to run baked projects in, the way users do."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest
from budgets import part_of, table

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
ANSWERS = json.loads((ROOT / "cookiecutter.json").read_text())
# Every prompt with a fixed set of answers; booleans are prompts whose answers are false and true.
CHOICES = {name: (value if isinstance(value, list) else [False, True])
           for name, value in ANSWERS.items()
           if not name.startswith("_") and isinstance(value, (list, bool))}
TORCH = "torch==2.13.0"  # the only torch this machine installs (a local CPU build)


# Where the time goes, printed at the end of every run: seconds per part of the suite (a file,
# or a generated project's suite; setup, call and teardown of its tests) beside its budget.
SECONDS_PER_PART: dict[str, float] = {}


def pytest_runtest_logreport(report):
    part = part_of(report.nodeid)
    SECONDS_PER_PART[part] = SECONDS_PER_PART.get(part, 0.0) + report.duration


def pytest_sessionstart(session):
    session.config.started_at = time.monotonic()


def pytest_terminal_summary(terminalreporter, config):
    if not SECONDS_PER_PART:
        return
    terminalreporter.write_sep("=", "seconds per part, beside its budget (tests/budgets.py)")
    workers = getattr(config.option, "numprocesses", None)  # the Makefile's first pass: -n 2
    overlapped = (workers, time.monotonic() - config.started_at) if workers else None
    for line in table(SECONDS_PER_PART, overlapped):
        terminalreporter.write_line(line)


def pytest_configure(config):
    # pytest-cookies bakes `--template` (default "."): make that this repository wherever pytest
    # runs from.
    if getattr(config.option, "template", None) == ".":
        config.option.template = str(ROOT)


def is_valid(answers: dict) -> bool:
    """The combinations the pre-generation hook refuses are not offered (test_hooks checks that
    they are refused)."""
    return not ((answers.get("windows_support") and answers.get("backend") == "nccl")
                or (answers.get("fault_tolerance") == "torchft"
                    and answers.get("model_layout", "data_parallel") != "data_parallel")
                or (answers.get("launcher") == "ray"
                    and (answers.get("fault_tolerance") == "torchft"
                         or answers.get("windows_support"))))


def pairwise_combinations() -> list[dict]:
    """A small set of valid answer combinations in which every pair of choices appears."""
    names = list(CHOICES)
    candidates = [dict(zip(names, values, strict=True))
                  for values in itertools.product(*CHOICES.values())]
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


def answers_id(answers: dict) -> str:
    """A test id that names every answer: launcher=spawn-backend=gloo-..."""
    return "-".join(f"{name}={value}" for name, value in answers.items()) or "defaults"


def expected_files(package: str, answers: dict) -> set[str]:
    files = {
        ".gitignore", "README.md", "pyproject.toml", "requirements.txt", "train.py",
        "configs/example.toml", "scripts/train_local.sh", "scripts/train_multinode.sh", "scripts/preflight.sh",
        "scripts/plot_metrics.py", "scripts/predict.py", "docs/worked-example.md", "docs/launching.md",
        "docs/recovery.md", "docs/performance.md", "docs/configuration.md", "docs/custom-step.md",
        "docs/data.md",
    }
    files |= {f"tests/{name}.py" for name in (
        "conftest", "hosts", "test_backstop", "test_checkpoint", "test_config", "test_custom_step", "test_custom_task",
        "test_data", "test_doc_commands",
        "test_distributed", "test_docs", "test_ema", "test_features", "test_hangs", "test_hsdp", "test_launchers",
        "test_layouts", "test_mistakes", "test_nccl", "test_network", "test_object_storage", "test_plan",
        "test_recovery", "test_shards", "test_task", "test_torch_private", "test_tracker", "test_train",
        "s3server")}
    files |= {f"{package}/{name}.py" for name in (
        "__init__", "config", "data", "doctor", "ema", "evaluation", "failures", "loop", "main", "meters", "metrics",
        "optim", "parallel", "plan", "settings", "step", "task")}
    files |= {f"{package}/checkpoint/{name}.py" for name in (
        "__init__", "__main__", "checkpointer", "export", "files", "folder", "resume", "sharded", "storage")}
    files |= {f"{package}/shards/{name}.py" for name in ("__init__", "__main__", "read", "text", "write")}
    files |= {f"{package}/runtime/{name}.py" for name in (
        "__init__", "backstop", "comm_hooks", "environments", "launch", "lifeline", "nccl", "network", "prefetch",
        "rendezvous", "torch_private", "trackers", "workarounds", "workers")}
    if answers.get("task") == "language_model":
        files |= {"configs/gpt2-small.toml", f"{package}/cross_entropy.py",
                  f"{package}/text_files.py"}
    if answers.get("task") == "hf_causal_lm":
        files |= {f"{package}/cross_entropy.py", f"{package}/hf.py"}
    if answers.get("task", "classification") == "classification":
        files.add(f"{package}/images.py")
    if answers.get("model_layout") == "tensor_parallel":
        files |= {f"{package}/tensor_parallel.py", "tests/test_tensor_parallel.py"}
    if answers.get("slurm", True):
        files |= {"scripts/slurm/torchrun.sbatch", "scripts/slurm/srun.sbatch",
                  "tests/test_slurm.py"}
    if answers.get("windows_support", False):
        files.add("scripts/train_windows.ps1")
    if answers.get("kubernetes", False):
        files |= {"Dockerfile", ".dockerignore", "k8s/pytorchjob.yaml", "k8s/trainjob.yaml",
                  "k8s/pvc.yaml"}
    if answers.get("github_actions", True):
        files.add(".github/workflows/ci.yml")
    if answers.get("launcher") == "ray":
        files |= {"scripts/train_ray.py", f"{package}/runtime/ray_train.py",
                  f"{package}/runtime/ray_stop.py", "tests/test_ray.py"}
    if answers.get("fault_tolerance", "none") == "torchft":
        files |= {"train_ft.py", f"{package}/fault_tolerance.py", f"{package}/replica_groups.py",
                  "scripts/train_ft.sh", "scripts/bench_ft.py",
                  "tests/test_fault_tolerance.py", "docs/fault-tolerance.md"}
        if answers.get("slurm", True):
            files.add("scripts/slurm/ft.sbatch")
    return files


def project_files(project: Path) -> set[str]:
    return {p.relative_to(project).as_posix() for p in project.rglob("*")
            if p.is_file() and not {"__pycache__", ".pytest_cache", ".ruff_cache"} & set(p.parts)}


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID")


def run(cmd: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    full_env.update({"OMP_NUM_THREADS": "1", **env})
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


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


@pytest.fixture(scope="session")
def baked_once(tmp_path_factory):
    """Bake with `answers` once per session, for tests that only read the bake (its files, its
    docs' own test): the pairwise set is read by test_bake.py and test_docs_pointers.py."""
    from cookiecutter.main import cookiecutter
    made: dict[str, Path] = {}

    def _bake(**answers) -> Path:
        key = answers_id(answers)
        if key not in made:
            made[key] = Path(cookiecutter(str(ROOT), no_input=True, extra_context=answers,
                                          output_dir=str(tmp_path_factory.mktemp("baked"))))
        return made[key]

    return _bake


class Venv:
    """A fresh virtual environment (no system site-packages), as a user would make one."""

    def __init__(self, folder: Path) -> None:
        venv.create(folder, with_pip=True)
        self.folder = folder
        self.bin = folder / ("Scripts" if sys.platform == "win32" else "bin")
        self.python = str(self.bin / "python")

    def env(self) -> dict[str, str]:
        """What `source .venv/bin/activate` sets."""
        return {"VIRTUAL_ENV": str(self.folder),
                "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}", "PYTHONNOUSERSITE": "1"}

    def run(self, cmd: list[str] | str, cwd: Path, timeout: float = 900,
            **env: str) -> subprocess.CompletedProcess:
        """A command (a string runs in bash) with this environment active."""
        cmd = ["bash", "-c", cmd] if isinstance(cmd, str) else cmd
        return run(cmd, cwd, timeout, **self.env(), **env)

    def pip(self, *args: str, cwd: Path) -> None:
        check_ok(self.run([self.python, "-m", "pip", "install", "-q", *args], cwd))

    def has(self, module: str, cwd: Path) -> bool:
        result = self.run([self.python, "-c", f"import {module}"], cwd)
        return result.returncode == 0


@pytest.fixture(scope="session")
def torch_venv(tmp_path_factory) -> Venv:
    """A fresh venv with only the pinned torch installed (shared by the tests that add to it)."""
    env = Venv(tmp_path_factory.mktemp("venv") / ".venv")
    env.pip(TORCH, cwd=env.folder)
    return env
