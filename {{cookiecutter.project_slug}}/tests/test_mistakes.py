"""Every user mistake is one clear line, before any work is lost: no traceback, no hang, and every
checkpoint that existed before still loads.

Each case starts from a folder that already holds a finished run (its checkpoints must survive),
runs `python train.py` (or torchrun with 2 processes) with one bad input, and checks the exit code,
that exactly one `error:` line was printed, what it says, and that the old checkpoints still load.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import (
    LAUNCHER_VARS,
    PROJECT_ROOT,
    TRAIN,
    child_env,
    ckpt_name,
    load_state,
    made_once,
    ok,
    one_error,
    python_train,
    read_metrics,
    run_cmd,
    skip_unless_example_task,
    summary,
    torchrun,
    torchrun_cmd,
)

from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints, read_meta, unreadable
from {{ cookiecutter.package_name }}.config import DEFAULT_MODEL_LAYOUT, SHARDED
from {{ cookiecutter.package_name }}.doctor import main as doctor
from {{ cookiecutter.package_name }}.main import main

pytestmark = pytest.mark.full  # the slow tier: pytest --full

BASE = ["--no-progress", "--epochs", "1", "--dataset-size", "128", "--batch-size", "16",
        "--hidden-size", "8", "--timeout-s", "20"]


@dataclass
class Case:
    args: list[str]
    says: str
    code: int = 1
    launcher: str = "python"  # or "torchrun": two processes
    env: dict[str, str] = field(default_factory=dict)
    prepare: str = ""  # what to put in the folder first (see `prepare`)


# A checkpoint of another model's shapes: a file's load names the mismatch, DCP's (fsdp,
# tensor_parallel) the first tensor whose size differs.
OTHER_MODEL = ("does not fit the model: " if DEFAULT_MODEL_LAYOUT not in SHARDED
               else "Size mismatch between saved")
CASES = {
    # Flags whose values cannot work: exit 2 before anything starts.
    "lr-inf": Case(["--lr", "inf"], "--lr: must be a finite number", 2),
    "lr-nan": Case(["--lr", "nan"], "--lr: must be a finite number", 2),
    "lr-negative": Case(["--lr", "-1"], "--lr: must be a finite number greater than 0", 2),
    "lr-text": Case(["--lr", "fast"], "argument --lr: invalid number value: 'fast'", 2),
    "weight-decay-negative": Case(["--weight-decay", "-1"], "--weight-decay: must be", 2),
    "ema-decay-one": Case(["--ema-decay", "1"], "--ema-decay: must be 0 (off) or between 0 and 1",
                          2),
    "clip-grad-negative": Case(["--clip-grad", "-1"], "--clip-grad: must be", 2),
    "clip-grad-nan": Case(["--clip-grad", "nan"], "--clip-grad: must be a finite number", 2),
    "timeout-inf": Case(["--timeout-s", "inf"], "--timeout-s: must be a finite number", 2),
    "timeout-zero": Case(["--timeout-s", "0"], "--timeout-s: must be a finite number", 2),
    "timeout-tiny": Case(["--timeout-s", "0.01"], "--timeout-s: must be a finite number at least 1",
                         2),
    "seed-negative": Case(["--seed", "-1"], "--seed: must be between 0 and", 2),
    "seed-huge": Case(["--seed", str(2**40)], "--seed: must be between 0 and", 2),
    "epochs-zero": Case(["--epochs", "0"], "--epochs: must be at least 1", 2),
    "batch-size-zero": Case(["--batch-size", "0"], "--batch-size: must be at least 1", 2),
    "grad-accum-zero": Case(["--grad-accum", "0"], "--grad-accum: must be at least 1", 2),
    "log-every-zero": Case(["--log-every", "0"], "--log-every: must be at least 1", 2),
    "keep-last-negative": Case(["--keep-last", "-1"], "--keep-last: must be at least 0", 2),
    "max-steps-negative": Case(["--max-steps", "-5"], "--max-steps: must be at least 0", 2),
    "hidden-size-zero": Case(["--hidden-size", "0"], "--hidden-size: must be at least 1", 2),
    "workers-negative": Case(["--num-workers", "-1"], "--num-workers: must be between 0", 2),
    "val-fraction-one": Case(["--val-fraction", "1"], "--val-fraction: must be at least 0", 2),
    "profile-backwards": Case(["--profile-steps", "5:2"], "expected FIRST:LAST", 2),
    "precision-unknown": Case(["--precision", "fp8"], "invalid choice: 'fp8'", 2),
    "backend-unknown": Case(["--backend", "mpi"], "invalid choice: 'mpi'", 2),
    "layout-unknown": Case(["--model-layout", "pipeline"], "invalid choice: 'pipeline'", 2),
    "flag-unknown": Case(["--learning-rate", "1"], "unrecognized arguments: --learning-rate", 2),
    # An abbreviation is refused, as in a --config file: --epoch is not taken as --epochs.
    "flag-abbreviated": Case(["--epoch", "1"], "unrecognized arguments: --epoch 1", 2),
    "stage-devices-one": Case(["--stage-devices", "cuda:0"], "expected two devices", 2),
    "stage-devices-wrong-layout": Case(["--stage-devices", "cpu,cpu"],
                                       "--stage-devices only applies to --model-layout", 2),
    "data-missing": Case(["--data", "no/such/file"], "--data no/such/file: no such file", 2),
    "resume-missing": Case(["--resume", "no/such.pt"], "--resume no/such.pt: no such file", 2),
    "step-times-folder": Case(["--step-times", "."], "--step-times . is a folder", 2),
    "checkpoint-dir-a-file": Case(["--checkpoint-dir", "afile"], "--checkpoint-dir afile is a file",
                                  2, prepare="afile"),
    "output-dir-a-file": Case(["--output-dir", "afile"], "--output-dir afile is a file", 2,
                              prepare="afile"),
    "checkpoint-dir-a-url-with-a-key": Case(["--checkpoint-dir", "s3://AKIA:secret@bkt/run"],
                                            "--checkpoint-dir s3://bkt/run: credentials do not "
                                            "go in the URL", 2),
    "output-dir-a-url": Case(["--output-dir", "s3://bkt/run"], "--output-dir s3://...: metrics "
                             "are written to a local folder", 2),
    "config-missing": Case(["--config", "none.toml"], "--config none.toml: no such file", 2),
    "config-unknown-key": Case(["--config", "bad.toml"], "unknown key 'learning-rate'", 2,
                               prepare="bad.toml"),
    "config-wrong-type": Case(["--config", "typed.toml"], "key 'epochs' must be an integer", 2,
                              prepare="typed.toml"),
    "bad-flag-under-torchrun": Case(["--lr", "inf"], "--lr: must be a finite number", 1,
                                    launcher="torchrun"),
    # Wrong places and launch mistakes: exit 1.
    "keep-best-without-validation": Case(["--keep-best", "val_loss:min", "--val-fraction", "0"],
                                         "--keep-best needs a validation set, and "
                                         "task.build_datasets returned none"),
    "init-method-unknown-scheme": Case(["--init-method", "bogus://x"], "is not one of env, tcp"),
    "init-method-typo": Case(["--init-method", "tpc"], "--init-method 'tpc' is not one of"),
    "init-method-file-host": Case(["--init-method", "file://tmp/x"], "three slashes"),
    "init-method-tcp-no-port": Case(["--init-method", "tcp://host"], "expected tcp://HOST:PORT"),
    "checkpoint-dir-under-a-file": Case(["--checkpoint-dir", "afile/ck"],
                                        "--checkpoint-dir afile/ck: cannot write there",
                                        prepare="afile"),
    "checkpoint-dir-under-a-file-2-ranks": Case(["--checkpoint-dir", "afile/ck"],
                                                "cannot write there", launcher="torchrun",
                                                prepare="afile"),
    # (--epochs 3: the finished run goes on, so it has something to write)
    "output-dir-under-a-file": Case(["--output-dir", "afile/runs", "--epochs", "3"],
                                    "--output-dir afile/runs: cannot write there", prepare="afile"),
    "step-times-under-a-file": Case(["--step-times", "afile/steps.json", "--epochs", "3"],
                                    "--step-times afile/steps.json: cannot write it",
                                    prepare="afile"),
    "resume-garbage": Case(["--resume", "garbage.pt"], "--resume garbage.pt: cannot load it (not "
                           "a checkpoint file: torch.save writes a zip archive",
                           prepare="garbage.pt"),
    "resume-plain-tensors": Case(["--resume", "tensors.pt"], "--resume tensors.pt: cannot load "
                                 "it (not a checkpoint of this project", prepare="tensors.pt"),
    "resume-an-export": Case(["--resume", "export.pt"], "--resume export.pt: cannot load it (an "
                             "export, which holds the model's weights only", prepare="export.pt"),
    "resume-empty-folder": Case(["--resume", "half"], "--resume half: cannot load it (a folder "
                                "without a checkpoint's .metadata", prepare="half"),
    "resume-folder-of-checkpoints": Case(["--resume", "checkpoints"], "--resume checkpoints is a "
                                         "folder of checkpoints, not one; name one of them"),
    "resume-other-model": Case(["--hidden-size", "16"], OTHER_MODEL),
    "resume-other-model-2-ranks": Case(["--hidden-size", "16"], OTHER_MODEL,
                                       launcher="torchrun"),
    "shard-group-size-not-a-divisor": Case(["--model-layout", "fsdp", "--shard-group-size", "3"],
                                           "--shard-group-size 3 must divide the 2 ranks",
                                           launcher="torchrun"),
    "nccl-without-gpus": Case(["--backend", "nccl"], "use --backend gloo"),
    "fp16-on-cpu": Case(["--precision", "fp16"], "--precision fp16 needs CUDA"),
    # (--nprocs under torchrun: test_launchers, with a local rank 0 that is late to say it)
    "local-rank-not-a-number": Case([], "LOCAL_RANK='abc' is not an integer",
                                    env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "abc"}),
    "rank-set-by-hand": Case([], "RANK=1 and WORLD_SIZE=2 are set in the environment but "
                             "LOCAL_RANK is not, so no launcher started this process",
                             env={"RANK": "1", "WORLD_SIZE": "2"}),
    "rank-outside-world": Case([], "torchrun: rank 5 is outside a world of 2 processes",
                               env={"RANK": "5", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                    "TORCHELASTIC_RUN_ID": "x"}),
    "rank-outside-world-set-by-hand": Case([], "RANK=5 is outside a world of WORLD_SIZE=2 "
                                           "processes, and no launcher set them",
                                           env={"RANK": "5", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}),
    # A store nobody runs (nothing listens on port 9): the line names the address as given.
    "tcp-store-not-there": Case(["--init-method", "tcp://127.0.0.1:9", "--timeout-s", "3"],
                                "to join at the TCP store at 127.0.0.1:9",
                                env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}),
    "tcp-store-not-there-ipv6": Case(["--init-method", "tcp://[::1]:9", "--timeout-s", "3"],
                                     "to join at the TCP store at [::1]:9",
                                     env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}),
    "trainjob-pod-without-torchrun": Case([], "PET_NNODES=2 is set (a Kubeflow Trainer v2 pod) "
                                          "but no launcher started this process",
                                          env={"PET_NNODES": "2", "PET_NODE_RANK": "1"}),
    "master-port-not-a-number": Case([], "MASTER_PORT='http' is not an integer",
                                     env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                          "MASTER_PORT": "http"}),
    "disk-full-at-first-save": Case(["--epochs", "3"], "cannot write checkpoint",
                                    prepare="file-size-limit"),
    "model-too-large": Case(["--hidden-size", "1000000"], "task.build_model: out of memory (the "
                            "allocator was asked for "),
    "loss-becomes-nan": Case(["--epochs", "3", "--log-every", "2"], "the loss became nan by step",
                             prepare="nan-after-step-4"),
}

# Launcher variables that make no sense: the process refuses them while it finds out who it is,
# before a store, a thread or a signal handler of the run exists (tested in this process).
WHO_AM_I = {"local-rank-not-a-number", "rank-set-by-hand", "rank-outside-world",
            "rank-outside-world-set-by-hand", "trainjob-pod-without-torchrun",
            "master-port-not-a-number"}

FILES = {
    "bad.toml": "learning-rate = 0.1\n",
    "typed.toml": 'epochs = "two"\n',
    "garbage.pt": "not a checkpoint",
    "afile": "",
}
FULL_DISK = """
import os, resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (12_000, 12_000))  # a disk full at 12 kB a file
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""
NAN_TASK = """
import sys, math
import {{ cookiecutter.package_name }}.main as entry

original, calls = entry.task.loss_fn, [0]

def loss_fn(model, batch):  # a task whose loss goes bad after a while
    calls[0] += 1
    loss = original(model, batch)
    return loss * math.nan if calls[0] > 4 else loss

entry.task.loss_fn = loss_fn
sys.exit(entry.main(sys.argv[1:]))
"""
BAD_SAMPLE_TASK = """
import sys
import {{ cookiecutter.package_name }}.main as entry
from {{ cookiecutter.package_name }}.failures import UsageError


class OneBadSample:  # one sample that cannot be read, as a corrupt file would be
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if i == 3:
            raise UsageError("sample 3 cannot be read")
        return self.data[i]


def build_datasets(cfg):
    train, val = build(cfg)
    return OneBadSample(train), val


build = entry.task.build_datasets
entry.task.build_datasets = build_datasets
if __name__ == "__main__":  # data workers import this file too (they start from a forkserver)
    sys.exit(entry.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A folder with the checkpoints of a run that finished, which each case copies to start
    from (one folder for both xdist workers)."""
    skip_unless_example_task()
    args = BASE[1:] + ["--epochs", "2"]
    return made_once(tmp_path_factory, "finished", lambda folder: ok(python_train(args, folder)))


def prepare(workdir: Path, what: str) -> list[str]:
    """Files for a case; returns the script to run (and its arguments)."""
    if what in FILES:
        (workdir / what).write_text(FILES[what])
    elif what == "tensors.pt":  # a torch.save of something else
        torch.save({"weight": torch.zeros(3), "bias": torch.zeros(1)}, workdir / what)
    elif what == "export.pt":
        newest = list_checkpoints(workdir / "checkpoints")[0]
        ok(run_cmd([sys.executable, "-m", "{{ cookiecutter.package_name }}.checkpoint", "export",
                    str(newest), str(workdir / what)], workdir))
    elif what == "half":
        (workdir / "half").mkdir()
    elif what == "nan-after-step-4":
        (workdir / "nan.py").write_text(NAN_TASK)
        return [str(workdir / "nan.py")]
    elif what == "file-size-limit":
        # Not a preexec_fn: forking this test process, which has threads, can deadlock the child.
        (workdir / "full_disk.py").write_text(FULL_DISK)
        return [str(workdir / "full_disk.py"), TRAIN]
    return [TRAIN]


def in_process(case: Case, workdir: Path, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """A bad flag never gets past argument parsing, nor a bad launcher variable past the process
    finding out who it is: run `main` here instead of in a new Python (the same code path, without
    the second it takes to import torch)."""
    monkeypatch.chdir(workdir)
    for name in LAUNCHER_VARS:  # as child_env: the test's own world is never inherited
        monkeypatch.delenv(name, raising=False)
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    try:
        code = main([*BASE, *case.args])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["main", *case.args], code, captured.out, captured.err)


@pytest.mark.parametrize("name", list(CASES))
def test_mistake(name, finished_run, tmp_path, monkeypatch, capsys):
    case = CASES[name]
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    before = {p: read_meta(p)["step"] for p in list_checkpoints(workdir / "checkpoints")}
    assert before
    script = prepare(workdir, case.prepare)
    if case.launcher == "python" and (case.code == 2 and not case.env or name in WHO_AM_I):
        result = in_process(case, workdir, monkeypatch, capsys)
        assert result.returncode == case.code and case.says in one_error(result)
    else:
        launcher = torchrun_cmd(2) if case.launcher == "torchrun" else [sys.executable]
        started = time.monotonic()
        result = subprocess.run([*launcher, *script, *BASE, *case.args], cwd=workdir,
                                env=child_env(**case.env), capture_output=True, text=True,
                                timeout=120)
        line = one_error(result)  # exactly one error line, no traceback through the project
        assert case.says in line, line
        if case.launcher == "torchrun":  # torchrun's closing box, the last thing printed, says it
            assert line.split("error: ", 1)[1] in result.stderr.split("Root Cause", 1)[1]
        if case.launcher == "python":
            assert result.returncode == case.code
            assert "Traceback" not in result.stderr, result.stderr
        assert time.monotonic() - started < 100
    for path, step in before.items():  # nothing that was there is lost
        assert unreadable(path) is None and read_meta(path)["step"] == step, path


@pytest.mark.fsdp  # trains under fsdp, as the other layout of the default bake
def test_a_complete_run_of_another_layout_names_its_layout(finished_run, tmp_path):
    """Issue 55: the checkpoints of a finished run of one layout, and a command with another:
    not a bare "this run is complete", but whose they are and how to start a run of one's own."""
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    other = "data_parallel" if DEFAULT_MODEL_LAYOUT != "data_parallel" else "fsdp"
    result = ok(python_train([*BASE[1:], "--epochs", "2", "--model-layout", other], workdir))
    assert (f"this run is complete: epoch 2 of 2, step 16; its checkpoints are a --model-layout "
            f"{DEFAULT_MODEL_LAYOUT} run's: give this run its own --run-name or --checkpoint-dir"
            in result.stdout), result.stdout


@pytest.mark.parametrize("what, says", [
    ("garbage.pt", "garbage.pt: cannot load it (not a checkpoint file: torch.save writes a zip"),
    ("tensors.pt", "tensors.pt: cannot load it (not a checkpoint of this project"),
    ("no/such.pt", "no/such.pt: no such file or folder"),
    ("half", "half: cannot load it (a folder without a checkpoint's .metadata")])
def test_predict_on_what_is_not_a_checkpoint_is_one_line(finished_run, tmp_path, what, says):
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    prepare(workdir, what)
    result = run_cmd([sys.executable, str(PROJECT_ROOT / "scripts/predict.py"), what, "input"],
                     workdir)
    assert result.returncode == 1 and says in one_error(result)
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("flag", ["--keep-best", "--early-stop"])
def test_a_misspelt_metric_is_refused_before_training(workdir, flag):
    goal = "val_acc:max" + (":2" if flag == "--early-stop" else "")
    result = python_train([*BASE[1:], flag, goal, "--log-every", "1"], workdir)
    line = one_error(result)
    assert f"{flag} val_acc: the evaluation reports no such metric (it reports val_" in line
    assert " step " not in result.stdout and not list_checkpoints(workdir / "checkpoints")


def test_the_table_is_long_enough():
    assert len(CASES) >= 40


def test_a_rank_stopped_after_its_peers_error_leaves_quietly_with_data_workers(workdir):
    """One rank's data worker cannot read a sample: that rank prints the line, torchrun stops
    the other one with SIGTERM (its whole process group: its data workers too) while it trains or
    starts its workers. That rank leaves without a traceback (it raced with its workers' deaths:
    "DataLoader worker exited unexpectedly" in 2 runs of 10; test_recovery's preemption test
    checks every time that the forkserver and its workers hold the stop signals blocked)."""
    (workdir / "bad_sample.py").write_text(BAD_SAMPLE_TASK)
    for attempt in range(2):
        result = subprocess.run([*torchrun_cmd(2), str(workdir / "bad_sample.py"), *BASE,
                                 "--num-workers", "2", "--resume", "never"], cwd=workdir,
                                env=child_env(), capture_output=True, text=True, timeout=120)
        assert result.returncode != 0
        line = one_error(result)  # one error line, no traceback of the project's
        assert "sample 3 cannot be read" in line, f"attempt {attempt}: {line}"
        assert "DataLoader worker" not in result.stderr, f"attempt {attempt}: {result.stderr}"


# The worst reports, each its own test: these used to hang, loop or delete checkpoints.

def _children(pid: int) -> list[int]:
    """The processes `pid` started (torchrun's workers live in process groups of their own)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def test_file_rendezvous_in_an_output_dir_that_needs_url_escaping(workdir):
    output = "runs/my ré%20sumé 100%"  # a space, accents, an escape-like %20 and a bare %
    ok(torchrun([*BASE[1:], "--init-method", "file", "--output-dir", output], workdir,
                timeout=120))
    assert not list((workdir / output / "rendezvous").iterdir())
    assert not [p for p in workdir.rglob("*%20*") if p.is_file()], "no escaped names left behind"


def test_resuming_mid_epoch_with_less_data_goes_on_with_the_next_epoch(workdir):
    # One process: an epoch's batches and the position in it are counted per rank the same way.
    ok(python_train([*BASE[1:], "--dataset-size", "256", "--max-steps", "5"], workdir))
    result = ok(python_train([*BASE[1:], "--dataset-size", "64", "--epochs", "2"], workdir,
                             timeout=120))
    assert "is 5 batches into epoch 0, which now has 4; going on with epoch 1" in result.stderr
    assert summary(workdir / "runs/latest")["epochs_completed"] == 2


def test_keep_last_never_deletes_another_runs_checkpoints(workdir):
    ok(python_train([*BASE[1:], "--max-steps", "4", "--save-every-steps", "1"], workdir))
    theirs = {p.name for p in list_checkpoints(workdir / "checkpoints")}
    result = ok(python_train([*BASE[1:], "--resume", "never", "--keep-last", "1", "--max-steps",
                              "2", "--save-every-steps", "1"], workdir))
    assert "moved checkpoints of another run" in result.stdout
    mine = [p.name for p in list_checkpoints(workdir / "checkpoints")]
    assert mine == [ckpt_name(2)], "this run keeps its newest"
    aside = [p for p in (workdir / "checkpoints").iterdir() if p.name.startswith("earlier-")]
    assert {p.name for p in aside[0].iterdir()} == theirs, "the other run's are all still there"


def test_a_resumed_run_keeps_what_the_earlier_run_kept_unless_told_otherwise(workdir):
    small = [*BASE[1:], "--save-every-steps", "2"]  # 8 steps an epoch: a checkpoint every 2
    ok(python_train([*small, "--keep-last", "0"], workdir))
    assert len(list_checkpoints(workdir / "checkpoints")) == 4
    # --keep-last left at its default (3): the earlier run's 0 holds, nothing is deleted.
    result = ok(python_train([*small, "--epochs", "2"], workdir))
    assert "note: --keep-last 0, as in the earlier run (give --keep-last to change it)" in \
        result.stdout
    assert len(list_checkpoints(workdir / "checkpoints")) == 8
    # Given, it wins, and the note says it reaches the checkpoints already there.
    result = ok(python_train([*small, "--epochs", "3", "--keep-last", "2"], workdir))
    assert "note: --keep-last 2 given (the earlier run had 0)" in result.stdout
    assert len(list_checkpoints(workdir / "checkpoints")) == 2


def test_two_jobs_sharing_a_checkpoint_dir(workdir):
    first = subprocess.Popen([*torchrun_cmd(2), TRAIN, *BASE, "--epochs", "1000", "--log-every",
                              "1"], cwd=workdir, env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in first.stdout:
            if " step " in line:
                break
        second = torchrun([*BASE[1:], "--output-dir", "runs/second"], workdir, timeout=120)
        line = one_error(second)
        assert "--checkpoint-dir checkpoints is in use by a run that is still going" in line
        assert first.poll() is None, "the first job goes on"
    finally:
        for pid in [*_children(first.pid), first.pid]:  # the workers, then torchrun
            os.kill(pid, 9)
        first.communicate(timeout=120)


def test_a_loss_that_becomes_nan_names_the_newest_good_checkpoint(workdir):
    (workdir / "nan.py").write_text(NAN_TASK)
    result = subprocess.run([sys.executable, str(workdir / "nan.py"), *BASE, "--epochs", "3",
                             "--log-every", "2", "--save-every-steps", "2"], cwd=workdir,
                            env=child_env(), capture_output=True, text=True, timeout=120)
    line = one_error(result)
    assert "the loss became nan by step 6; the newest good checkpoint is" in line
    assert ckpt_name(4) in line
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert all(loss == loss for loss in losses), "nothing after the nan was logged as training"


@pytest.mark.parametrize("layout", ["data_parallel", "fsdp"])
def test_a_loss_that_turns_nan_between_log_steps_is_never_saved(workdir, layout):
    """Issue 55: the loss turns nan at step 5 and the next log step is 20. The save at step 6
    finds it (the loss since the last log and the weights are checked at every save): no
    checkpoint of nan weights is kept, the one the line names is finite, and --keep-last pruned
    no good checkpoint for a bad one. A nan checkpoint from elsewhere is refused at resume."""
    (workdir / "nan.py").write_text(NAN_TASK)
    flags = [*BASE, "--epochs", "3", "--log-every", "20", "--save-every-steps", "2",
             "--keep-last", "3", "--model-layout", layout]
    result = subprocess.run([sys.executable, str(workdir / "nan.py"), *flags], cwd=workdir,
                            env=child_env(), capture_output=True, text=True, timeout=120)
    line = one_error(result)
    assert "the loss became nan by step 6; the newest good checkpoint is" in line, line
    kept = list_checkpoints(workdir / "checkpoints")
    assert [p.name for p in kept] == [ckpt(4, layout), ckpt(2, layout)]
    assert f"checkpoint is checkpoints/{kept[0].name};" in line
    for path in kept:
        assert all(t.isfinite().all() for t in load_state(path)["model"].values())
    if layout == "fsdp":
        return
    bad = load_state(kept[0])
    bad["model"] = {k: v * math.nan for k, v in bad["model"].items()}
    bad["step"] = 50
    torch.save(bad, workdir / "checkpoints" / ckpt(50, layout))
    line = one_error(python_train([*flags[1:]], workdir))
    newest = f"checkpoints/{kept[0].name}"
    assert f"checkpoint checkpoints/{ckpt(50, layout)} holds nan or inf weights" in line, line
    assert f"the newest finite one is {newest}: use --resume {newest}" in line


def ckpt(step: int, layout: str) -> str:
    return f"ckpt_step{step:08d}" + ("" if layout == "fsdp" else ".pt")


def test_what_the_plan_fails_on_the_run_warns_of_in_the_same_words(workdir, capsys):
    """A global batch larger than the data, a warm-up longer than the run and --max-steps beyond
    --epochs: `doctor --plan` fails on each (optim.schedule_problems), the run trains with a
    warning line for each."""
    flags = [*BASE[1:], "--batch-size", "200", "--warmup-steps", "1000", "--max-steps", "5"]
    result = ok(python_train(flags, workdir))
    warned = [line.removeprefix("warning: ") for line in result.stderr.splitlines()
              if line.startswith("warning: ")]
    assert len(warned) == 3, result.stderr
    assert warned[0].startswith("a global batch of 200 samples") and "1000 is longer" in warned[1]
    assert doctor(["--plan", *flags, "--world-size", "1"]) == 1
    planned = " ".join(capsys.readouterr().out.split())  # wrapped for the terminal, joined
    assert all(f"warning: {line}" in planned for line in warned), planned
    assert "FAIL: 3 problem(s) at 1 processes" in planned
