"""Baked projects run for real: their own test suites, and the README quickstart as written."""

from __future__ import annotations

import json
import re
import sys
import venv

import pytest
from conftest import PYTHON, check_ok, run

SUITES = {
    "defaults": {},
    "spawn-file-split": {"launcher": "spawn", "init_method": "file", "model_layout": "model_parallel_2",
                         "slurm": False, "github_actions": False},
    "launch-tcp-tensorboard-windows": {"launcher": "launch", "backend": "gloo", "init_method": "tcp",
                                       "tracker": "tensorboard", "windows_support": True},
}


@pytest.mark.parametrize("answers", SUITES.values(), ids=SUITES.keys())
def test_baked_project_passes_its_own_tests(bake, answers):
    if answers.get("tracker") == "tensorboard":
        pytest.importorskip("tensorboard")
    project = bake(**answers)
    # The launcher, recovery and feature tests do not depend on the answers: the default bake runs them.
    select = [] if not answers else ["-m", "not launchers and not recovery and not features"]
    result = check_ok(run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *select], project))
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary and "error" not in summary
    assert re.search(r"\b3 skipped", summary), "only the NCCL tests may skip on a CPU machine"
    if answers.get("tracker") == "tensorboard":
        check_ok(run([PYTHON, "train.py", "--epochs", "1", "--no-progress"], project))
        assert list((project / "runs/latest/tensorboard").glob("events.out.tfevents.*"))


def _quickstart_lines(readme: str) -> list[str]:
    block = readme.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#")[0].strip() for line in block.strip().splitlines()]


def test_readme_quickstart_works_as_written(bake, tmp_path):
    project = bake()
    lines = _quickstart_lines((project / "README.md").read_text())
    assert lines[0].startswith("pip install -e") and lines[1].startswith("torchrun --standalone --nproc-per-node=2")
    # A fresh environment that sees the installed torch, so `pip install -e .` resolves torch>=2.4 offline.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    bin_dir = env_dir / ("Scripts" if sys.platform == "win32" else "bin")
    path = f"{bin_dir}:{run(['bash', '-c', 'echo $PATH'], project).stdout.strip()}"
    for line in lines:
        if line.startswith("pytest"):
            continue  # the project's own suite runs in test_baked_project_passes_its_own_tests
        if line.startswith("torchrun"):
            line = line + " --no-progress"
        check_ok(run(["bash", "-c", line], project, PATH=path, VIRTUAL_ENV=str(env_dir)))

    check_ok(run([str(bin_dir / "python"), "-c", "import ddp_project.trainer"], tmp_path))  # installed, not just on cwd
    records = [json.loads(line) for line in (project / "runs/latest/metrics.jsonl").read_text().splitlines()]
    metrics = [r for r in records if "loss" in r]  # training logs; evaluations carry val_loss
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]
    summary = json.loads((project / "runs/latest/summary.json").read_text())
    assert summary["epochs_completed"] == 3 and summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert len(list((project / "checkpoints").glob("ckpt_step*.pt"))) == 3
