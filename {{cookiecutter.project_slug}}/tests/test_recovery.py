"""Never lose work: kills, restarts, preemption signals, broken checkpoints, stalls, busy ports.

Every test runs real 2-process gloo jobs and kills real processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TRAIN, child_env, final_model, ok, run_cmd, torchrun

from {{ cookiecutter.package_name }}.checkpoint import list_checkpoints

pytestmark = [pytest.mark.recovery,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds workers through /proc")]

# 32 steps per epoch, 192 in all, a checkpoint every 8 steps: slow enough to kill mid-run.
FLAGS = ["--no-progress", "--dataset-size", "1024", "--batch-size", "16", "--epochs", "6", "--hidden-size", "256",
         "--num-layers", "3", "--save-every-steps", "8", "--keep-last", "0", "--log-every", "1000"]


def start_torchrun(workdir: Path, *extra: str, restarts: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={restarts}", TRAIN, *FLAGS, *extra]
    return subprocess.Popen(cmd, cwd=workdir, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def workers(agent: int) -> dict[int, int]:
    """rank -> pid of the worker processes torchrun started."""
    found = {}
    for task in Path(f"/proc/{agent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(pid)
    return found


def wait_for_checkpoint(directory: Path, min_step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [int(p.name[9:17]) for p in list_checkpoints(directory)]
        if steps and max(steps) >= min_step:
            return
        time.sleep(0.005)
    raise AssertionError(f"no checkpoint of step >= {min_step} in {directory}")


def newest_step(directory: Path) -> int:
    return torch.load(list_checkpoints(directory)[0], map_location="cpu", weights_only=True)["step"]


def assert_same_model(reference: dict, directory: Path) -> None:
    got = final_model(directory)
    assert reference.keys() == got.keys()
    for key, value in reference.items():
        assert torch.equal(value, got[key]), f"{key} differs from the uninterrupted run"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Final parameters of a run that was never interrupted."""
    workdir = tmp_path_factory.mktemp("reference")
    ok(torchrun(FLAGS[1:], workdir))
    return final_model(workdir / "checkpoints")


@pytest.mark.parametrize("kill_after, rank", [(8, 1), (40, 0), (112, 1)],
                         ids=["first-checkpoint-rank1", "mid-epoch-rank0", "late-rank1"])
def test_sigkill_then_resume_is_bit_for_bit(workdir, reference, kill_after, rank):
    job = start_torchrun(workdir)
    wait_for_checkpoint(workdir / "checkpoints", kill_after)
    os.kill(workers(job.pid)[rank], signal.SIGKILL)
    job.communicate(timeout=120)
    assert job.returncode != 0
    resumed_at = newest_step(workdir / "checkpoints")
    assert resumed_at < 192, "the run finished before the kill"
    result = ok(torchrun(FLAGS[1:], workdir))
    assert f"step {resumed_at})" in result.stdout
    print(f"killed rank {rank} after checkpoint {kill_after}; resumed from step {resumed_at}")
    assert_same_model(reference, workdir / "checkpoints")


def test_torchrun_restarts_a_killed_worker_and_finishes(workdir, reference):
    job = start_torchrun(workdir, restarts=2)
    wait_for_checkpoint(workdir / "checkpoints", 16)
    os.kill(workers(job.pid)[1], signal.SIGKILL)
    out, err = job.communicate(timeout=240)
    assert job.returncode == 0, err
    assert "resumed from" in out
    summary = json.loads((workdir / "runs/latest/summary.json").read_text())
    assert summary["steps"] == 192 and summary["resumed_from"]
    assert_same_model(reference, workdir / "checkpoints")


@pytest.mark.parametrize("how", ["SIGTERM-to-torchrun", "SIGUSR1-to-workers"])
def test_preemption_signal_saves_and_exits_cleanly(workdir, reference, how):
    job = start_torchrun(workdir)
    wait_for_checkpoint(workdir / "checkpoints", 24)
    if how == "SIGTERM-to-torchrun":
        os.kill(job.pid, signal.SIGTERM)  # torchrun forwards it to its workers
    else:
        for pid in workers(job.pid).values():  # SLURM's --signal reaches every task
            os.kill(pid, signal.SIGUSR1)
    out, err = job.communicate(timeout=120)
    name = how.split("-")[0]
    assert f"stopped by {name} at step" in out, err
    stopped_at = int(out.split(f"stopped by {name} at step ")[1].split(":")[0])
    assert newest_step(workdir / "checkpoints") == stopped_at < 192
    # torchrun prints its own traceback when it is signalled; the workers must not crash.
    assert "{{ cookiecutter.package_name }}/" not in err, err
    if how == "SIGUSR1-to-workers":
        assert job.returncode == 0
    ok(torchrun(FLAGS[1:], workdir))
    assert_same_model(reference, workdir / "checkpoints")


def test_truncated_newest_checkpoint_falls_back_to_the_previous(workdir):
    ok(torchrun(["--dataset-size", "512", "--epochs", "2"], workdir))  # checkpoints at steps 8 and 16
    newest = workdir / "checkpoints/ckpt_step00000016.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # as if the machine died during a copy
    result = ok(torchrun(["--dataset-size", "512", "--epochs", "3"], workdir))
    assert "warning: skipping unreadable checkpoint" in result.stderr
    summary = json.loads((workdir / "runs/latest/summary.json").read_text())
    assert summary["resumed_from"].endswith("ckpt_step00000008.pt") and summary["steps"] == 24


def test_mid_epoch_checkpoint_resumes_with_another_world_size(workdir):
    ok(torchrun(["--dataset-size", "512", "--batch-size", "16", "--epochs", "2", "--max-steps", "20"], workdir))
    # 16 steps per epoch with 2 ranks: step 20 is 4 batches (128 samples) into the second epoch.
    result = ok(run_cmd([sys.executable, TRAIN, "--no-progress", "--dataset-size", "512", "--batch-size", "16",
                         "--epochs", "2"], workdir))
    assert "continuing epoch 1 after 128 of the 128 samples already seen" in result.stderr
    summary = json.loads((workdir / "runs/latest/summary.json").read_text())
    assert summary["world_size"] == 1 and summary["epochs_completed"] == 2
    assert summary["steps"] == 20 + (32 - 8)  # the rest of the epoch in batches of 16 on one process


UNEVEN = """
import sys
import {{ cookiecutter.package_name }}.train as entry
from {{ cookiecutter.package_name }}.data import synthetic_regression
from {{ cookiecutter.package_name }}.distributed import resolve_world

# Custom data whose shards differ in length: rank 1 sees 96 fewer samples (3 fewer batches of 16).
rank = resolve_world().rank
entry.build_datasets = lambda path, size, seed, val: (synthetic_regression(size - 192 * rank, seed), None)
sys.exit(entry.main(sys.argv[1:]))
"""


def test_uneven_batch_counts_end_cleanly(workdir):
    script = workdir / "uneven.py"
    script.write_text(UNEVEN)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           "--no-progress", "--dataset-size", "1024", "--batch-size", "16", "--epochs", "2", "--timeout-s", "20"]
    started = time.monotonic()
    ok(run_cmd(cmd, workdir, timeout=120))
    assert time.monotonic() - started < 60
    summary = json.loads((workdir / "runs/latest/summary.json").read_text())
    assert summary["steps"] == 2 * 26  # every rank ran the smaller count: 832 / 2 / 16 = 26


def test_a_stalled_rank_is_named_within_the_timeout(workdir):
    job = start_torchrun(workdir, "--timeout-s", "5", "--epochs", "1000")
    wait_for_checkpoint(workdir / "checkpoints", 8)
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


def test_port_in_use_is_one_error_line(workdir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cmd([sys.executable, TRAIN, "--no-progress", "--epochs", "1"], workdir, timeout=120,
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: port {port} on 127.0.0.1 is already in use; set MASTER_PORT to a free port "
                      "(or use torchrun --standalone)"]
