"""Helpers for tests that start real training processes."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from filelock import FileLock  # a dependency of torch

# Two tiers. `pytest` runs in about two minutes: every module's unit tests, your task's tests and
# one real 2-process run that is killed, resumed and compared bit for bit. `pytest --full` adds
# the rest: every launcher, recovery, hangs and the backstop, the mistakes table, the layouts
# (fsdp), trackers, torch.compile, NCCL and the multi-machine network tests.
FULL_TIER = {"full", "launchers", "recovery", "features", "compile", "network", "nccl"}


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the slow tier (launchers, recovery, fsdp, network, ...)")


# fsdp on a CPU needs torch 2.9 or later: before, a run stops with one error line
# (runtime/torch_private.py's fsdp_on, checked by test_torch_private), and so do its tests.
NO_CPU_FSDP = None if torch.__version__ >= "2.9" else (
    f"fsdp on a CPU needs torch 2.9 or later, not {torch.__version__} (its one error line: "
    "test_torch_private)")


def pytest_collection_modifyitems(config, items):
    for item in items if NO_CPU_FSDP and not torch.cuda.is_available() else []:
        if re.search("fsdp|hsdp", item.nodeid.lower()) or item.get_closest_marker("fsdp"):
            item.add_marker(pytest.mark.skip(reason=NO_CPU_FSDP))
    if config.getoption("--full"):
        return
    slow = [item for item in items
            if FULL_TIER & {m.name for m in item.iter_markers()}
            and item.get_closest_marker("quick") is None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item not in slow]


PROJECT_ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(PROJECT_ROOT / "train.py")
# Variables a launcher sets: a test starts its own jobs and must never inherit a world.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS",
                 "SLURM_LOCALID", "KUBERNETES_SERVICE_HOST")


def child_env(gpus: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a process a test starts: no launcher's variables, one thread, and no GPU
    unless `gpus`, so the gloo tests run as on a CPU machine wherever they run."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def run_cmd(cmd: list[str], cwd: Path, timeout: float = 240, gpus: bool = False,
            **env: str) -> subprocess.CompletedProcess:
    """Run a command to completion; a hang fails the test instead of blocking the suite."""
    return subprocess.run(cmd, cwd=cwd, env=child_env(gpus, **env), capture_output=True,
                          text=True, timeout=timeout)


def torchrun_cmd(nproc: int = 2, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *extra]


def torchrun(args: list[str], cwd: Path, nproc: int = 2, timeout: float = 240,
             **env: str) -> subprocess.CompletedProcess:
    return run_cmd([*torchrun_cmd(nproc), TRAIN, "--no-progress", *args], cwd, timeout, **env)


def python_train(args: list[str], cwd: Path, timeout: float = 240, gpus: bool = False,
                 **env: str) -> subprocess.CompletedProcess:
    return run_cmd([sys.executable, TRAIN, "--no-progress", *args], cwd, timeout, gpus, **env)


def write_store_file(path: Path, **keys: str) -> Path:
    """A FileStore file holding `keys`, as a run leaves it: records of a 4-byte little-endian
    length and that many bytes, key then value."""
    fields = [part.encode() for item in keys.items() for part in (f"/{item[0]}", item[1])]
    path.write_bytes(b"".join(len(f).to_bytes(4, "little") + f for f in fields))
    return path


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (f"exit {result.returncode}\nstdout:\n{result.stdout}\n"
                                    f"stderr:\n{result.stderr}")
    return result


# A line of ours starts with `error:`, or argparse's `PROG: error:`; a launcher may put the worker
# before it, in colour: `(TrainWorker pid=29166) error: ...`. A cluster's own log lines that carry
# "error:" inside (`... RpcError: RPC error: Socket closed`, as it shuts down) are not ours.
ERROR_LINE = re.compile(r"^(?:\x1b\[[0-9;]*m)*(?:\((?:\w+ )?pid=\w+(?:, ip=[^)]*)?\)"
                        r"(?:\x1b\[[0-9;]*m)*\s*)?(?:[\w./-]+: )?error:")


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    """The `error:` lines a failed run printed (of any rank or worker), in order."""
    return [line for line in (result.stdout + result.stderr).splitlines()
            if ERROR_LINE.match(line)]


def one_error(result: subprocess.CompletedProcess) -> str:
    """A run that failed with exactly one `error:` line and no traceback of ours: that line."""
    assert result.returncode != 0, f"expected a failure\n{result.stdout}\n{result.stderr}"
    errors = error_lines(result)
    assert len(errors) == 1, f"expected one error line, got {errors}\n{result.stderr}"
    package = "{{ cookiecutter.package_name }}"
    ours = [line for line in result.stderr.splitlines()
            if line.strip().startswith("File ") and f"/{package}/" in line]
    assert not ours, f"a traceback through the project's code:\n{result.stderr}"
    return errors[0]


def read_metrics(output_dir: Path, key: str = "loss") -> list[dict]:
    """The records of metrics.jsonl that carry `key`: training logs ("loss") or evaluations
    ("val_loss")."""
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if key in r]


def summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text())


def ckpt_name(step: int) -> str:
    """The name of step `step`'s checkpoint in this project's default layout."""
    from {{ cookiecutter.package_name }}.checkpoint.files import checkpoint_path
    from {{ cookiecutter.package_name }}.config import DEFAULT_MODEL_LAYOUT, SHARDED

    return checkpoint_path("", step, sharded=DEFAULT_MODEL_LAYOUT in SHARDED).name  # DCP: folders


def load_state(path: Path) -> dict:
    """Everything in a checkpoint, file or folder, as one dict of plain values and tensors."""
    from {{ cookiecutter.package_name }}.checkpoint.files import load_checkpoint, read_meta

    if not path.is_dir():
        return load_checkpoint(path)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = path.parent / f"{path.name}-whole.pt"
    dcp_to_torch_save(str(path), str(whole))
    state = torch.load(whole, map_location="cpu", weights_only=True)
    whole.unlink()
    return {**state, **read_meta(path)}


def final_model(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The model of the newest checkpoint (file or folder) in `checkpoint_dir`."""
    from {{ cookiecutter.package_name }}.checkpoint.export import export
    from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints, load_checkpoint

    newest = list_checkpoints(checkpoint_dir)[0]
    if newest.is_dir():
        export(newest, checkpoint_dir.parent / "exported.pt")
        newest = checkpoint_dir.parent / "exported.pt"
    return load_checkpoint(newest)["model"]


def kill_a_worker_once_saved(cmd: list[str], cwd: Path, checkpoint_dir: Path, step: int,
                             worker: int = 1, **env: str) -> None:
    """Start `cmd` (torchrun), SIGKILL its `worker`-th training process once a checkpoint of
    `step` or later is in `checkpoint_dir`, and wait for the job to end."""
    from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints, read_meta

    def saved_step(path: Path) -> int:
        try:
            return read_meta(path)["step"]
        except (FileNotFoundError, RuntimeError):  # (torch.load's mmap: a RuntimeError)
            if path.exists():
                raise
            return -1  # pruned by --keep-last between the listing and the read

    job = subprocess.Popen(cmd, cwd=cwd, env=child_env(**env), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    while not [p for p in list_checkpoints(checkpoint_dir) if saved_step(p) >= step]:
        assert job.poll() is None, job.communicate()[1]
        time.sleep(0.01)
    workers = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()
    os.kill(int(workers[worker]), signal.SIGKILL)
    job.communicate(timeout=120)


def workers(agent: int) -> dict[int, int]:
    """rank -> pid of the worker processes torchrun started."""
    found = {}
    for task in Path(f"/proc/{agent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(pid)
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...): torchrun's workers live in
    sessions of their own, out of reach of a signal to its process group."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += [int(child), *descendants(int(child))]
    except OSError:  # gone meanwhile
        pass
    return found


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str,
              make: Callable[[Path], object]) -> Path:
    """The folder `name` of this pytest session, which `make(folder)` filled once: xdist's workers
    share it (the first makes it, the other waits for it), so a module's run is not made twice
    when `-n 2 --dist worksteal` hands the module's tests to both workers."""
    base = tmp_path_factory.getbasetemp()  # a worker's is inside the session's
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    with FileLock(f"{folder}.lock"):
        if not folder.with_suffix(".made").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            folder.with_suffix(".made").touch()
    return folder


def project_copy(folder: Path, task: str | None = None) -> Path:
    """A copy of the project (train.py, the package, scripts/ and configs/) in `folder`/project,
    whose task.py is `task` if given (run it with PYTHONPATH set to the copy)."""
    root = folder / "project"
    root.mkdir()
    shutil.copy(PROJECT_ROOT / "train.py", root)
    package = "{{ cookiecutter.package_name }}"
    for name in (package, "scripts", "configs"):
        if (PROJECT_ROOT / name).exists():
            shutil.copytree(PROJECT_ROOT / name, root / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
    if task is not None:
        (root / package / "task.py").write_text(task)
    return root


def import_file(path: Path, name: str) -> ModuleType:
    """A Python file that is not importable by its path (a script, a copy's task.py), imported
    as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_same_model(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(value, got[key]), f"{key} differs"


# fsdp's sharded checkpoints go through torch.distributed.checkpoint, which needs numpy.
needs_numpy = pytest.mark.skipif(importlib.util.find_spec("numpy") is None,
                                 reason="--model-layout fsdp needs numpy: pip install numpy")


# The tests that train run the example task: its built-in data, made small with --dataset-size and
# --hidden-size. With a task.py of your own they skip and say why; your task's own tests go in
# tests/test_task.py (the example's shows how), the project's own guarantees stay tested by
# test_custom_task.py, which trains a task of its own.
EXAMPLE_SETTINGS = ("dataset_size", "hidden_size")


@functools.cache
def why_not_the_example_task() -> str | None:
    """Why the training tests cannot run with this task.py (None when they can)."""
    from {{ cookiecutter.package_name }} import task
    from {{ cookiecutter.package_name }}.config import parse_args

    settings = getattr(task, "Settings", None)
    declared = {f.name for f in dataclasses.fields(settings)} if settings else set()
    missing = [f"--{name.replace('_', '-')}" for name in EXAMPLE_SETTINGS if name not in declared]
    if missing:
        return f"task.py declares no {' or '.join(missing)}"
    try:
        task.build_datasets(parse_args(["--dataset-size", "64"], settings))
    except (Exception, SystemExit) as exc:
        return f"task.py has no data without --data ({type(exc).__name__}: {exc})".splitlines()[0]
    return None


def skip_unless_example_task() -> None:
    why = why_not_the_example_task()
    if why:
        pytest.skip(f"uses the example task; {why}")


@pytest.fixture
def example_task() -> None:
    """For a test that uses the example task's settings or data (skips with your own task.py)."""
    skip_unless_example_task()


@pytest.fixture
def workdir(tmp_path: Path, example_task: None) -> Path:
    """A folder to train the example task in (skips with your own task.py: see above)."""
    return tmp_path


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A folder for PATH with `python` and `torchrun` of this interpreter, as the scripts expect.

    Small scripts that exec this interpreter, not symlinks: a symlink to a virtualenv's python
    makes Python lose the virtualenv (and its packages) when started through it."""
    folder = tmp_path / "bin"
    folder.mkdir()
    write_script(folder / "python", f'exec "{sys.executable}" "$@"')
    write_script(folder / "torchrun", f'exec "{sys.executable}" -m torch.distributed.run "$@"')
    return folder


def write_script(path: Path, body: str) -> Path:
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)
    return path


def path_with(folder: Path) -> str:
    return f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.fixture
def hosts():
    """Two test hosts on a LAN of their own (tests/hosts.py), removed afterwards with every
    process on them; skips where network namespaces cannot be made (not root, no `ip`)."""
    from hosts import TestHosts, available

    why = available()
    if why:
        pytest.skip(why)
    with TestHosts(2) as made:
        yield made
