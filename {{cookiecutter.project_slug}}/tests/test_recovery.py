"""Never lose work: kills, restarts, preemption signals, broken checkpoints, stalls.

Every test runs real 2-process gloo jobs and kills real processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    TRAIN,
    assert_same_model,
    child_env,
    ckpt_name,
    descendants,
    final_model,
    made_once,
    ok,
    python_train,
    run_cmd,
    skip_unless_example_task,
    summary,
    torchrun,
    torchrun_cmd,
    workers,
)

from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints, read_meta
from {{ cookiecutter.package_name }}.config import DEFAULT_MODEL_LAYOUT, SHARDED
from {{ cookiecutter.package_name }}.runtime.environments import find_free_port

pytestmark = [pytest.mark.recovery,
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="finds workers through /proc")]

# 16 steps an epoch, 64 in all, a checkpoint every 4 steps: slow enough to kill mid-run.
FLAGS = ["--no-progress", "--dataset-size", "512", "--batch-size", "16", "--epochs", "4",
         "--hidden-size", "64", "--save-every-steps", "4", "--keep-last", "0",
         "--log-every", "1000"]
LAST_STEP = 64


def start_torchrun(workdir: Path, *extra: str, restarts: int = 0,
                   quietly: bool = False) -> subprocess.Popen:
    """torchrun, or (`quietly`) the scripts' torchrun: runtime/workarounds.py's, in one process."""
    cmd = [*torchrun_cmd(2, f"--max-restarts={restarts}"), TRAIN, *FLAGS, *extra]
    if quietly:
        cmd[1:3] = ["-m", "{{ cookiecutter.package_name }}.runtime.workarounds", "torchrun"]
    return subprocess.Popen(cmd, cwd=workdir, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_checkpoint(directory: Path, min_step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [int(p.name[9:17]) for p in list_checkpoints(directory)]
        if steps and max(steps) >= min_step:
            return
        time.sleep(0.005)
    raise AssertionError(f"no checkpoint of step >= {min_step} in {directory}")


def newest_step(directory: Path) -> int:
    return read_meta(list_checkpoints(directory)[0])["step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Final parameters of a run that was never interrupted (one for both xdist workers)."""
    skip_unless_example_task()
    workdir = made_once(tmp_path_factory, "recovery", lambda f: ok(torchrun(FLAGS[1:], f)))
    return final_model(workdir / "checkpoints")


def your_task_flags() -> list[str]:
    """8 steps of task.py as it is: its defaults, or the flags its TEST_FLAGS names (a small model,
    a sample of your data); skips, saying why, where those cannot train."""
    from {{ cookiecutter.package_name }} import task
    from {{ cookiecutter.package_name }}.config import parse_args

    named = list(getattr(task, "TEST_FLAGS", []))
    flags = [*named, "--max-steps", "8", "--save-every-steps", "2", "--keep-last", "0",
             "--log-every", "1000"]
    try:
        task.build_datasets(parse_args(flags, getattr(task, "Settings", None)))
    except (Exception, SystemExit) as exc:
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
        pytest.skip(f"task.py does not train with {named or 'its defaults'} ({why}): name the "
                    "flags of a few quick steps in task.py's TEST_FLAGS")
    return flags


@pytest.mark.quick  # the default tier's real kill and resume, of the task.py you have
def test_your_task_resumes_bit_for_bit_after_a_sigkill(tmp_path):
    """A run of task.py's own (your_task_flags) loses a worker to SIGKILL once its checkpoint of
    step 2 is written, resumes from that checkpoint (the later ones, if the kill came after
    them, removed), and ends with the weights of a run never killed."""
    flags = your_task_flags()
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir()
    killed.mkdir()
    ok(torchrun(flags, whole, timeout=300))
    job = subprocess.Popen([*torchrun_cmd(2), TRAIN, "--no-progress", *flags], cwd=killed,
                           env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    while job.poll() is None and not [p for p in list_checkpoints(killed / "checkpoints")
                                      if p.name >= ckpt_name(2)]:
        time.sleep(0.01)
    with contextlib.suppress(OSError, KeyError):  # unless the run ended first (a quick task)
        os.kill(workers(job.pid)[1], signal.SIGKILL)
    job.communicate(timeout=120)
    for later in [p for p in list_checkpoints(killed / "checkpoints") if p.name > ckpt_name(2)]:
        shutil.rmtree(later) if later.is_dir() else later.unlink()
    assert newest_step(killed / "checkpoints") == 2
    assert "step 2)" in ok(torchrun(flags, killed, timeout=300)).stdout
    assert_same_model(final_model(whole / "checkpoints"),
                      final_model(killed / "checkpoints"))


# Rank 1 killed, torchrun restarting it: test_torchrun_restarts_a_killed_worker_and_finishes.
@pytest.mark.parametrize("kill_after, rank", [(20, 0)], ids=["mid-epoch-rank0"])
def test_sigkill_then_resume_is_bit_for_bit(workdir, reference, kill_after, rank):
    job = start_torchrun(workdir)
    wait_for_checkpoint(workdir / "checkpoints", kill_after)
    os.kill(workers(job.pid)[rank], signal.SIGKILL)
    job.communicate(timeout=120)
    assert job.returncode != 0
    resumed_at = newest_step(workdir / "checkpoints")
    assert resumed_at < LAST_STEP, "the run finished before the kill"
    result = ok(torchrun(FLAGS[1:], workdir))
    assert f"step {resumed_at})" in result.stdout
    assert_same_model(reference, final_model(workdir / "checkpoints"))


POWERSGD = ["--comm-hook", "powersgd", "--powersgd-warmup-steps", "3", "--bucket-cap-mb", "0.01"]


def test_torchrun_restarts_a_killed_worker_and_finishes(workdir, request):
    """As scripts/train_local.sh runs torchrun, which restarts only for what a restart cures: the
    restarted workers resume from the newest checkpoint and end with the uninterrupted run's
    weights bit for bit. With DDP (fsdp has no comm hooks) both runs use PowerSGD, whose state
    the checkpoints must hold for that: check_powersgd_state."""
    hook = [] if DEFAULT_MODEL_LAYOUT in SHARDED else POWERSGD
    if hook:
        ok(torchrun([*FLAGS[1:], *hook, "--checkpoint-dir", "uninterrupted"], workdir))
        expected = final_model(workdir / "uninterrupted")
    else:
        expected = request.getfixturevalue("reference")
    job = start_torchrun(workdir, *hook, restarts=2, quietly=True)
    wait_for_checkpoint(workdir / "checkpoints", 20)
    os.kill(workers(job.pid)[1], signal.SIGKILL)
    out, err = job.communicate(timeout=240)
    assert job.returncode == 0, err
    assert "resumed from" in out
    done = summary(workdir / "runs/latest")
    assert done["steps"] == LAST_STEP and done["resumed_from"]
    assert_same_model(expected, final_model(workdir / "checkpoints"))
    if hook:
        check_powersgd_state(workdir, workdir / done["resumed_from"], expected)


def check_powersgd_state(workdir: Path, resumed_from: Path, expected: dict) -> None:
    """PowerSGD's error feedback (each rank's) and its factors are in the checkpoint the restarted
    workers resumed from (bit for bit, though their DDP's first step has one bucket of everything
    where the first run had several). A resume from it that starts PowerSGD afresh ends
    elsewhere."""
    state = torch.load(resumed_from, weights_only=True)
    assert state["step"] < LAST_STEP, "the run finished before the kill"
    assert state["comm_hook"]["iter"] == state["step"]  # one exchange a step
    assert state["comm_hook"]["values"].shape[0] == 2  # both ranks' error feedback
    assert len(state["comm_hook"]["layout"]) > 1  # several buckets
    fresh = workdir / "fresh"
    fresh.mkdir()
    del state["comm_hook"]
    torch.save(state, fresh / resumed_from.name)
    ok(torchrun([*FLAGS[1:], *POWERSGD, "--checkpoint-dir", "fresh"], workdir))
    afresh = final_model(fresh)
    assert not all(torch.equal(afresh[k], expected[k]) for k in expected)


def read_proc(pid: int, name: str) -> bytes:
    """/proc/<pid>/<name>, or nothing for a process that just ended."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def blocked_signals(pid: int) -> int:
    """The process's blocked-signal mask (SigBlk), or -1 for a process that just ended."""
    for line in read_proc(pid, "status").decode().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    return -1


def assert_data_workers_hold_stop_signals(job: subprocess.Popen) -> None:
    """Each rank's forkserver (and the data workers it forks) holds SIGTERM and SIGUSR1 blocked:
    a signal to every process leaves the stop to the training process."""
    servers = {pid: blocked_signals(pid) for pid in descendants(job.pid)
               if b"multiprocessing.forkserver" in read_proc(pid, "cmdline")}
    assert len(servers) >= 2, servers
    stops = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGUSR1 - 1))
    assert all(mask & stops == stops for mask in servers.values() if mask >= 0), servers


def stopped_cleanly(job: subprocess.Popen, name: str, checkpoints: Path, last_step: int) -> int:
    """Wait for a job stopped by signal `name`; the step it stopped and saved at."""
    out, err = job.communicate(timeout=120)
    assert f"stopped by {name} at step" in out, err
    stopped_at = int(out.split(f"stopped by {name} at step ")[1].split(":")[0])
    assert newest_step(checkpoints) == stopped_at < last_step
    assert "{{ cookiecutter.package_name }}/" not in err, err
    # The workers exit with 128 + the signal; torchrun does not pass that through: it exits 1
    # (stopped itself, or its workers exited non-zero).
    assert job.returncode == 1, err
    return stopped_at


@pytest.mark.parametrize("how", ["SIGUSR1-to-rank-1", "SIGINT-to-all",
                                 "SIGTERM-to-torchrun-data-workers"])
def test_preemption_signal_saves_and_exits_cleanly(workdir, how):
    """With data workers too: torchrun signals each training process's whole process group, so the
    workers get the signal as well. They leave it to the training process (which needs them for the
    batches up to its next log step, where it saves). A signal to one rank alone stops every rank,
    and rank 0 names it (signals reach ranks at different steps: each rank's goes into the log
    step's all_reduce). SLURM's signal to every process of the step, and the resume from the
    checkpoint a stop saves, bit for bit:
    test_per_sample_workers_with_random_augmentation_resume_bit_for_bit."""
    workers_flags = ["--num-workers", "2"] if how.endswith("data-workers") else []
    job = start_torchrun(workdir, "--log-every", "2", *workers_flags)
    wait_for_checkpoint(workdir / "checkpoints", 12)
    if workers_flags:
        assert_data_workers_hold_stop_signals(job)
    name = how.split("-")[0]
    if how.startswith("SIGTERM-to-torchrun"):
        os.kill(job.pid, signal.SIGTERM)  # torchrun forwards it to its workers
    elif how == "SIGUSR1-to-rank-1":
        os.kill(workers(job.pid)[1], signal.SIGUSR1)
    else:
        os.killpg(job.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group
    stopped_cleanly(job, name, workdir / "checkpoints", LAST_STEP)


def test_a_second_ctrl_c_exits_at_once(workdir):
    # One long epoch of single-sample steps: nothing ends it before the second Ctrl-C.
    job = subprocess.Popen([sys.executable, TRAIN, *FLAGS, "--dataset-size", "8192",
                            "--batch-size", "1", "--log-every", "100000"], cwd=workdir,
                           env=child_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(workdir / "checkpoints", 4)
    job.send_signal(signal.SIGINT)
    time.sleep(1.5)  # two separate presses, not one key event seen twice
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 130 and "second Ctrl-C: stopping now without saving" in err
    assert "Traceback" not in err


def test_a_stop_signal_during_start_up_exits_cleanly(workdir):
    # Rank 0 of a world of 2 whose peer never comes: it waits in the rendezvous.
    port = find_free_port()
    job = subprocess.Popen([sys.executable, TRAIN, *FLAGS], cwd=workdir, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=child_env(
                               RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=str(port)))
    # Its store listening shows it is in the rendezvous (a fixed pause could end while a loaded
    # machine still imports torch, before any handler is in place).
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and job.poll() is None:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    time.sleep(0.5)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 143, err
    assert "stopped by SIGTERM during start-up, before the first training step" in err
    assert "Traceback" not in err and "error:" not in err


def test_truncated_newest_checkpoint_falls_back_to_a_mid_epoch_one_of_another_world_size(workdir):
    """A run of 1 process whose newest checkpoint is cut short, as if the machine died during a
    copy: 2 processes resume from the one before (rank 0 chooses it, both load it), which is part
    way through an epoch, and go on after the samples it had seen."""
    args = ["--dataset-size", "512", "--batch-size", "16", "--hidden-size", "16", "--epochs", "2"]
    ok(python_train([*args, "--save-every-steps", "4", "--max-steps", "40"], workdir))
    newest = workdir / "checkpoints" / ckpt_name(40)
    damaged = newest / ".metadata" if newest.is_dir() else newest
    damaged.write_bytes(damaged.read_bytes()[:1000])
    result = ok(torchrun(args, workdir))
    assert "warning: skipping unreadable checkpoint" in result.stderr
    # 32 steps an epoch on 1 process: step 36 is 4 batches (64 samples) into the second epoch.
    assert "continuing epoch 1 after 64 of the 64 samples already seen" in result.stderr
    done = summary(workdir / "runs/latest")
    assert done["resumed_from"].endswith(ckpt_name(36))
    assert done["world_size"] == 2 and done["epochs_completed"] == 2
    assert done["steps"] == 36 + (16 - 2)  # the rest of the epoch in batches of 2 x 16


UNEVEN = """
import sys
import {{ cookiecutter.package_name }}.main as entry
from {{ cookiecutter.package_name }}.runtime.environments import resolve_world

# Data whose shards differ in length: rank 1 sees 96 fewer samples (3 fewer batches of 16).
rank = resolve_world().rank
build = entry.task.build_datasets

def fewer(cfg):
    cfg.task.dataset_size -= 192 * rank
    return build(cfg)

entry.task.build_datasets = fewer
sys.exit(entry.main(sys.argv[1:]))
"""


def test_uneven_batch_counts_end_cleanly(workdir):
    script = workdir / "uneven.py"
    script.write_text(UNEVEN)
    cmd = [*torchrun_cmd(2), str(script), "--no-progress", "--dataset-size", "1024", "--batch-size",
           "16", "--hidden-size", "16", "--epochs", "2", "--timeout-s", "20", "--val-fraction", "0"]
    started = time.monotonic()
    ok(run_cmd(cmd, workdir, timeout=120))
    assert time.monotonic() - started < 60
    assert summary(workdir / "runs/latest")["steps"] == 2 * 26  # 832 / 2 / 16 = 26 each


def test_a_stalled_rank_is_named_within_the_timeout(workdir):
    job = start_torchrun(workdir, "--timeout-s", "5", "--epochs", "1000")
    wait_for_checkpoint(workdir / "checkpoints", 4)
    pids = workers(job.pid)
    os.kill(pids[1], signal.SIGSTOP)
    stalled_at = time.monotonic()
    try:
        error = ""
        for line in job.stderr:
            if line.startswith("error:"):
                error = line
                break
        elapsed = time.monotonic() - stalled_at
    finally:
        for pid in [job.pid, *pids.values()]:  # workers run in process groups of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.communicate(timeout=60)
    assert "rank(s) that stopped answering: 1" in error
    assert elapsed < 5 + 15, f"took {elapsed:.1f}s to notice"


def kill_all(job: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers at once, whatever they were doing."""
    for pid in [*workers(job.pid).values(), job.pid]:
        os.kill(pid, signal.SIGKILL)
    job.communicate(timeout=60)


def test_sigkill_during_a_background_save_leaves_a_loadable_newest_checkpoint(workdir):
    job = start_torchrun(workdir, "--async-save", "--save-every-steps", "1", "--epochs", "1000")
    wait_for_checkpoint(workdir / "checkpoints", 6)
    kill_all(job)
    newest = list_checkpoints(workdir / "checkpoints")[0]
    assert read_meta(newest)["step"] >= 6
    # Loaded by 1 process (its loading is all that is checked here): every rank's part of it.
    result = ok(python_train([*FLAGS[1:], "--max-steps", "1"], workdir))
    assert f"resumed from checkpoints/{newest.name}" in result.stdout


PER_SAMPLE = """
import sys
import torch
from torch.utils.data import Dataset
import {{ cookiecutter.package_name }}.main as entry

class Augmented(Dataset):
    # The task's samples one at a time (no __getitems__), with random noise added: what
    # reading and augmenting images from disk in worker processes looks like to the project.
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        sample = self.data[i]
        items = sample if isinstance(sample, tuple) else (sample,)
        jittered = tuple(t + 0.01 * torch.randn(t.shape) if t.is_floating_point() else t
                         for t in items)
        return jittered if isinstance(sample, tuple) else jittered[0]

def build_datasets(cfg):
    train, val = build(cfg)
    return Augmented(train), val

build = entry.task.build_datasets
entry.task.build_datasets = build_datasets
if __name__ == "__main__":  # data workers import this file too (they start from a forkserver)
    sys.exit(entry.main(sys.argv[1:]))
"""


def test_per_sample_workers_with_random_augmentation_resume_bit_for_bit(workdir):
    """a is never interrupted. b is stopped by SIGUSR1 to every process (what `scancel --signal`
    does: the data workers get it too), resumed, SIGKILLed mid-epoch and resumed again: it ends
    with a's weights bit for bit, each data worker's random noise included."""
    script = workdir / "per_sample.py"
    script.write_text(PER_SAMPLE)
    flags = [*FLAGS, "--num-workers", "2", "--epochs", "2"]  # 32 steps

    def start(folder: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([*torchrun_cmd(2), str(script), *flags, "--checkpoint-dir", folder,
                                 *extra], cwd=workdir, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    uninterrupted = start("a")
    out, err = uninterrupted.communicate(timeout=240)
    assert uninterrupted.returncode == 0, err
    job = start("b", "--log-every", "2")  # a stop saves at the next log step
    wait_for_checkpoint(workdir / "b", 12)
    assert_data_workers_hold_stop_signals(job)
    for pid in descendants(job.pid):
        os.kill(pid, signal.SIGUSR1)
    stopped_at = stopped_cleanly(job, "SIGUSR1", workdir / "b", 32)
    job = start("b")
    wait_for_checkpoint(workdir / "b", max(20, stopped_at + 1))  # mid-epoch: 16 steps an epoch
    kill_all(job)
    resumed = start("b")
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0 and "resumed from" in out, err
    assert_same_model(final_model(workdir / "a"), final_model(workdir / "b"))
