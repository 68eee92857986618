"""The GPU check: what a user runs on a GPU machine, on this machine's GPUs, in about eight minutes.

    make gpu-check                                    # = python bench/gpu_check.py
    python bench/gpu_check.py --wheels DIR            # no network: cookiecutter from a wheel folder

It bakes the default project, then runs, each part with a time limit of its own:
- the README's quickstart as written (`scripts/train_local.sh --epochs 3`: one process per GPU);
- the project's default tier (`pytest -q`) and its NCCL tests (`pytest --full tests/test_nccl.py`)
  side by side, with the GPUs visible;
- the GPU benchmark: the tiny workload (ours and raw, interleaved) and gpt2 (GPT-2 small, compiled).
Everything goes to --out (bench/results/gpu-check): a log per part and summary.md, which ends with
the benchmark's tables. Exit 0 when every part passed. It needs torch with CUDA, pytest and (or
--wheels) cookiecutter; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


class Check:
    """The parts run so far, their logs, and the time left."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.deadline = out, time.monotonic() + budget_s
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.rows: list[str] = []
        self.failed = False

    def start(self, name: str, cmd: list[str], cwd: Path, **env: str) -> tuple:
        log = open(self.logs / f"{name}.txt", "w")  # noqa: SIM115 (closed by finish)
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env={**self.env, **env}, stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        return name, proc, log, time.monotonic()

    def finish(self, started: tuple, limit_s: float, judge=None) -> str:
        """Wait for a part (at most `limit_s` and the time left), then record its outcome."""
        name, proc, log, t0 = started
        try:
            proc.wait(timeout=max(1.0, min(limit_s, self.deadline - time.monotonic())))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = "timed out"
        log.close()
        text = (self.logs / f"{name}.txt").read_text(errors="replace")
        verdict = judge(text) if judge and code == 0 else None
        ok = code == 0 and verdict is None
        self.failed |= not ok
        last = verdict or next((line for line in reversed(text.splitlines()) if line.strip()), "")
        outcome = "ok" if ok else "FAILED" if code == 0 else f"FAILED ({code})"
        self.rows.append(f"| {name} | {outcome} | "
                         f"{time.monotonic() - t0:.0f} | {last.strip()[:160]} |")
        print(self.rows[-1], flush=True)
        return text

    def run(self, name: str, cmd: list[str], cwd: Path, limit_s: float, judge=None, **env) -> str:
        if time.monotonic() > self.deadline - 10:
            self.rows.append(f"| {name} | not run: out of time | 0 | |")
            self.failed = True
            return ""
        return self.finish(self.start(name, cmd, cwd, **env), limit_s, judge)


def machine() -> str:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    smi = shutil.which("nvidia-smi")
    driver = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.split("\n")[0] if smi else "?"
    return (f"{datetime.date.today()}: {len(gpus)} x {', '.join(sorted(set(gpus))) or 'no GPU'}, "
            f"driver {driver}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"Python {platform.python_version()}, {os.cpu_count()} CPUs")


def cookiecutter_from(wheels: Path | None, site: Path, env: dict) -> str | None:
    """Make cookiecutter importable (from `wheels` when it is not installed); why not, or None."""
    if subprocess.run([sys.executable, "-c", "import cookiecutter"], env=env).returncode == 0:
        return None
    if wheels is None:
        return "cookiecutter is not installed: pip install cookiecutter, or give --wheels DIR"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", str(site), *map(str, wheels.glob("*.whl"))],
                   check=True)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return None


def judge_quickstart(project: Path, gpus: int):
    def judge(_: str) -> str | None:
        import json

        try:
            done = json.loads((project / "runs/latest/summary.json").read_text())
        except (OSError, ValueError) as exc:
            return f"no summary.json: {exc}"
        if (done["world_size"], done["backend"]) != (gpus, "nccl"):
            return f"trained with {done['world_size']} process(es) over {done['backend']}"
        return None
    return judge


def tables(text: str) -> str:
    """The benchmark's tables from its output."""
    return "\n".join(line for line in text.splitlines() if line.startswith(("|", "machine:")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gpu-check")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="a folder of wheels to install cookiecutter from (no network)")
    parser.add_argument("--budget-s", type=float, default=470, help="the whole check's time")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("error: the GPU check needs a CUDA GPU and this machine has none", file=sys.stderr)
        return 2
    shutil.rmtree(args.out, ignore_errors=True)
    check = Check(args.out, args.budget_s)
    about = machine()
    print(about, flush=True)
    if why := cookiecutter_from(args.wheels, args.out / "site", check.env):
        print(f"error: {why}", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    check.run("bake", [sys.executable, "-m", "cookiecutter", "--no-input", "-o",
                       str(args.out / "bake"), str(ROOT)], ROOT, 60)
    project = args.out / "bake" / "ddp-project"
    # The project as `pip install -e .` would make it importable (pip may not reach an index).
    project_env = {"PYTHON": sys.executable, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(project), check.env.get("PYTHONPATH")]))}
    check.run("quickstart", ["bash", "scripts/train_local.sh", "--epochs", "3", "--no-progress"],
              project, 120, judge_quickstart(project, gpus), **project_env)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
    default = check.start("default-tier", pytest, project, **project_env)
    nccl = check.start("nccl-tests", [*pytest, "--full", "tests/test_nccl.py"], project,
                       **project_env)
    for started in (default, nccl):
        check.finish(started, 250)
    bench = [sys.executable, str(HERE / "run.py"), "--gpu", "--no-lightning", "--pairs", "0"]
    tiny = check.run("bench-tiny", [*bench, "--workloads", "tiny", "--variants", "ours,raw",
                                    "--reps", "3", "--out", str(args.out / "bench-tiny")], ROOT, 120)
    gpt2 = check.run("bench-gpt2", [*bench, "--workloads", "gpt2", "--reps", "1",
                                    "--out", str(args.out / "bench-gpt2")], ROOT, 240)
    summary = "\n".join([
        f"# GPU check\n\n{about}\n", "| part | outcome | s | last line |", "|---|---|---|---|",
        *check.rows, "", "## Benchmark: tiny", tables(tiny), "## Benchmark: gpt2", tables(gpt2)])
    (args.out / "summary.md").write_text(summary + "\n")
    print(f"\n{summary}\nlogs: {check.logs}", flush=True)
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
