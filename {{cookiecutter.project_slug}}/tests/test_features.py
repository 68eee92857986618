"""Training features, each run for real with 2 gloo processes: accumulation, schedule, exact
evaluation, determinism, throughput and memory report, profiler, plots, torch.compile, doctor."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import (
    PROJECT_ROOT,
    assert_same_model,
    ckpt_name,
    final_model,
    load_state,
    ok,
    python_train,
    read_metrics,
    run_cmd,
    summary,
    torchrun,
    torchrun_cmd,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.config import DEFAULT_MODEL_LAYOUT, parse_args
from {{ cookiecutter.package_name }}.data import BatchFetcher, validation_batches
from {{ cookiecutter.package_name }}.main import work
from {{ cookiecutter.package_name }}.runtime.environments import World, find_free_port
from {{ cookiecutter.package_name }}.runtime.launch import run

pytestmark = pytest.mark.features

SMALL = ["--hidden-size", "16"]


def test_grad_accumulation_equals_one_larger_batch(workdir):
    # 250 samples per rank: 31 micro-batches of 8 and one of 2, so the last group is short.
    common = [*SMALL, "--dataset-size", "500", "--epochs", "1", "--val-fraction", "0"]
    ok(torchrun([*common, "--batch-size", "8", "--grad-accum", "4", "--checkpoint-dir", "accum"],
                workdir))
    ok(torchrun([*common, "--batch-size", "32", "--checkpoint-dir", "big"], workdir))
    accumulated, big = final_model(workdir / "accum"), final_model(workdir / "big")
    # The same model: the same loss on a batch, and the same weights but those whose gradient is
    # zero in exact arithmetic (an attention key's bias: softmax ignores a shift), whose rounding
    # noise AdamW scales up to steps of --lr.
    cfg = parse_args(common, task.Settings)
    batch = BatchFetcher(task.build_datasets(cfg)[0], getattr(task, "collate", None)).__getitems__(
        (0, torch.arange(32)))
    losses = []
    for state in (accumulated, big):
        model = task.build_model(cfg)
        model.load_state_dict(state)
        losses.append(task.loss_fn(model.eval(), batch).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    moved = [key for key in big if not torch.allclose(accumulated[key], big[key], 1e-4, 1e-5)]
    assert moved == [key for key in moved if key.endswith("qkv.bias")], moved


def test_grad_accumulation_exchanges_gradients_once_per_group(tmp_path, monkeypatch,
                                                             example_task):
    """Counts DDP's gradient exchanges through a comm hook, in this process (world size 1)."""
    import {{ cookiecutter.package_name }}.main as entry

    calls = []
    original = entry.parallelize

    def counting(*args, **kwargs):
        wrapped = original(*args, **kwargs)
        wrapped.register_comm_hook(dist.group.WORLD, lambda state, bucket: (
            calls.append(1), default_hooks.allreduce_hook(state, bucket))[1])
        return wrapped

    monkeypatch.setattr(entry, "parallelize", counting)
    monkeypatch.chdir(tmp_path)
    steps = {}
    for accum in (1, 4):
        calls.clear()
        cfg = parse_args([*SMALL, "--model-layout", "data_parallel", "--batch-size", "8",
                          "--dataset-size", "256", "--epochs", "1",
                          "--no-progress", "--grad-accum", str(accum), "--checkpoint-dir",
                          f"c{accum}", "--output-dir", f"r{accum}", "--val-fraction", "0"],
                         task.Settings)
        done = run(cfg, World(0, 0, 1, 1, "none", "127.0.0.1", find_free_port(), f"a{accum}"),
                   work)
        steps[accum] = (len(calls), done["steps"])
    (calls_1, steps_1), (calls_4, steps_4) = steps[1], steps[4]
    assert (steps_1, steps_4) == (32, 8)
    assert calls_1 == 4 * calls_4 and calls_4 % steps_4 == 0  # one exchange a step


@pytest.mark.skipif(DEFAULT_MODEL_LAYOUT == "fsdp", reason="fsdp does not use DDP")
def test_ddp_options_give_the_default_result_and_hooks_stay_close(workdir):
    """Bucket size, static graph and gradients as bucket views change how DDP exchanges the
    gradients, not what it computes: bit for bit the default's weights. The comm hooks change the
    numbers: fp16 and bf16 within 1 % of the default's validation loss, PowerSGD (rank 4 from
    step 4, several buckets) within 5 %; and each of them really ran (other weights)."""
    common = [*SMALL, "--dataset-size", "1024", "--epochs", "2"]

    def train(name: str, *flags: str) -> tuple[dict, float]:
        ok(torchrun([*common, *flags, "--checkpoint-dir", name, "--output-dir", f"r-{name}"],
                    workdir))
        return final_model(workdir / name), summary(workdir / f"r-{name}")["val_loss"]

    default, default_loss = train("default")
    assert_same_model(default, train("buckets", "--bucket-cap-mb", "0.002", "--static-graph",
                                     "--no-gradient-as-bucket-view")[0])
    for hook, tolerance in {"fp16": 0.01, "bf16": 0.01, "powersgd": 0.05}.items():
        model, loss = train(hook, "--comm-hook", hook, "--powersgd-warmup-steps", "4",
                            "--powersgd-rank", "4", "--bucket-cap-mb", "0.002")
        assert not all(torch.equal(model[k], default[k]) for k in default), hook
        assert loss == pytest.approx(default_loss, rel=tolerance), hook


@pytest.mark.skipif(DEFAULT_MODEL_LAYOUT == "fsdp", reason="fsdp does not use DDP")
def test_powersgd_resumes_with_other_buckets_or_another_rank(workdir):
    """Resumed with bigger buckets (the saved ones merge) or another --powersgd-rank (the
    factors change shape), PowerSGD goes on: its state is fitted to the new buckets, and new
    factors start where the old ones do not fit (a note says so)."""
    hook = [*SMALL, "--dataset-size", "512", "--epochs", "3", "--comm-hook", "powersgd",
            "--powersgd-warmup-steps", "3", "--log-every", "1000"]
    ok(torchrun([*hook, "--bucket-cap-mb", "0.002", "--max-steps", "8"], workdir))
    result = ok(torchrun([*hook, "--max-steps", "16"], workdir))
    assert "resumed from" in result.stdout and "note: PowerSGD" not in result.stdout
    result = ok(torchrun([*hook, "--powersgd-rank", "2", "--max-steps", "24"], workdir))
    assert ("note: PowerSGD keeps its error feedback and starts new factors: the checkpoint "
            "used --powersgd-rank 1") in result.stdout
    assert summary(workdir / "runs/latest")["steps"] == 24


def test_warmup_cosine_schedule_clipping_and_weight_decay(workdir):
    ok(torchrun([*SMALL, "--dataset-size", "512", "--batch-size", "16", "--epochs", "2", "--lr",
                 "0.01", "--lr-schedule", "cosine", "--warmup-steps", "8", "--clip-grad", "0.5",
                 "--weight-decay", "0.05", "--log-every", "1"], workdir))
    lrs = [m["lr"] for m in read_metrics(workdir / "runs/latest")]
    assert len(lrs) == 32
    assert lrs[:8] == sorted(lrs[:8]) and lrs[7] == pytest.approx(0.01)  # warm-up to the peak
    assert lrs[8:] == sorted(lrs[8:], reverse=True) and lrs[-1] < 1e-6  # cosine down to zero
    state = load_state(workdir / "checkpoints" / ckpt_name(32))
    assert state["optimizer"]["param_groups"][0]["weight_decay"] == 0.05
    assert state["optim"]["scheduler"]["last_epoch"] == 32 and state["config"]["clip_grad"] == 0.5


def test_distributed_evaluation_equals_the_single_process_value(workdir):
    # 111 validation samples: odd, where DistributedSampler would pad with a duplicate.
    args = [*SMALL, "--dataset-size", "1000", "--val-fraction", "0.111", "--epochs", "2"]
    ok(torchrun(args, workdir))
    evals = read_metrics(workdir / "runs/latest", "val_loss")
    assert [e["epoch"] for e in evals] == [0, 1]
    reported = summary(workdir / "runs/latest")
    cfg = parse_args(args, task.Settings)
    _, val = task.build_datasets(cfg)
    assert len(val) == 111
    model = task.build_model(cfg)
    model.load_state_dict(final_model(workdir / "checkpoints"))
    model.eval()
    fetcher = BatchFetcher(val, getattr(task, "collate", None))
    sums: dict[str, float] = {}
    with torch.no_grad():  # one process, every sample once, in batches of the same size
        for _, indices in validation_batches(len(val), 0, 1, cfg.batch_size, cfg.seed):
            for key, value in task.eval_metrics(model, fetcher.__getitems__((0, indices))).items():
                sums[key] = sums.get(key, 0.0) + float(value)
    for key in sums:
        if key != "count" and not key.endswith("_count"):
            count = sums.get(f"{key}_count", sums["count"])
            assert reported[f"val_{key}"] == pytest.approx(sums[key] / count, rel=1e-5), key


def test_another_seed_gives_another_model(workdir):
    """--seed reaches the model and the data workers. (The same seed gives the same model bit for
    bit: every killed-and-resumed run in test_recovery.py ends with its uninterrupted run's weights,
    with data workers in test_per_sample_workers_with_random_augmentation_resume_bit_for_bit.)"""
    args = [*SMALL, "--dataset-size", "256", "--epochs", "2", "--deterministic", "--num-workers",
            "1", "--seed", "7"]
    ok(torchrun([*args, "--checkpoint-dir", "a"], workdir))
    ok(torchrun([*args[:-1], "8", "--checkpoint-dir", "c"], workdir))
    a, c = (final_model(workdir / d) for d in "ac")
    assert not all(torch.equal(a[k], c[k]) for k in a), "another seed gave the same model"


def test_throughput_memory_step_times_and_a_profile(workdir):
    result = ok(torchrun([*SMALL, "--dataset-size", "512", "--epochs", "1", "--step-times",
                          "steps.json", "--profile-steps", "2:4"], workdir))
    report = summary(workdir / "runs/latest")
    assert report["samples_per_s"] > 0 and 0 < report["median_step_ms"] <= report["p90_step_ms"]
    assert report["checkpoint_stall_ms"] > 0 and len(report["peak_mem_mb"]) == 2
    steps = json.loads((workdir / "steps.json").read_text())
    assert len(steps["step_ends"]) == 8 and steps["started_at"] < steps["step_ends"][0]
    assert 0 < report["time_to_first_step_s"] < report["wall_time_s"] + 60
    assert result.stdout.count("throughput:") == 1
    # The profiler: a trace of steps 2-4 on rank 0 only, with shapes.
    traces = list((workdir / "runs/latest/profile").glob("*.pt.trace.json"))
    assert len(traces) == 1 and result.stdout.count("profile of steps 2-4") == 1
    trace = json.loads(traces[0].read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any("ProfilerStep" in n or "aten::" in n for n in names)
    assert any(event.get("args", {}).get("Input Dims") for event in trace["traceEvents"])


def test_plot_metrics_script(workdir):
    pytest.importorskip("matplotlib")
    ok(python_train([*SMALL, "--dataset-size", "256", "--epochs", "3", "--log-every", "2"],
                    workdir))
    out = workdir / "loss.png"
    result = ok(run_cmd([sys.executable, str(PROJECT_ROOT / "scripts/plot_metrics.py"),
                         str(workdir / "runs/latest/metrics.jsonl"), "-o", str(out)], workdir))
    assert result.stdout.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    # The run's folder works too; the picture goes beside its metrics.
    result = ok(run_cmd([sys.executable, str(PROJECT_ROOT / "scripts/plot_metrics.py"),
                         "runs/latest"], workdir))
    assert result.stdout.strip() == "runs/latest/metrics.png"
    assert (workdir / "runs/latest/metrics.png").stat().st_size > 10_000


@pytest.mark.compile
def test_compile_trains(workdir):
    ok(torchrun([*SMALL, "--dataset-size", "256", "--epochs", "1", "--compile"], workdir,
                timeout=400))
    assert summary(workdir / "runs/latest")["steps"] == 4  # 256 samples, 2 ranks, batches of 32


DOCTOR = [sys.executable, "-m", "{{ cookiecutter.package_name }}.doctor"]


def test_doctor_one_process(workdir):
    result = ok(run_cmd(DOCTOR, PROJECT_ROOT))
    assert "launcher none" in result.stdout
    assert "OK: all_reduce and barrier across 1" in result.stdout
    assert "torch " in result.stdout and "GB/s" in result.stdout


def test_doctor_under_torchrun(workdir):
    result = ok(run_cmd([*torchrun_cmd(2), "-m", "{{ cookiecutter.package_name }}.doctor"],
                        PROJECT_ROOT))
    assert result.stdout.count("OK: all_reduce and barrier across 2 process(es) over gloo") == 2
    assert result.stdout.count("all_reduce bandwidth over gloo") == 2


def test_doctor_explains_a_mismatched_world(workdir):
    # One process started where two were announced: the rendezvous can never complete.
    result = run_cmd([*DOCTOR, "--timeout-s", "3"], PROJECT_ROOT, timeout=120, RANK="0",
                     WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(find_free_port()))
    assert result.returncode == 1
    assert "resolved: launcher torchrun, rank 0, local rank 0/2, world 2" in result.stdout
    assert "waiting for the other 1 rank(s) to join" in result.stderr


def test_doctor_prints_the_world_even_when_a_check_fails(workdir):
    result = run_cmd(DOCTOR, PROJECT_ROOT, SLURM_PROCID="3", SLURM_NTASKS="2", SLURM_STEP_ID="0",
                     SLURM_JOB_ID="5")
    assert result.returncode == 1 and "resolved: launcher slurm, rank 3" in result.stdout
    assert "FAIL: SLURM (SLURM_PROCID/SLURM_NTASKS): rank 3 is outside a world" in result.stderr


def test_doctor_explains_nccl_without_gpus(workdir):
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    result = run_cmd([*DOCTOR, "--backend", "nccl"], PROJECT_ROOT)
    assert result.returncode == 1 and "FAIL: backend nccl" in result.stderr


EVAL = ["--dataset-size", "512", "--batch-size", "16", "--hidden-size", "16", "--epochs", "4",
        "--eval-every-steps", "4", "--log-every", "4"]  # 16 steps an epoch


def test_evaluation_every_n_steps_the_best_checkpoint_an_early_stop_and_eval_only(workdir):
    # The "best" by the largest validation loss: the first evaluation (step 4), kept beside the
    # newest checkpoint whatever --keep-last says.
    ok(torchrun([*EVAL, "--keep-best", "val_loss:max", "--keep-last", "1"], workdir))
    evals = read_metrics(workdir / "runs/latest", "val_loss")
    assert [m["step"] for m in evals] == list(range(4, 65, 4))
    # A log step's line is written one step later, unless an evaluation comes first: then first.
    lines = [(m["step"], "val_loss" in m) for m in read_metrics(workdir / "runs/latest", "step")]
    assert lines == sorted(lines), "each step's training line, then its evaluation's"
    done = summary(workdir / "runs/latest")
    assert done["best"] == {"metric": "val_loss", "value": evals[0]["val_loss"], "step": 4}
    assert sorted(p.name for p in (workdir / "checkpoints").glob("ckpt_step*")) == [
        ckpt_name(4), ckpt_name(64)]
    # The checkpoint evaluated alone: the same metrics, and nothing else changes.
    before = sorted((workdir / "checkpoints").iterdir())
    result = ok(torchrun([*EVAL, "--eval-only", "--resume", f"checkpoints/{ckpt_name(4)}",
                          "--output-dir", "evaluated"], workdir))
    assert f"evaluation of checkpoints/{ckpt_name(4)} (step 4): val_" in result.stdout
    evaluated = json.loads((workdir / "evaluated/eval.json").read_text())
    assert evaluated["step"] == 4 and evaluated["val_loss"] == evals[0]["val_loss"]
    assert sorted((workdir / "checkpoints").iterdir()) == before
    assert not (workdir / "evaluated/summary.json").exists()
    # Stop once the (largest) loss has not improved for 2 evaluations: at step 12.
    result = ok(torchrun([*EVAL, "--early-stop", "val_loss:max:2", "--checkpoint-dir", "es",
                          "--output-dir", "es-runs"], workdir))
    assert "early stop: val_loss has not improved for 2 evaluation(s)" in result.stdout
    done = summary(workdir / "es-runs")
    assert done["early_stopped"] and done["steps"] == 12


def test_the_built_in_schedules_after_the_warm_up():
    from {{ cookiecutter.package_name }}.optim import lr_lambda

    for schedule, middle in (("constant", 1.0), ("cosine", 0.5), ("linear", 0.5)):
        factor = lr_lambda(schedule, warmup_steps=4, total_steps=104)
        assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
        assert factor(54) == pytest.approx(middle) and factor(4) == 1.0
        assert factor(104) == (1.0 if schedule == "constant" else pytest.approx(0.0))
