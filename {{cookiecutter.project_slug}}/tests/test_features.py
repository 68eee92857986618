"""Training features, each run for real with 2 gloo processes: accumulation, schedule, evaluation,
determinism, tracking, throughput report, torch.compile and the doctor."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import PROJECT_ROOT, final_model, ok, python_train, read_metrics, run_cmd, torchrun
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from {{ cookiecutter.package_name }}.config import parse_args
from {{ cookiecutter.package_name }}.data import build_datasets, build_loader
from {{ cookiecutter.package_name }}.distributed import World, cleanup, ddp_setup, find_free_port
from {{ cookiecutter.package_name }}.model import build_model
from {{ cookiecutter.package_name }}.trainer import Trainer

pytestmark = pytest.mark.features


def summary(output_dir) -> dict:
    return json.loads((output_dir / "summary.json").read_text())


def test_grad_accumulation_equals_one_larger_batch(workdir):
    # 500 samples per rank: 62 micro-batches of 8 and one of 4, so the last group of 4 is short (8+8+4).
    common = ["--dataset-size", "1000", "--epochs", "1", "--val-fraction", "0"]
    ok(torchrun([*common, "--batch-size", "8", "--grad-accum", "4", "--checkpoint-dir", "accum"], workdir))
    ok(torchrun([*common, "--batch-size", "32", "--checkpoint-dir", "big"], workdir))
    accumulated, big = final_model(workdir / "accum"), final_model(workdir / "big")
    for key in big:
        torch.testing.assert_close(accumulated[key], big[key], rtol=1e-4, atol=1e-5)


def test_grad_accumulation_exchanges_gradients_once_per_group(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    world = World(0, 0, 1, 1, "none", "127.0.0.1", find_free_port(), "accum-count")
    ddp_setup(world, "gloo", "env", 60, [torch.device("cpu")], tmp_path)
    try:
        counts = {}
        for accum in (1, 4):
            cfg = parse_args(["--batch-size", "8", "--dataset-size", "256", "--epochs", "1", "--no-progress",
                              "--grad-accum", str(accum), "--checkpoint-dir", f"c{accum}", "--output-dir", f"r{accum}"])
            train_set, _ = build_datasets(None, cfg.dataset_size, cfg.seed)
            loader = build_loader(train_set, 0, 1, cfg.batch_size, cfg.seed)
            trainer = Trainer(cfg, world, build_model(cfg.model_layout, [torch.device("cpu")] * 2, 16, 2), loader,
                              [torch.device("cpu")], "gloo")
            calls = []

            def counting_hook(state, bucket, calls=calls):
                calls.append(1)
                return default_hooks.allreduce_hook(state, bucket)

            trainer.model.register_comm_hook(dist.group.WORLD, counting_hook)
            trainer.train()
            counts[accum] = (len(calls), trainer.step)
    finally:
        cleanup()
    (calls_1, steps_1), (calls_4, steps_4) = counts[1], counts[4]
    assert (steps_1, steps_4) == (32, 8)
    assert calls_1 == 4 * calls_4 and calls_4 % steps_4 == 0  # one exchange (of every bucket) per step


def test_warmup_cosine_schedule_clipping_and_weight_decay(workdir):
    ok(torchrun(["--dataset-size", "512", "--batch-size", "16", "--epochs", "2", "--lr", "0.01", "--lr-schedule",
                 "cosine", "--warmup-steps", "8", "--clip-grad", "0.5", "--weight-decay", "0.05", "--log-every", "1"],
                workdir))
    lrs = [m["lr"] for m in read_metrics(workdir / "runs/latest")]
    assert len(lrs) == 32
    assert lrs[:8] == sorted(lrs[:8]) and lrs[7] == pytest.approx(0.01)  # warm-up to the peak
    assert lrs[8:] == sorted(lrs[8:], reverse=True) and lrs[-1] < 1e-6  # cosine down to zero
    state = torch.load(workdir / "checkpoints/ckpt_step00000032.pt", map_location="cpu", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["weight_decay"] == 0.05
    assert state["scheduler"]["last_epoch"] == 32 and state["config"]["clip_grad"] == 0.5


def test_distributed_evaluation_equals_the_single_process_value(workdir):
    # 111 validation samples: not divisible by 2, where DistributedSampler would pad with a duplicate.
    ok(torchrun(["--dataset-size", "1000", "--val-fraction", "0.111", "--epochs", "2"], workdir))
    evals = read_metrics(workdir / "runs/latest", "val_loss")
    assert [e["epoch"] for e in evals] == [0, 1]
    reported = summary(workdir / "runs/latest")["val_loss"]
    assert reported == evals[-1]["val_loss"]

    cfg = parse_args([])
    _, val = build_datasets(None, 1000, cfg.seed, 0.111)
    assert len(val) == 111
    model = build_model("data_parallel", [torch.device("cpu")], cfg.hidden_size, cfg.num_layers)
    model.load_state_dict(final_model(workdir / "checkpoints"))
    model.eval()
    with torch.no_grad():
        single = (model(val.x).double() - val.y.double()).square().mean().item()
    assert reported == pytest.approx(single, rel=1e-6)


def test_same_seed_same_parameters_bit_for_bit(workdir):
    args = ["--dataset-size", "512", "--epochs", "2", "--deterministic", "--num-workers", "1", "--seed", "7"]
    ok(torchrun([*args, "--checkpoint-dir", "a"], workdir))
    ok(torchrun([*args, "--checkpoint-dir", "b"], workdir))
    ok(torchrun([*args[:-1], "8", "--checkpoint-dir", "c"], workdir))
    a, b, c = (final_model(workdir / d) for d in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a), "another seed gave the same model"


def test_throughput_report(workdir):
    result = ok(torchrun(["--dataset-size", "512", "--epochs", "1", "--step-times", "steps.json"], workdir))
    report = summary(workdir / "runs/latest")
    assert report["samples_per_s"] > 0 and 0 < report["median_step_ms"] <= report["p90_step_ms"]
    assert report["checkpoint_save_ms"] > 0
    steps = json.loads((workdir / "steps.json").read_text())
    assert len(steps["step_ends"]) == 8 and steps["started_at"] < steps["step_ends"][0]
    assert 0 < report["time_to_first_step_s"] < report["wall_time_s"] + 60
    assert result.stdout.count("throughput:") == 1


def test_tensorboard_scalars_from_rank_0_only(workdir):
    pytest.importorskip("tensorboard")
    ok(torchrun(["--dataset-size", "512", "--epochs", "1", "--tracker", "tensorboard"], workdir))
    events = list((workdir / "runs/latest/tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def test_plot_metrics_script(workdir):
    pytest.importorskip("matplotlib")
    ok(python_train(["--dataset-size", "256", "--epochs", "2"], workdir))
    result = ok(run_cmd([sys.executable, str(PROJECT_ROOT / "scripts/plot_metrics.py"),
                         str(workdir / "runs/latest/metrics.jsonl"), "-o", str(workdir / "loss.png")], workdir))
    assert result.stdout.strip() == str(workdir / "loss.png")
    assert (workdir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.compile
def test_compile_trains(workdir):
    ok(torchrun(["--dataset-size", "256", "--epochs", "1", "--compile"], workdir, timeout=400))
    assert summary(workdir / "runs/latest")["steps"] == 4  # 256 samples, 2 ranks, batches of 32


DOCTOR = [sys.executable, "-m", "{{ cookiecutter.package_name }}.doctor"]


def test_doctor_one_process(workdir):
    result = ok(run_cmd([*DOCTOR], PROJECT_ROOT))
    assert "launcher none" in result.stdout and "OK: all_reduce and barrier across 1 process(es)" in result.stdout
    assert "torch " in result.stdout


def test_doctor_under_torchrun(workdir):
    result = ok(run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                         "-m", "{{ cookiecutter.package_name }}.doctor"], PROJECT_ROOT))
    assert result.stdout.count("OK: all_reduce and barrier across 2 process(es) over gloo") == 2


def test_doctor_explains_a_mismatched_world(workdir):
    # One process started where two were announced: the rendezvous can never complete.
    result = run_cmd([*DOCTOR, "--timeout-s", "3"], PROJECT_ROOT, timeout=120, RANK="0", WORLD_SIZE="2",
                     LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    assert result.returncode == 1
    assert "FAIL: the 2 processes could not all meet within --timeout-s=3" in result.stderr
    assert "exactly WORLD_SIZE=2 processes" in result.stderr


def test_doctor_explains_nccl_without_gpus(workdir):
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    result = run_cmd([*DOCTOR, "--backend", "nccl"], PROJECT_ROOT)
    assert result.returncode == 1 and "FAIL: backend nccl" in result.stderr and "--backend gloo" in result.stderr
