"""Training features, each run for real with 2 gloo processes (one where a single process is the
reference or the point): accumulation, schedule, exact evaluation, determinism, throughput and
memory report, profiler, plots, torch.compile, doctor. A run that several tests check is
a module fixture."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import (
    LAUNCHER_VARS,
    PROJECT_ROOT,
    assert_same_model,
    ckpt_name,
    final_model,
    load_state,
    made_once,
    ok,
    python_train,
    read_metrics,
    run_cmd,
    skip_unless_example_task,
    summary,
    torchrun,
    torchrun_cmd,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.config import (
    DEFAULT_MODEL_LAYOUT,
    SHARDED,
    parse_args,
    unused_settings,
)
from {{ cookiecutter.package_name }}.data import BatchFetcher, validation_batches
from {{ cookiecutter.package_name }}.doctor import main as doctor_main
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
    # The larger batch on one process: the same 64 samples a step (data.py).
    ok(python_train([*common, "--batch-size", "64", "--checkpoint-dir", "big"], workdir))
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
    assert moved == [key for key in moved if key.endswith(".k.bias")], moved


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


# 111 validation samples: odd, where DistributedSampler would pad with a duplicate. 16 steps an
# epoch (1,000 training samples, 2 ranks, batches of 32), 32 in all.
EVAL_SET = [*SMALL, "--dataset-size", "1000", "--val-fraction", "0.111", "--epochs", "2"]
DDP_OPTIONS = [] if DEFAULT_MODEL_LAYOUT in SHARDED else [
    "--bucket-cap-mb", "0.002", "--static-graph", "--no-gradient-as-bucket-view"]
POWERSGD = ["--comm-hook", "powersgd", "--powersgd-warmup-steps", "4", "--powersgd-rank", "4",
            "--bucket-cap-mb", "0.002"]


def train_in(folder: Path, name: str, *flags: str) -> subprocess.CompletedProcess:
    """A 2-rank run of EVAL_SET (and `flags`) with checkpoints in `name`, outputs in r-`name`."""
    return ok(torchrun([*EVAL_SET, *flags, "--checkpoint-dir", name, "--output-dir", f"r-{name}"],
                       folder))


# Each run below is made once, for the tests that check it (for both xdist workers).
@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    """The default run: the DDP options' reference; its distributed evaluation."""
    skip_unless_example_task()
    return made_once(tmp_path_factory, "features-default", lambda f: train_in(f, "default"))


@pytest.fixture(scope="module")
def options_run(tmp_path_factory) -> Path:
    """With the DDP options that must keep the default's bits, and the throughput report and
    profiler (these only watch)."""
    def train(folder: Path) -> None:
        result = train_in(folder, "options", *DDP_OPTIONS, "--step-times", "steps.json",
                          "--profile-steps", "2:4")
        (folder / "options.out").write_text(result.stdout)

    skip_unless_example_task()
    return made_once(tmp_path_factory, "features-options", train)


@pytest.fixture(scope="module")
def powersgd_run(tmp_path_factory) -> Path:
    """PowerSGD: the hooks' closeness, and its resumes."""
    skip_unless_example_task()
    return made_once(tmp_path_factory, "features-powersgd",
                     lambda f: train_in(f, "powersgd", *POWERSGD))


@pytest.mark.skipif(DEFAULT_MODEL_LAYOUT in SHARDED,
                    reason=f"{DEFAULT_MODEL_LAYOUT} does not use DDP")
def test_ddp_options_give_the_default_result_and_hooks_stay_close(default_run, options_run,
                                                                  powersgd_run):
    """Bucket size, static graph and gradients as bucket views change how DDP exchanges the
    gradients, not what it computes: bit for bit the default's weights (one run with all three,
    and the throughput report and profiler, which only watch). The comm hooks change the
    numbers: fp16 and bf16 within 1 % of the default's validation loss, PowerSGD (rank 4 from
    step 4, several buckets) within 5 %; and each of them really ran (other weights)."""
    folders = {"options": options_run, "powersgd": powersgd_run}  # fp16, bf16: default_run's

    def result(name: str) -> tuple[dict, float]:
        folder = folders.get(name, default_run)
        return final_model(folder / name), summary(folder / f"r-{name}")["val_loss"]

    default, default_loss = result("default")
    assert_same_model(default, result("options")[0])
    for hook, tolerance in {"fp16": 0.01, "bf16": 0.01, "powersgd": 0.05}.items():
        if hook != "powersgd":
            train_in(default_run, hook, "--comm-hook", hook, "--bucket-cap-mb", "0.002")
        model, loss = result(hook)
        assert not all(torch.equal(model[k], default[k]) for k in default), hook
        assert loss == pytest.approx(default_loss, rel=tolerance), hook


@pytest.mark.skipif(DEFAULT_MODEL_LAYOUT in SHARDED,
                    reason=f"{DEFAULT_MODEL_LAYOUT} does not use DDP")
def test_powersgd_resumes_with_other_buckets_or_another_rank(powersgd_run, tmp_path):
    """Resumed with bigger buckets (the saved ones merge) or another --powersgd-rank (the
    factors change shape), PowerSGD goes on: its state is fitted to the new buckets, and new
    factors start where the old ones do not fit (a note says so). It resumes the DDP options
    test's PowerSGD run (several buckets, rank 4), at step 32."""
    shutil.copytree(powersgd_run / "powersgd", tmp_path / "checkpoints")
    hook = [*EVAL_SET, "--epochs", "3", *POWERSGD[:-2], "--log-every", "1000"]
    result = ok(torchrun([*hook, "--max-steps", "34"], tmp_path))
    assert "resumed from" in result.stdout and "note: PowerSGD" not in result.stdout
    result = ok(torchrun([*hook, "--powersgd-rank", "2", "--max-steps", "40"], tmp_path))
    assert ("note: PowerSGD keeps its error feedback and starts new factors: the checkpoint "
            "used --powersgd-rank 4") in result.stdout
    assert summary(tmp_path / "runs/latest")["steps"] == 40


def test_warmup_cosine_schedule_clipping_and_weight_decay(workdir):
    # One process (the schedule is per step, whatever the world): 32 steps of 16 samples.
    ok(python_train([*SMALL, "--dataset-size", "512", "--batch-size", "16", "--epochs", "1",
                     "--lr", "0.01", "--lr-schedule", "cosine", "--warmup-steps", "8",
                     "--clip-grad", "0.5", "--weight-decay", "0.05", "--log-every", "1"],
                    workdir))
    lrs = [m["lr"] for m in read_metrics(workdir / "runs/latest")]
    assert len(lrs) == 32
    assert lrs[:8] == sorted(lrs[:8]) and lrs[7] == pytest.approx(0.01)  # warm-up to the peak
    assert lrs[8:] == sorted(lrs[8:], reverse=True) and lrs[-1] < 1e-6  # cosine down to zero
    state = load_state(workdir / "checkpoints" / ckpt_name(32))
    assert state["optimizer"]["param_groups"][0]["weight_decay"] == 0.05
    assert state["optim"]["scheduler"]["last_epoch"] == 32 and state["config"]["clip_grad"] == 0.5
    # --min-lr: the same run's decay ends there, not at zero (the logged lr is the step's).
    ok(python_train([*SMALL, "--dataset-size", "512", "--batch-size", "16", "--epochs", "1",
                     "--lr", "0.01", "--lr-schedule", "cosine", "--warmup-steps", "8",
                     "--min-lr", "0.002", "--log-every", "1", "--checkpoint-dir", "floor",
                     "--output-dir", "runs/floor"], workdir))
    floor = [m["lr"] for m in read_metrics(workdir / "runs/floor")]
    assert floor[:8] == pytest.approx(lrs[:8]) and floor[8:] == sorted(floor[8:], reverse=True)
    assert min(floor) == floor[-1] and 0.002 <= floor[-1] < 0.0021, floor
    halfway = 0.002 + (lrs[20] - lrs[-1]) / 0.01 * (0.01 - 0.002)  # the same cosine, lifted
    assert floor[20] == pytest.approx(halfway), (floor[20], halfway)


def test_a_resumed_run_of_another_length_says_where_its_schedule_goes(workdir):
    """--max-steps raised on a resumed cosine run: the schedule spans the new length, so the
    learning rate moves at once (here from the end of the old decay, 0, up the new one); the run
    says so, with the values, and how to keep the old schedule."""
    flags = [*SMALL, "--dataset-size", "512", "--batch-size", "16", "--epochs", "1",
             "--lr", "0.01", "--lr-schedule", "cosine", "--log-every", "1"]
    ok(python_train([*flags, "--max-steps", "8"], workdir))
    result = ok(python_train([*flags, "--max-steps", "16"], workdir))
    halfway = 0.01 * 0.5 * (1 + math.cos(math.pi * 8 / 16))  # step 9 of 16: factor(8)
    assert ("note: this run is 16 steps, the checkpoint's was 8: --lr-schedule cosine now spans "
            f"the new length, so the learning rate of step 9 is {halfway:.3g}, not 0; give the "
            "old run's --max-steps and --epochs to keep its schedule") in result.stdout
    lrs = [m["lr"] for m in read_metrics(workdir / "runs/latest")]  # each after its step
    assert lrs[8] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi * 9 / 16)))


def test_distributed_evaluation_equals_the_single_process_value(default_run):
    evals = read_metrics(default_run / "r-default", "val_loss")
    assert [e["epoch"] for e in evals] == [0, 1]
    reported = summary(default_run / "r-default")
    cfg = parse_args(EVAL_SET, task.Settings)
    _, val = task.build_datasets(cfg)
    assert len(val) == 111
    model = task.build_model(cfg)
    model.load_state_dict(final_model(default_run / "default"))
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


SEEDED = [*SMALL, "--dataset-size", "256", "--epochs", "2", "--deterministic", "--num-workers",
          "1", "--log-every", "2"]


@pytest.fixture(scope="module")
def seed_7(tmp_path_factory) -> Path:
    """One process with a data worker and --seed 7: the seed test's first model, the plot test's
    metrics."""
    skip_unless_example_task()
    args = [*SEEDED, "--seed", "7", "--checkpoint-dir", "a"]
    return made_once(tmp_path_factory, "features-seed", lambda f: ok(python_train(args, f)))


def test_another_seed_gives_another_model(seed_7, tmp_path):
    """--seed reaches the model and the data workers (one process: a rank's seeding is the same
    at any world size). (The same seed gives the same model bit for bit: every
    killed-and-resumed run in test_recovery.py ends with its uninterrupted run's weights, with
    data workers in test_per_sample_workers_with_random_augmentation_resume_bit_for_bit.)"""
    ok(python_train([*SEEDED, "--seed", "8", "--checkpoint-dir", "c"], tmp_path))
    a, c = final_model(seed_7 / "a"), final_model(tmp_path / "c")
    assert not all(torch.equal(a[k], c[k]) for k in a), "another seed gave the same model"


def test_throughput_memory_step_times_and_a_profile(options_run):
    """Reads the DDP options test's second run (it has --step-times and --profile-steps)."""
    stdout = (options_run / "options.out").read_text()
    report = summary(options_run / "r-options")
    assert report["samples_per_s"] > 0 and 0 < report["median_step_ms"] <= report["p90_step_ms"]
    assert report["checkpoint_stall_ms"] > 0 and len(report["peak_mem_mb"]) == 2
    steps = json.loads((options_run / "steps.json").read_text())
    assert len(steps["step_ends"]) == 32 and steps["started_at"] < steps["step_ends"][0]
    assert 0 < report["time_to_first_step_s"] < report["wall_time_s"] + 60
    # samples/s is training's: every sample trained (1,000 a epoch, 2 epochs), over the run's
    # time less the epochs' evaluations, which are timed apart.
    assert 0 < report["evaluation_s"] < report["wall_time_s"]
    training_s = report["wall_time_s"] - report["evaluation_s"]
    assert report["samples_per_s"] == pytest.approx(2 * 1000 / training_s, rel=2e-3)
    assert stdout.count("throughput:") == 1
    # The profiler: a trace of steps 2-4 on rank 0 only, with shapes.
    traces = list((options_run / "r-options/profile").glob("*.pt.trace.json"))
    assert len(traces) == 1 and stdout.count("profile of steps 2-4") == 1
    trace = json.loads(traces[0].read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any("ProfilerStep" in n or "aten::" in n for n in names)
    assert any(event.get("args", {}).get("Input Dims") for event in trace["traceEvents"])


def test_plot_metrics_script(seed_7):
    pytest.importorskip("matplotlib")
    workdir = seed_7  # the seed test's first run: 16 steps, a log line every 2
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
@pytest.mark.skipif(DEFAULT_MODEL_LAYOUT == "tensor_parallel", reason="--compile is not yet "
                    "supported with --model-layout tensor_parallel (one error line)")
def test_compile_trains(workdir):
    ok(torchrun([*SMALL, "--dataset-size", "256", "--epochs", "1", "--compile"], workdir,
                timeout=400))
    assert summary(workdir / "runs/latest")["steps"] == 4  # 256 samples, 2 ranks, batches of 32


DOCTOR = [sys.executable, "-m", "{{ cookiecutter.package_name }}.doctor"]


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


def doctor_here(argv: list[str], monkeypatch, capsys, **env: str) -> tuple[int, str, str]:
    """The doctor in this process (no new Python to import torch; one process, or a check that
    fails before it joins a process group): its exit code, stdout and stderr."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = doctor_main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_doctor_one_process(workdir, monkeypatch, capsys):
    code, out, _ = doctor_here([], monkeypatch, capsys)
    assert code == 0 and "launcher none" in out
    assert "OK: all_reduce and barrier across 1" in out
    assert "torch " in out and "GB/s" in out


def test_doctor_prints_the_world_even_when_a_check_fails(workdir, monkeypatch, capsys):
    code, out, err = doctor_here([], monkeypatch, capsys, SLURM_PROCID="3", SLURM_NTASKS="2",
                                 SLURM_STEP_ID="0", SLURM_JOB_ID="5")
    assert code == 1 and "resolved: launcher slurm, rank 3" in out
    assert "FAIL: SLURM (SLURM_PROCID/SLURM_NTASKS): rank 3 is outside a world" in err


def test_doctor_explains_nccl_without_gpus(workdir, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    code, _, err = doctor_here(["--backend", "nccl"], monkeypatch, capsys)
    assert code == 1 and "FAIL: backend nccl" in err


EVAL = ["--dataset-size", "512", "--batch-size", "16", "--hidden-size", "16", "--epochs", "4",
        "--eval-every-steps", "4", "--log-every", "4"]  # 16 steps an epoch


def test_evaluation_every_n_steps_the_best_checkpoint_an_early_stop_and_eval_only(workdir):
    # One run for the best checkpoint and the early stop (the same goal). The "best" by the
    # largest validation loss: the first evaluation (step 4), kept beside the newest checkpoint
    # whatever --keep-last says (step 8's is gone). Stop once the (largest) loss has not
    # improved for 2 evaluations: at step 12.
    result = ok(torchrun([*EVAL, "--keep-best", "val_loss:max", "--keep-last", "1",
                          "--save-every-steps", "4", "--early-stop", "val_loss:max:2"], workdir))
    assert "early stop: val_loss has not improved for 2 evaluation(s)" in result.stdout
    evals = read_metrics(workdir / "runs/latest", "val_loss")
    assert [m["step"] for m in evals] == [4, 8, 12]
    # A log step's line is written one step later, unless an evaluation comes first: then first.
    lines = [(m["step"], "val_loss" in m) for m in read_metrics(workdir / "runs/latest", "step")]
    assert lines == sorted(lines), "each step's training line, then its evaluation's"
    done = summary(workdir / "runs/latest")
    assert done["early_stopped"] and done["steps"] == 12 and done["checkpoint_saves"] == 3
    assert done["best"] == {"metric": "val_loss", "value": evals[0]["val_loss"], "step": 4}
    assert sorted(p.name for p in (workdir / "checkpoints").glob("ckpt_step*")) == [
        ckpt_name(4), ckpt_name(12)]
    # The checkpoint evaluated alone: the same metrics, and nothing else changes.
    before = sorted((workdir / "checkpoints").iterdir())
    result = ok(torchrun([*EVAL, "--eval-only", "--resume", f"checkpoints/{ckpt_name(4)}",
                          "--output-dir", "evaluated"], workdir))
    assert f"evaluation of checkpoints/{ckpt_name(4)} (step 4): val_" in result.stdout
    evaluated = json.loads((workdir / "evaluated/eval.json").read_text())
    assert evaluated["step"] == 4 and evaluated["val_loss"] == evals[0]["val_loss"]
    assert sorted((workdir / "checkpoints").iterdir()) == before
    assert not (workdir / "evaluated/summary.json").exists()


def test_the_built_in_schedules_after_the_warm_up(capsys):
    from {{ cookiecutter.package_name }}.optim import lr_lambda

    for schedule, middle in (("constant", 1.0), ("cosine", 0.5), ("linear", 0.5)):
        factor = lr_lambda(schedule, warmup_steps=4, total_steps=104)
        assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
        assert factor(54) == pytest.approx(middle) and factor(4) == 1.0
        assert factor(104) == (1.0 if schedule == "constant" else pytest.approx(0.0))
        # --min-lr (here --lr / 10, as nanoGPT): the decay ends there, halfway is halfway to it.
        floor = lr_lambda(schedule, warmup_steps=4, total_steps=104, floor=0.1)
        assert floor(104) == pytest.approx(1.0 if schedule == "constant" else 0.1)
        assert floor(54) == pytest.approx(1.0 if schedule == "constant" else 0.55)
    cfg = parse_args(["--lr-schedule", "cosine", "--lr", "6e-4", "--min-lr", "6e-5"], task.Settings)
    assert cfg.min_lr == 6e-5 and unused_settings(cfg) == []
    assert unused_settings(parse_args(["--min-lr", "1e-4"], task.Settings)) == [
        "--min-lr has no effect with --lr-schedule constant"]
    with pytest.raises(SystemExit):
        parse_args(["--lr", "1e-3", "--min-lr", "1e-2"], task.Settings)
    assert "--min-lr 0.01 is above --lr 0.001: give at most --lr" in capsys.readouterr().err
