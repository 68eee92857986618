"""--ema-decay: the average follows its formula, is what evaluation reports and what the export
holds. That it survives a SIGKILL bit for bit, under data_parallel and fsdp, is checked by the
killed runs of tests/test_custom_step.py, which train with --ema-decay and compare the average too
(model_parallel_2 saves it as data_parallel does, whole, in one file)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    PROJECT_ROOT,
    load_state,
    ok,
    python_train,
    read_metrics,
    run_cmd,
)

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints, read_meta
from {{ cookiecutter.package_name }}.config import Config
from {{ cookiecutter.package_name }}.data import BatchFetcher, move_to, validation_batches

pytestmark = pytest.mark.full  # the slow tier: pytest --full

DECAY = 0.9
SMALL = ["--dataset-size", "256", "--batch-size", "16", "--hidden-size", "16", "--ema-decay",
         str(DECAY)]


def checkpoints_by_step(folder: Path) -> dict[int, dict]:
    return {read_meta(path)["step"]: load_state(path) for path in list_checkpoints(folder)}


def test_the_average_follows_its_formula_after_every_step(workdir):
    """Saved after every step: each checkpoint's average is DECAY x the one before plus
    (1 - DECAY) x its own weights, computed here as the run computes it, bit for bit."""
    ok(python_train([*SMALL, "--max-steps", "6", "--save-every-steps", "1", "--keep-last", "0"],
                    workdir))
    states = checkpoints_by_step(workdir / "checkpoints")
    assert sorted(states) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 6):
        before, after = states[step]["ema"], states[step + 1]["ema"]
        for name, weight in after.items():
            expected = before[name].mul(DECAY).add(states[step + 1]["model"][name].float(),
                                                   alpha=1.0 - DECAY)
            assert torch.equal(expected, weight), f"step {step + 1}: {name}"
    last = states[6]
    assert any(not torch.equal(last["ema"][k], last["model"][k]) for k in last["ema"])


def val_metrics(cfg: Config, weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """The validation metrics of `weights`, computed here the way the Evaluator defines them:
    every validation sample once, sums over batches divided by the counts."""
    model = task.build_model(cfg)
    model.load_state_dict(weights)
    model.eval()
    _, val = task.build_datasets(cfg)
    fetch = BatchFetcher(val, getattr(task, "collate", None))
    sums: dict[str, float] = {}
    with torch.no_grad():
        for key in validation_batches(len(val), 0, 1, cfg.batch_size, cfg.seed):
            for name, value in task.eval_metrics(model, move_to(fetch.__getitems__(key),
                                                                torch.device("cpu"))).items():
                sums[name] = sums.get(name, 0.0) + float(value)
    averages = {k: v / sums.get(f"{k}_count", sums.get("count", 0))
                for k, v in sums.items() if k != "count" and not k.endswith("_count")}
    if hasattr(task, "finalize_metrics"):
        averages = task.finalize_metrics(averages)
    return averages


def test_evaluation_reports_the_average_and_the_raw_weights(workdir):
    ok(python_train([*SMALL, "--epochs", "1", "--keep-best", "val_loss"], workdir))
    state = load_state(list_checkpoints(workdir / "checkpoints")[0])
    cfg = Config.from_dict(state["config"], task.Settings)
    averaged = val_metrics(cfg, {**state["model"], **state["ema"]})
    raw = val_metrics(cfg, state["model"])
    reported = read_metrics(workdir / "runs/latest", key="val_loss")[-1]
    for name, value in averaged.items():
        assert reported[f"val_{name}"] == pytest.approx(value, rel=1e-5)
        assert reported[f"val_raw_{name}"] == pytest.approx(raw[name], rel=1e-5)
    assert abs(averaged["loss"] - raw["loss"]) > 1e-3 * abs(raw["loss"]), "the same weights?"
    assert state["selection"]["best"]["value"] == reported["val_loss"]  # --keep-best: the EMA's


def test_the_export_holds_the_average_unless_asked_for_the_raw_weights(workdir):
    ok(python_train([*SMALL, "--epochs", "1"], workdir))
    newest = list_checkpoints(workdir / "checkpoints")[0]
    state = load_state(newest)
    for flag, expected, weights in (([], state["ema"], "ema"),
                                    (["--raw-weights"], state["model"], "raw")):
        out = workdir / f"export-{weights}.pt"
        ok(run_cmd([sys.executable, "-m", "{{ cookiecutter.package_name }}.checkpoint", "export",
                    str(newest), str(out), *flag], PROJECT_ROOT))
        exported = torch.load(out, weights_only=True)
        assert exported["weights"] == weights
        for name, value in expected.items():
            assert torch.equal(exported["model"][name], value.to(exported["model"][name].dtype))
