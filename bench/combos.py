"""The answers that change a run, pairwise: each combination baked, installed, trained and tested.

    make combos                                  # = python bench/combos.py
    python bench/combos.py --list                # the combinations only, nothing baked
    python bench/combos.py --only 3 --keep --workdir /tmp/combos

A greedy pairwise covering array over the answers that change what a run does (COMBO_ANSWERS):
every value of each meets every value of every other in at least one combination, and only
combinations the pre-generation hook accepts are made (tests/conftest.py's `is_valid`). For each:
bake it (no input), make a fresh venv (`python -m venv`), install the pinned torch first (--torch),
then the bake as its README's Quickstart says, train as the quickstart does with the epochs cut
short (SHORT), and run its `pytest -q`. A `launcher=ray` bake trains on a Ray cluster of its own,
started with its README's `ray start --head` line and ended by killing that cluster's processes
(`ray stop` would stop every cluster on the machine). A `fault_tolerance=torchft` bake also
trains as its README's torchft section says: a lighthouse and two replica groups.

One row per combination: its answers, trained, pytest's passed / failed / skipped, seconds and
date; printed, and written to bench/results/combos/ (combos.md, combos.json) after each one. Logs
stay in the work folder's logs/NN/; each venv and bake is removed after its row unless --keep.
Exit 0 when every combination trained (but backend=nccl without a GPU, refused as documented,
and a quickstart that needs the user's own files) and no test failed. Heavy: the defaults took
7 minutes on 2 cores, others more; run it alone.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the hook's refusals are stated once, in conftest.py
from conftest import ANSWERS, CHOICES, LAUNCHER_VARS, is_valid  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "combos"
# In cookiecutter.json's order: the answers that change what a run does (the rest name things).
COMBO_ANSWERS = ("launcher", "backend", "init_method", "task", "model_layout", "windows_support",
                 "slurm", "tracker", "fault_tolerance", "kubernetes", "github_actions")
# One short epoch: every task's synthetic data set is small with --dataset-size.
SHORT = "--epochs 1 --dataset-size 128 --no-progress"
# A user's shell, not this one's: launcher variables would change the run, and PYTHON would make
# scripts/train_local.sh use another Python than the venv's.
DROPPED = {*LAUNCHER_VARS, "PYTHON", "PYTHONPATH", "VIRTUAL_ENV", "RAY_ADDRESS",
           "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID"}
# backend=nccl on a machine without CUDA GPUs: the run's documented refusal, not a failure.
NO_GPU = "backend nccl needs CUDA GPUs and none are visible"
# A quickstart that trains on the user's own files (task=hf_causal_lm: --model path/to/model):
# nothing here to train on, so it is not run, and that is not a failure.
PLACEHOLDER = "path/to/"
NOT_RUN = "not run: the quickstart trains on files of your own (path/to/...)"
INSTALL_S, TRAIN_S, PYTEST_S = 900, 600, 1800


def defaults() -> dict:
    """cookiecutter.json's answers: a choice's first value, a yes/no's own."""
    return {name: value[0] if isinstance(value, list) else value
            for name, value in ANSWERS.items()}


def combinations() -> list[dict]:
    """Valid combinations in which every pair of values of COMBO_ANSWERS appears; greedy, as
    tests/conftest.py's pairwise_combinations, from the defaults a plain bake gets."""
    # Each answer's default first, so that combination 1 is `cookiecutter --no-input` (CHOICES
    # puts False first, and slurm and github_actions default to True).
    default = defaults()
    values = [sorted(CHOICES[name], key=lambda v, d=default[name]: v != d)
              for name in COMBO_ANSWERS]
    candidates = [dict(zip(COMBO_ANSWERS, combo, strict=True))
                  for combo in itertools.product(*values)]
    candidates = [c for c in candidates if is_valid(c)]
    bits: dict[tuple, int] = {}

    def pairs(combo: dict) -> int:
        # A bit per pair of values: 50,000 candidates x 55 pairs each, counted fast as an int.
        mask = 0
        for a, b in itertools.combinations(COMBO_ANSWERS, 2):
            mask |= 1 << bits.setdefault(((a, combo[a]), (b, combo[b])), len(bits))
        return mask

    masks = [pairs(c) for c in candidates]
    uncovered = 0
    for mask in masks:
        uncovered |= mask
    chosen = [candidates[0]]
    uncovered &= ~masks[0]
    while uncovered:
        best = max(range(len(candidates)), key=lambda i: (masks[i] & uncovered).bit_count())
        chosen.append(candidates[best])
        uncovered &= ~masks[best]
    return chosen


def label(answers: dict) -> str:
    """The answers that differ from the defaults, e.g. `launcher=ray tracker=wandb`."""
    default = defaults()
    changed = [f"{name}={value}" for name, value in answers.items() if value != default[name]]
    return " ".join(changed) or "defaults"


@dataclass
class Quickstart:
    """The lines of a bake's README Quickstart: install, ray start, train and test."""

    install: str
    ray_start: list[str]
    train: list[str]
    pytest: str


def bash_blocks(text: str) -> list[list[str]]:
    """Each ```bash block of `text`, its lines without their comments."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [[line.split("#")[0].strip() for line in block.strip().splitlines()] for block in blocks]


def quickstart(readme: str) -> Quickstart:
    """The Quickstart section's commands. A ray bake's first block is Ray's, with its own
    install, cluster and training; the block after it (without Ray) gives the tests' line."""
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = bash_blocks(section)
    first = blocks[0]
    return Quickstart(install=first[0],
                      ray_start=[line for line in first if line.startswith("ray start")],
                      train=[line for line in first if "--epochs" in line],
                      pytest=next(line for block in blocks for line in block
                                  if line.startswith("pytest")))


def shorten(line: str) -> str:
    """The training line with one short epoch instead of the README's."""
    short = re.sub(r"--epochs \d+", SHORT, line)
    if short == line:
        raise ValueError(f"no --epochs in the README's training line: {line}")
    return short


def venv_env(venv: Path) -> dict[str, str]:
    """What `source venv/bin/activate` gives a user's shell; W&B offline, as without a login."""
    env = {key: value for key, value in os.environ.items() if key not in DROPPED}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
               PYTHONNOUSERSITE="1", WANDB_MODE="offline")
    return env


def start(cmd: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """`cmd` in bash, in a session of its own (to be killed whole), its output appended to `log`."""
    with open(log, "a") as out:
        out.write(f"$ {cmd}\n")
        out.flush()
        return subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def finish(job: subprocess.Popen, timeout: float, log: Path) -> int:
    """The exit status of `job`; 124 when it ran past `timeout`, its process group killed."""
    try:
        return job.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        with open(log, "a") as out:
            out.write(f"killed after {timeout:.0f} s\n")
        return 124


def run(cmd: str, cwd: Path, env: dict[str, str], log: Path, timeout: float) -> int:
    """`cmd` in bash to its end, or killed past `timeout`; its exit status."""
    return finish(start(cmd, cwd, env, log), timeout, log)


def free_port() -> int:
    """A port free on loopback now: fixed ones may be held by another run on this machine."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def processes(match: str) -> list[int]:
    """This user's processes whose command line, working folder or open files name `match`:
    the ones a combination started (torchrun's workers and Ray's agents leave their session)."""
    def ours(pid: str) -> bool:
        try:
            if match.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
            if os.readlink(f"/proc/{pid}/cwd").startswith(match):
                return True
            return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(match)
                       for fd in os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            return False  # gone meanwhile, or not ours to read

    return [int(pid) for pid in os.listdir("/proc")
            if pid.isdigit() and int(pid) != os.getpid() and ours(pid)]


def kill(pids: list[int]) -> None:
    """SIGKILL each of `pids`, those already gone aside."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def ray_cluster(line: str, project: Path, env: dict[str, str], log: Path) -> Iterator[dict]:
    """The README's `ray start --head` line on a free port and a folder of its own (another
    cluster may run here), yielding the variables that reach it; ended by killing exactly its
    processes."""
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must be short
    port = free_port()
    try:
        code = run(f"{line} --port {port} --temp-dir {temp} --disable-usage-stats "
                   "--include-dashboard=false", project, env, log, 180)
        yield {"RAY_ADDRESS": f"127.0.0.1:{port}"} if code == 0 else {}
    finally:
        kill(processes(temp))
        shutil.rmtree(temp, ignore_errors=True)


def train(project: Path, quick: Quickstart, env: dict[str, str], log: Path) -> bool:
    """The quickstart's training lines, one short epoch each; a Ray bake's on its own cluster."""
    with contextlib.ExitStack() as stack:
        for line in quick.ray_start:
            reach = stack.enter_context(ray_cluster(line, project, env, log))
            if not reach:
                return False
            env = {**env, **reach}
        return all(run(shorten(line), project, env, log, TRAIN_S) == 0 for line in quick.train)


def train_torchft(project: Path, env: dict[str, str], log: Path) -> bool:
    """The README's torchft block: its install, the lighthouse (the line ending in `&`, on a
    free port: another may hold 29510) and every replica group at once, one short epoch each."""
    block = next(b for b in bash_blocks((project / "README.md").read_text())
                 if any("train_ft.sh lighthouse" in line for line in b))
    port = free_port()
    env = {**env, "LIGHTHOUSE_PORT": str(port), "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
    background, groups = [], []
    for line in filter(None, block):
        if line.startswith("pip "):
            if run(line, project, env, log, INSTALL_S):
                return False
        elif line.endswith("&"):
            background.append(start(line.rstrip("&").strip(), project, env, log))
        else:
            groups.append(start(shorten(line), project, env, log))
    try:
        deadline = time.monotonic() + TRAIN_S
        codes = [finish(job, max(1.0, deadline - time.monotonic()), log) for job in groups]
    finally:
        for job in background:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return bool(groups) and not any(codes)


def pytest_counts(log: Path) -> tuple[int, int, int]:
    """Passed, failed plus errors, and skipped, from pytest's last summary line in `log`."""
    summary = [line for line in log.read_text(errors="replace").splitlines()
               if re.search(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", line)]
    found = {kind: int(n) for n, kind in
             re.findall(r"(\d+) (passed|failed|skipped|error)", summary[-1] if summary else "")}
    return (found.get("passed", 0), found.get("failed", 0) + found.get("error", 0),
            found.get("skipped", 0))


def last_error(log: Path) -> str:
    """The last `error:` line of `log`, where a run that stops on a mistake says why."""
    errors = [line.strip() for line in log.read_text(errors="replace").splitlines()
              if "error:" in line.lower()]
    return errors[-1][:160] if errors else ""


def install(project: Path, quick: Quickstart, venv: Path, torch: str, log: Path) -> bool:
    """A fresh venv, the pinned torch first (nothing may pull another), then the README's line."""
    if subprocess.run([sys.executable, "-m", "venv", str(venv)], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL).returncode:
        return False
    env = venv_env(venv)
    return (run(f"python -m pip install -q '{torch}'", project, env, log, INSTALL_S) == 0
            and run(quick.install, project, env, log, INSTALL_S) == 0)


def bake(answers: dict, folder: Path, log: Path) -> Path:
    """The project baked with `answers` and no prompts, in `folder`; cookiecutter's and the
    hook's lines go to `log`."""
    given = [f"{name}={str(value).lower() if isinstance(value, bool) else value}"
             for name, value in answers.items()]
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-m", "cookiecutter", "--no-input", "-o", str(folder),
                        str(ROOT), *given], stdout=out, stderr=subprocess.STDOUT, check=True)
    return folder / "ddp-project"


def steps(answers: dict, folder: Path, logs: Path, torch: str, row: dict) -> None:
    """Bake, install, train and test one combination, filling in its `row`."""
    project = bake(answers, folder, logs / "bake.txt")
    quick = quickstart((project / "README.md").read_text())
    venv, env = folder / "venv", venv_env(folder / "venv")
    if not install(project, quick, venv, torch, logs / "install.txt"):
        row["note"] = f"install failed ({logs / 'install.txt'})"
        return
    if any(PLACEHOLDER in line for line in quick.train):
        row["note"] = NOT_RUN
    else:
        trained = train(project, quick, env, logs / "train.txt")
        if trained and answers["fault_tolerance"] == "torchft":
            trained = train_torchft(project, env, logs / "train.txt")
        row["trained"] = "yes" if trained else "no"
        row["note"] = "" if trained else last_error(logs / "train.txt")
    code = run(quick.pytest, project, env, logs / "pytest.txt", PYTEST_S)
    passed, failed, skipped = pytest_counts(logs / "pytest.txt")
    row.update(passed=passed, failed=failed or int(code != 0), skipped=skipped)


def check(number: int, answers: dict, work: Path, torch: str, keep: bool) -> dict:
    """One combination's row; its leftover processes killed, its bake and venv removed."""
    started, folder, logs = time.monotonic(), work / f"{number:02d}", work / f"logs/{number:02d}"
    logs.mkdir(parents=True, exist_ok=True)
    row = {"number": number, "answers": answers, "label": label(answers), "trained": "no",
           "passed": 0, "failed": 0, "skipped": 0, "note": "", "logs": str(logs)}
    try:
        steps(answers, folder, logs, torch, row)
    except Exception as exc:  # a bake or README this script cannot read: the next one still runs
        row["note"] = f"{type(exc).__name__}: {exc}"[:160]
    finally:
        kill(processes(f"{folder}{os.sep}"))  # what a killed or failed step left behind
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)  # a venv with torch is over 1 GB
    row.update(seconds=round(time.monotonic() - started),
               date=datetime.now().strftime("%Y-%m-%d %H:%M"))
    return row


def ok(row: dict) -> bool:
    """Trained (or refused nccl without a GPU, as documented, or had nothing to train on) and
    no test failed."""
    excused = NO_GPU in row["note"] or row["note"] == NOT_RUN
    return (row["trained"] == "yes" or excused) and not row["failed"]


def table(rows: list[dict]) -> list[str]:
    """The rows as a markdown table, its header first."""
    lines = ["| # | answers | trained | passed | failed | skipped | seconds | date | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = r["note"].replace("|", "/")
        lines.append(f"| {r['number']} | {r['label']} | {r['trained']} | {r['passed']} | "
                     f"{r['failed']} | {r['skipped']} | {r['seconds']} | {r['date']} | {note} |")
    return lines


def write(rows: list[dict], torch: str) -> None:
    """combos.md and combos.json, rewritten after each row: a stopped run keeps what it did."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    head = [f"# make combos ({torch}, {os.cpu_count()} CPUs)", "",
            "Pairwise combinations of the answers that change a run, each baked, installed into a "
            "fresh venv, its quickstart trained for one short epoch and its `pytest -q` run "
            "(bench/combos.py).", ""]
    (RESULTS / "combos.md").write_text("\n".join(head + table(rows)) + "\n")
    (RESULTS / "combos.json").write_text(json.dumps({"torch": torch, "rows": rows}, indent=1)
                                         + "\n")


def main() -> int:
    """List, or run, the combinations; exit 1 when one did not train or a test failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, metavar="N", help="run the first N combinations")
    parser.add_argument("--list", action="store_true", help="print the combinations and exit")
    parser.add_argument("--keep", action="store_true", help="keep each bake and its venv")
    parser.add_argument("--workdir", type=Path, help="where bakes, venvs and logs go "
                        "(default: a new temporary folder)")
    parser.add_argument("--torch", default="torch==2.13.0", help="installed first in every venv")
    args = parser.parse_args()
    combos = combinations()[:args.only]
    if args.list:
        for number, answers in enumerate(combos, 1):
            print(f"{number:2d}  {label(answers)}")
        print(f"{len(combos)} combinations over {', '.join(COMBO_ANSWERS)}")
        return 0
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="combos-"))).resolve()
    print(f"{len(combos)} combinations; work folder {work}", flush=True)
    rows = []
    for number, answers in enumerate(combos, 1):
        rows.append(check(number, answers, work, args.torch, args.keep))
        write(rows, args.torch)
        print(table(rows)[-1], flush=True)
    print("\n".join(["", *table(rows), "", f"results: {RESULTS}; logs: {work / 'logs'}"]))
    return int(not all(ok(row) for row in rows))


if __name__ == "__main__":
    sys.exit(main())
