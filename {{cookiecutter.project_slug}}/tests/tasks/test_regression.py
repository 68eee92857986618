"""Tests of the example task in task.py: an MLP regressing one number from 20 features.

They check this example learns and that its file format works. When you replace task.py with your
own task, replace these with tests of yours; every other test of the project keeps working.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from conftest import PROJECT_ROOT, ok, one_error, python_train, read_metrics, run_cmd, torchrun

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.config import parse_args


def doc_inputs(root: Path) -> list[str]:
    """What scripts/predict.py's INPUT is in the docs (tests/test_doc_commands.py): rows."""
    return [",".join(["0.5"] * task.IN_FEATURES), ",".join(["-1"] * task.IN_FEATURES)]


def test_learns_far_better_than_predicting_the_mean(workdir):
    ok(torchrun(["--dataset-size", "1024", "--batch-size", "16", "--epochs", "3"], workdir))
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert losses[-1] < 0.5 * losses[0], "the training loss did not fall"
    _, val = task.build_datasets(parse_args(["--dataset-size", "1024"], task.Settings))
    chance = val.tensors[1].var().item()  # the mean squared error of always predicting the mean
    final = read_metrics(workdir / "runs/latest", "val_loss")[-1]
    assert final["val_loss"] < 0.3 * chance and final["val_mae"] > 0


def write_csv(path, rows: int, columns: int = task.IN_FEATURES + 1) -> None:
    data = task.synthetic_regression(rows, seed=5)
    lines = [",".join(f"{v:.6f}" for v in [*x.tolist(), *y.tolist()][:columns])
             for x, y in zip(*data.tensors, strict=True)]
    path.write_text("\n".join(lines) + "\n")


def test_csv_rows_are_read_one_at_a_time_by_worker_processes(workdir):
    write_csv(workdir / "train.csv", 600)
    ok(torchrun(["--data", "train.csv", "--num-workers", "2", "--epochs", "3", "--batch-size",
                 "16"], workdir))
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert losses[-1] < 0.7 * losses[0]
    assert read_metrics(workdir / "runs/latest", "val_loss")[-1]["epoch"] == 2
    rows = task.CsvRows(workdir / "train.csv")
    x, y = rows[3]
    assert x.shape == (task.IN_FEATURES,) and y.shape == (1,)
    assert torch.allclose(x, task.synthetic_regression(600, seed=5).tensors[0][3], atol=1e-5)


def test_csv_with_the_wrong_number_of_columns_is_one_error_line(workdir):
    write_csv(workdir / "bad.csv", 50, columns=7)
    result = torchrun(["--data", "bad.csv", "--epochs", "1"], workdir)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert "line 1 has 7 columns; this model reads 20 features and a target" in errors[0]


def test_predict_prints_one_estimate_per_row(workdir):
    ok(python_train(["--epochs", "1", "--dataset-size", "64", "--hidden-size", "8"], workdir))
    newest = max((workdir / "checkpoints").glob("ckpt_step*"))  # a file, or a folder (fsdp)
    predict = [sys.executable, str(PROJECT_ROOT / "scripts/predict.py"), str(newest)]
    row = ",".join(["0.5"] * task.IN_FEATURES)
    result = ok(run_cmd([*predict, row, row.replace("0.5", "-1")], workdir))
    assert [float(v) for v in result.stdout.split()] and len(result.stdout.split()) == 2
    # An export (one weights_only file with the model and its settings) predicts the same.
    ok(run_cmd([sys.executable, "-m", "{{ cookiecutter.package_name }}.checkpoint", "export",
                str(newest), "model.pt"], workdir))
    exported = ok(run_cmd([*predict[:-1], "model.pt", row, row.replace("0.5", "-1")], workdir))
    assert exported.stdout == result.stdout
    assert "comma-separated numbers" in one_error(run_cmd([*predict, "1,2"], workdir))
