"""Model layouts, precision and BatchNorm options, run with 2 gloo processes on CPU."""

from __future__ import annotations

import json

import torch
from conftest import ok, read_metrics, torchrun

from {{ cookiecutter.package_name }}.model import MLP, TwoStageMLP

QUICK = ["--dataset-size", "512", "--batch-size", "16"]  # 16 steps per epoch with 2 ranks


def summary(workdir) -> dict:
    return json.loads((workdir / "runs/latest/summary.json").read_text())


def test_two_stage_model_matches_the_single_device_model():
    torch.manual_seed(0)
    single = MLP(hidden_size=32, num_layers=3, batch_norm=True).eval()
    split = TwoStageMLP([torch.device("cpu"), torch.device("cpu")], hidden_size=32, num_layers=3, batch_norm=True)
    assert list(split.state_dict()) == list(single.state_dict()), "checkpoints must move between layouts"
    split.load_state_dict(single.state_dict())
    split.eval()
    x = torch.randn(8, 20)
    assert torch.equal(split(x), single(x))
    assert 0 < split.split < len(split.net)


def test_model_parallel_layout_trains_and_resumes_as_data_parallel(workdir):
    ok(torchrun([*QUICK, "--epochs", "1", "--model-layout", "model_parallel_2"], workdir))
    assert summary(workdir)["steps"] == 16
    # The split model's checkpoint continues in the single-device layout...
    ok(torchrun([*QUICK, "--epochs", "2", "--model-layout", "data_parallel"], workdir))
    resumed = summary(workdir)
    assert resumed["resumed_from"].endswith("ckpt_step00000016.pt") and resumed["steps"] == 32
    # ...and back again.
    ok(torchrun([*QUICK, "--epochs", "3", "--model-layout", "model_parallel_2"], workdir))
    assert summary(workdir)["steps"] == 48
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert losses[-1] < 0.5 * losses[0]


def test_bf16_autocast_on_cpu_learns(workdir):
    ok(torchrun([*QUICK, "--epochs", "2", "--precision", "bf16"], workdir))
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert losses[-1] < 0.5 * losses[0]


def test_fp16_on_cpu_is_one_error_line(workdir):
    result = torchrun([*QUICK, "--precision", "fp16"], workdir)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --precision fp16 needs CUDA (it relies on a GradScaler); use --precision bf16 on CPU"]


def test_sync_bn_is_skipped_with_a_warning_on_cpu(workdir):
    result = ok(torchrun([*QUICK, "--epochs", "1", "--batch-norm", "--sync-bn"], workdir))
    assert result.stderr.count("warning: --sync-bn needs CUDA") == 1
    state = torch.load(workdir / "checkpoints/ckpt_step00000016.pt", map_location="cpu", weights_only=True)
    assert "net.1.running_mean" in state["model"]
