"""End to end: real 2-process gloo jobs through torchrun, checked by the files they leave."""

from __future__ import annotations

import json
import sys

import torch
from conftest import PROJECT_ROOT, final_model, ok, path_with, read_metrics, run_cmd, torchrun

from {{ cookiecutter.package_name }}.checkpoint import list_checkpoints

SMALL = ["--dataset-size", "1024", "--batch-size", "16"]  # 32 steps per epoch with 2 ranks


def test_two_process_training_learns_and_leaves_its_files(workdir):
    result = ok(torchrun([*SMALL, "--epochs", "3"], workdir))
    assert result.stdout.count("world: 2 process") == 1, "only rank 0 logs"

    metrics = read_metrics(workdir / "runs/latest")
    assert metrics[0]["step"] == 10 and metrics[-1]["step"] == 96
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"], "loss did not go down"

    summary = json.loads((workdir / "runs/latest/summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "gloo" and summary["launcher"] == "torchrun"
    assert summary["epochs_completed"] == 3 and summary["steps"] == 96 and summary["resumed_from"] is None
    assert summary["final_loss"] == metrics[-1]["loss"] and summary["samples_per_s"] > 0

    checkpoints = list_checkpoints(workdir / "checkpoints")
    assert [p.name for p in checkpoints] == [f"ckpt_step{s:08d}.pt" for s in (96, 64, 32)]
    state = torch.load(checkpoints[0], map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "epoch", "step", "world_size", "config"} <= state.keys()
    assert state["world_size"] == 2 and state["step"] == 96 and state["epoch"] == 3
    assert not any(key.startswith("module.") for key in state["model"])
    assert state["config"]["batch_size"] == 16
    assert not list((workdir / "checkpoints").glob(".*tmp*")), "temp files left behind"


def test_resume_mid_epoch_matches_an_uninterrupted_run(workdir):
    ok(torchrun([*SMALL, "--epochs", "2", "--output-dir", "a/runs", "--checkpoint-dir", "a/ckpt"], workdir))
    # Stop at step 37 (5 batches into the second epoch, between log steps), then resume to the end.
    b = [*SMALL, "--epochs", "2", "--output-dir", "b/runs", "--checkpoint-dir", "b/ckpt"]
    ok(torchrun([*b, "--max-steps", "37"], workdir))
    stopped, last_log = json.loads((workdir / "b/runs/summary.json").read_text()), read_metrics(workdir / "b/runs")[-1]
    assert stopped["steps"] == last_log["step"] == 37 and stopped["final_loss"] == last_log["loss"]
    resumed = ok(torchrun(b, workdir))
    assert "resumed from" in resumed.stdout

    summary = json.loads((workdir / "b/runs/summary.json").read_text())
    assert summary["resumed_from"].endswith("ckpt_step00000037.pt") and summary["steps"] == 64
    assert [m["step"] for m in read_metrics(workdir / "b/runs")][-3:] == [50, 60, 64]

    expected, got = final_model(workdir / "a/ckpt"), final_model(workdir / "b/ckpt")
    for key in expected:
        assert torch.equal(expected[key], got[key]), f"{key} differs after resume"


def test_unreadable_resume_path_is_one_error_line(workdir):
    result = torchrun([*SMALL, "--resume", str(workdir / "missing.pt")], workdir)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --resume {workdir / 'missing.pt'}: no such file; use --resume auto or --resume never"]


def test_local_script_trains_with_the_chosen_launcher(workdir, bin_dir):
    args = [*SMALL, "--no-progress", "--epochs", "1", "--output-dir", str(workdir / "runs"),
            "--checkpoint-dir", str(workdir / "ck")]
    ok(run_cmd(["bash", str(PROJECT_ROOT / "scripts/train_local.sh"), *args], workdir,
               PATH=path_with(bin_dir), NPROC="2", PYTHON=sys.executable))
    summary = json.loads((workdir / "runs/summary.json").read_text())
    assert summary["world_size"] == 2 and summary["launcher"] == "{{ cookiecutter.launcher }}"
