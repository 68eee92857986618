"""The torch range check: the default project's tests on each torch it is said to support, on a CPU.

    make torch-range TORCH="2.13.0 2.14.1"        # = python bench/torch_range.py 2.13.0 2.14.1
    python bench/torch_range.py                   # the releases the baked workflow's matrix names

For each release: its wheels are downloaded once into the cache (--cache, ~/.cache/torch-range;
a CUDA build with its nvidia packages is 2.5-3 GB, and runs on the CPU all the same), the default
project is baked, installed as a user does into a fresh venv (`pip install torch==X` from the
cache first, then `pip install -e ".[dev]"`), and its tests run: `pytest -q`, then
`pytest -q --full` of the files that run every place where the code relies on a private torch API
(runtime/torch_private.py), on 2 workers when pytest-xdist is in the dev extra. One line per
release: version, passed, failed (failed tests and errors), seconds. Logs stay in the cache's
work/<version>/ folder. Exit 0 when nothing failed. Heavy: each release takes 10-20 minutes of
both CPU cores; run it alone.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEAMS = ["tests/test_custom_step.py", "tests/test_shards.py", "tests/test_hsdp.py",
         "tests/test_layouts.py", "tests/test_mistakes.py"]


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


def check(version: str, cache: Path) -> bool:
    """Bake, install and test with torch `version`; print its line; True when nothing failed."""
    started = time.monotonic()
    found = wheels(cache, version)
    work = cache / "work" / version
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "cookiecutter", "--no-input", "-o", str(work),
                    str(ROOT)], check=True, stdout=subprocess.DEVNULL)
    project, venv = work / "ddp-project", work / "venv"
    python, install = str(venv / "bin" / "python"), work / "install.txt"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    steps = [[python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(found),
              f"torch=={version}"], [python, "-m", "pip", "install", "-q", "-e", ".[dev]"],
             [python, "-c", f"import torch; assert torch.__version__.startswith('{version}')"]]
    if any(run(step, project, install) for step in steps):
        print(f"torch {version}: not installed (see {install})", flush=True)
        return False
    workers = ["-n", "2"] if "pytest-xdist" in (project / "pyproject.toml").read_text() else []
    parts = []
    for name, args in (("pytest -q", []), ("--full seams", ["--full", *workers, *SEAMS])):
        log = work / ("fast.txt" if name == "pytest -q" else "full-seams.txt")
        code = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], project, log)
        passed, failed = counts(log)
        parts.append((name, passed, failed or int(code != 0)))
    passed, failed = sum(p[1] for p in parts), sum(p[2] for p in parts)
    each = ", ".join(f"{name} {p}/{f}" for name, p, f in parts)
    print(f"torch {version}: {passed} passed, {failed} failed, {time.monotonic() - started:.0f} s "
          f"({each} passed/failed; logs: {work})", flush=True)
    return failed == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", help="torch releases, e.g. 2.13.0 2.14.1 "
                        "(default: those of the baked project's workflow matrix)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "torch-range")
    args = parser.parse_args()
    versions = [v.removeprefix("torch==") for v in args.versions] or sorted(set(re.findall(
        r'torch: "([\d.]+)"', (ROOT / "{{cookiecutter.project_slug}}/.github/workflows/ci.yml")
        .read_text())))
    results = [check(version, args.cache.resolve()) for version in versions]
    return int(not all(results))


if __name__ == "__main__":
    sys.exit(main())
