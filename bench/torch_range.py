"""The torch range check: the default project on each torch it is said to support, on a CPU.

    make torch-range TORCH="2.6.0 2.14.1"        # = python bench/torch_range.py 2.6.0 2.14.1
    python bench/torch_range.py                  # every release of RANGE

For each release: its wheels are downloaded once into the cache (--cache, ~/.cache/torch-range;
a CUDA build with its nvidia packages is 2.5-4 GB, and runs on the CPU all the same), the default
project is baked and installed as a user does into a fresh venv (`pip install torch==X` from the
cache first, then `pip install -e ".[dev]"`), and must keep that torch. Then:
- every extra of every bake (`.[s3,shards,ray,ft]` and each tracker's dependency), resolved by
  `pip install --dry-run` into that venv, must leave torch as it is (torchft 0.2 itself requires
  torch>=2.7: on 2.6 the line says so instead);
- the README's quickstart (`scripts/train_local.sh --epochs 3`) must train;
- `pytest -q`; and on the floor, a middle release and the newest (FULL), `pytest -q --full`
  of the files that run every place where the code relies on a private torch API
  (runtime/torch_private.py), fsdp and HSDP among them, on 2 workers, and the tensor_parallel
  bake's own tests (TP_BAKE: 2 x 2 runs from 2.9; before, its one error line).
One line per release: version, passed, failed (failed tests and errors), seconds; logs stay in the
cache's work/<version>/ folder; each venv is removed after its release (5-7 GB each). Exit 0
when nothing failed. Heavy: each release takes 4-15
minutes of both CPU cores; run it alone.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The newest patch of each minor release PyPI serves, from the declared floor on.
RANGE = ["2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1"]
# The --full seams on the floor, the first release whose fsdp runs on a CPU, and the newest.
FULL = ["2.6.0", "2.9.1", "2.14.1"]
SEAMS = ["tests/test_custom_step.py", "tests/test_shards.py", "tests/test_hsdp.py",
         "tests/test_layouts.py", "tests/test_mistakes.py", "tests/test_torch_private.py"]
# Bakes whose extras and dependencies, together, are every one a project can ask for.
EXTRAS = {"task=language_model launcher=ray tracker=wandb": "dev,s3,shards,ray",
          "fault_tolerance=torchft tracker=tensorboard": "dev,ft", "tracker=mlflow": "dev"}
TP_BAKE = "task=language_model model_layout=tensor_parallel"
TORCHFT_FLOOR = (2, 7)  # torchft 0.2.0's own Requires-Dist: torch>=2.7


def run(cmd: list[str], cwd: Path, log: Path) -> int:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        return subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode


def wheels(cache: Path, version: str) -> Path:
    """The folder holding torch `version` and what it needs, downloaded the first time only."""
    folder = cache / "wheels" / version
    if not list(folder.glob(f"torch-{version}[-+]*.whl")):
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--dest", str(folder),
                        f"torch=={version}"], check=True)
    return folder


def counts(log: Path) -> tuple[int, int]:
    """Passed, and failed plus errors, from pytest's last summary line in `log`."""
    summary = [line for line in log.read_text(errors="replace").splitlines()
               if re.search(r"\d+ (passed|failed|errors?)\b.* in [\d.]+s", line)]
    found = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (passed|failed|error)",
                                                          summary[-1] if summary else ""))
    return found.get("passed", 0), found.get("failed", 0) + found.get("error", 0)


def bake(work: Path, answers: str) -> Path:
    out = work / "bakes" / re.sub(r"\W+", "-", answers or "default")
    subprocess.run([sys.executable, "-m", "cookiecutter", "--no-input", "-o", str(out), str(ROOT),
                    *answers.split()], check=True, stdout=subprocess.DEVNULL)
    return out / "ddp-project"


def extras_keep_torch(python: str, work: Path, version: str) -> list[str]:
    """Each bake's extras, resolved by `pip install --dry-run` into the venv as a user installs
    them: those that would install another torch, as problems."""
    problems, log, report = [], work / "extras.txt", work / "report.json"
    for answers, extras in EXTRAS.items():
        project = bake(work, answers)
        if run([python, "-m", "pip", "install", "-q", "--dry-run", "--report", str(report),
                f"{project}[{extras}]"], project, log):
            problems.append(f"{answers} [{extras}]: pip failed (see {log})")
            continue
        wanted = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                  for i in json.loads(report.read_text())["install"]}
        if "torch" in wanted:
            floor = ".".join(map(str, TORCHFT_FLOOR))
            known = "ft" in extras and tuple(map(int, version.split(".")[:2])) < TORCHFT_FLOOR
            problems.append(f"[{extras}] would install torch {wanted['torch']}"
                            + (f" (torchft 0.2 requires torch>={floor}: documented)" if known else ""))
    return problems


def check(version: str, cache: Path, full: bool) -> bool:
    """Bake, install and test with torch `version`; print its line; True when nothing failed."""
    started = time.monotonic()
    found = wheels(cache, version)
    work = cache / "work" / version
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    project, venv = bake(work, ""), work / "venv"
    python, install = str(venv / "bin" / "python"), work / "install.txt"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    try:
        return run_release(version, found, work, project, python, install, full, started)
    finally:  # a venv with a CUDA torch is 5-7 GB: nine of them fill a disk
        shutil.rmtree(venv, ignore_errors=True)


def run_release(version: str, found: Path, work: Path, project: Path, python: str,
                install: Path, full: bool, started: float) -> bool:
    """check()'s steps in the fresh venv: install, extras, quickstart, tests; print the line."""
    steps = [[python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(found),
              f"torch=={version}"], [python, "-m", "pip", "install", "-q", "-e", ".[dev]"],
             [python, "-c", f"import torch; assert torch.__version__.split('+')[0] == '{version}'"]]
    if any(run(step, project, install) for step in steps):
        print(f"torch {version}: not installed, or `pip install -e .[dev]` replaced it (see "
              f"{install})", flush=True)
        return False
    notes = extras_keep_torch(python, work, version)
    quick = run(["env", f"PYTHON={python}", "scripts/train_local.sh", "--epochs", "3",
                 "--no-progress"], project, work / "quickstart.txt")
    parts = [("quickstart", int(quick == 0), int(quick != 0))]
    runs = [("pytest -q", project, [])]
    if full:
        tp = bake(work, TP_BAKE)  # installed over the default project: its tests are done
        runs += [("--full seams", project, ["--full", "-n", "2", *SEAMS]),
                 ("tensor_parallel", tp, ["--full", "tests/test_tensor_parallel.py"])]
    for name, folder, args in runs:
        log = work / (re.sub(r"\W+", "-", name).strip("-") + ".txt")
        code = 0 if folder == project else run(  # the other bake, installed as a user does
            [python, "-m", "pip", "install", "-q", "-e", ".[dev]"], folder, log)
        code = code or run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                           folder, log)
        passed, failed = counts(log)
        parts.append((name, passed, failed or int(code != 0)))
    failed = sum(p[2] for p in parts) + sum("documented" not in n for n in notes)
    passed = sum(p[1] for p in parts)
    each = ", ".join(f"{name} {p}/{f}" for name, p, f in parts)
    print(f"torch {version}: {passed} passed, {failed} failed, {time.monotonic() - started:.0f} s "
          f"({each} passed/failed; extras: {'; '.join(notes) or 'torch kept'}; logs: {work})",
          flush=True)
    return failed == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", help="torch releases, e.g. 2.6.0 2.14.1 "
                        "(default: RANGE, every minor release from the floor)")
    parser.add_argument("--full-on", default="", help="releases that also run the --full seams, "
                        "comma-separated (default: FULL)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "torch-range")
    args = parser.parse_args()
    versions = [v.removeprefix("torch==") for v in args.versions] or RANGE
    full = args.full_on.split(",") if args.full_on else FULL
    results = [check(version, args.cache.resolve(), version in full) for version in versions]
    return int(not all(results))


if __name__ == "__main__":
    sys.exit(main())
