"""Every task x model_layout a user can answer trains: each pair is baked and its README's
quickstart runs as written, for one short epoch (the system Python's torch, the bake's own folder
on the path). The template's other tests check that a pairwise set of answers bakes and passes its
own tests; this one checks that no valid answer bakes a project whose first command fails."""

from __future__ import annotations

import json
import os

import pytest
from conftest import CHOICES, PYTHON, answers_id, check_ok, is_valid, run
from test_generated_runs import bake_to, quickstart

PAIRS = [{"task": task, "model_layout": layout}
         for task in CHOICES["task"] for layout in CHOICES["model_layout"]]
# One short epoch: the synthetic data set of every task is small with --dataset-size.
SHORT = "--epochs 1 --dataset-size 128 --no-progress"


@pytest.mark.parametrize("answers", PAIRS, ids=answers_id)
def test_the_quickstart_of_every_task_and_layout_trains(tmp_path, answers):
    assert is_valid(answers), f"{answers}: a pair a user can answer, which the hook refuses"
    project = bake_to(tmp_path, **answers)
    lines = quickstart((project / "README.md").read_text())
    train = next(line for line in lines if line.startswith("scripts/train_local.sh"))
    command = train.replace("--epochs 3", SHORT)
    assert command != train, f"the quickstart's command changed: {train}"
    result = run(["bash", "-c", command], project, timeout=300, PYTHON=PYTHON,
                 PYTHONPATH=f"{project}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    check_ok(result)
    summary = json.loads((project / "runs/latest/summary.json").read_text())
    assert summary["model_layout"] == answers["model_layout"], summary
    assert summary["epochs_completed"] == 1 and summary["world_size"] == 2, summary
