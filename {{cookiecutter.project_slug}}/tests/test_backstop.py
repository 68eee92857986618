"""No process outlives its deadline, its launcher or a stop signal, whatever it is stuck in.

Real processes, stuck in the ways users meet: a C call that holds the interpreter lock (so no
Python thread can run), a garbage rendezvous file PyTorch spins on, a launcher killed with SIGKILL,
a job store that stops answering while a rank reports its error. Each test checks by pid that no
process of the run is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import child_env, torchrun_cmd

from {{ cookiecutter.package_name }}.runtime.backstop import MARGIN_S, STOP_GRACE_S
from {{ cookiecutter.package_name }}.runtime.environments import find_free_port
from {{ cookiecutter.package_name }}.runtime.rendezvous import store_file_problem

pytestmark = [pytest.mark.recovery,
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="finds the run's processes through /proc")]

TIMEOUT_S = 3
# The lifeline's deadline (--timeout-s + 2 s + 10 %), the backstop's margin, and a Python start
# with torch on a busy 2-core machine.
LIMIT_S = TIMEOUT_S + 2 + 0.1 * TIMEOUT_S + MARGIN_S + 12
FLAGS = ["--no-progress", "--dataset-size", "64", "--hidden-size", "8", "--epochs", "1",
         "--timeout-s", str(TIMEOUT_S)]
LONG = ["--no-progress", "--dataset-size", "4096", "--batch-size", "4", "--hidden-size", "8",
        "--epochs", "1000", "--timeout-s", "5", "--log-every", "1"]

HOOKS = """
import ctypes, os, sys, time
from pathlib import Path
import {{ cookiecutter.package_name }}.checkpoint.checkpointer as checkpointer
import {{ cookiecutter.package_name }}.checkpoint.resume as resume
import {{ cookiecutter.package_name }}.loop as loop
import {{ cookiecutter.package_name }}.runtime.rendezvous as rendezvous
from {{ cookiecutter.package_name }}.failures import UsageError
from {{ cookiecutter.package_name }}.main import main

def hold_the_lock(*args):  # a C call that never releases the interpreter lock
    print("stuck", flush=True)
    ctypes.PyDLL(None).sleep(3600)

def storage_hangs(*args):  # rank 0's storage stops answering (the lock is free)
    print("stuck", flush=True)
    time.sleep(3600)

loss_fn = loop.Trainer._run_batch

def fail_on_request(self, *args, **kwargs):  # rank 1 fails once the test asks for it
    if self.world.rank == 1 and Path("fail-now").exists():
        raise UsageError("rank 1 could not read its data (a test)")
    return loss_fn(self, *args, **kwargs)

if __name__ == "__main__":
    hook = os.environ["HOOK"]
    if hook == "hold-the-lock":
        checkpointer.agree = hold_the_lock  # every rank, inside the resume's deadline
    elif hook == "storage-hangs":
        resume.pick_checkpoint = storage_hangs
    elif hook == "garbage-store-file":
        rendezvous.check_store_file = lambda path: None  # let PyTorch meet it
    elif hook == "fail-on-request":
        loop.Trainer._run_batch = fail_on_request
    sys.exit(main(sys.argv[1:]))
"""


class Run:
    """Processes started with a mark in their environment, so the test finds every process of the
    run (workers, their watchdogs, data workers) by pid, whoever started them."""

    def __init__(self, workdir: Path, hook: str = "none") -> None:
        self.workdir, self.mark = workdir, uuid.uuid4().hex
        self.script = workdir / "hooks.py"
        self.script.write_text(HOOKS)
        self.env = child_env(HOOK=hook, BACKSTOP_TEST_MARK=self.mark)

    def start(self, cmd: list[str], **env: str) -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=self.workdir, env={**self.env, **env}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)

    def python(self, *args: str, **env: str) -> subprocess.Popen:
        return self.start([sys.executable, str(self.script), *args], **env)

    def torchrun(self, *args: str) -> subprocess.Popen:
        return self.start([*torchrun_cmd(2), str(self.script), *args])

    def alive(self) -> list[int]:
        """Pids of the run's processes that still run (a zombie has ended)."""
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if (proc.name.isdigit()
                        and f"BACKSTOP_TEST_MARK={self.mark}".encode()
                        in (proc / "environ").read_bytes()
                        and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                    found.append(int(proc.name))
            except OSError:
                continue
        return found

    def wait_until_gone(self, limit_s: float) -> float:
        started = time.monotonic()
        while self.alive():
            if time.monotonic() - started > limit_s:
                left = self.alive()
                for pid in left:
                    os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"processes {left} still alive after {limit_s:.0f} s")
            time.sleep(0.1)
        return time.monotonic() - started

    def watchdogs(self) -> list[int]:
        return [pid for pid in self.alive()
                if b"backstop.py" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def wait_for(proc: subprocess.Popen, text: str, limit_s: float = 60) -> None:
    """Read the process's stdout until a line holds `text`."""
    started = time.monotonic()
    for line in proc.stdout:
        if text in line:
            return
        assert time.monotonic() - started < limit_s, f"no {text!r} after {limit_s} s"
    raise AssertionError(f"the process ended before printing {text!r}: {proc.stderr.read()}")


def finish(proc: subprocess.Popen, limit_s: float) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"still running after {limit_s:.0f} s:\n{out}\n{err}") from None
    return proc.returncode, out + err


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


# ---------------------------------------------------------------- rendezvous files
def test_store_file_check_knows_a_real_store_file(tmp_path):
    import torch.distributed as dist

    path = tmp_path / "store"
    store = dist.FileStore(str(path), 2)
    store.set("key", "value")
    data = path.read_bytes()
    assert store_file_problem(data) is None
    for cut in (1, 3, 5, len(data) - 1):
        assert store_file_problem(data[:cut]) is not None, cut
    for garbage in (*(bytes(n) for n in (1, 7, 8, 438, 4096)), bytes(range(256)) * 3):
        assert store_file_problem(garbage) is not None, garbage[:16]
    del store


# Every garbage file takes the same path once the check above finds it (its size matters only
# to the check): an empty one (a new store's), the size PyTorch spins on, and random bytes run.
GARBAGE = [("0-zero-bytes", bytes(0), "young"), ("0-zero-bytes", bytes(0), "old"),
           ("438-zero-bytes", bytes(438), "young"), ("438-zero-bytes", bytes(438), "old"),
           ("random-bytes", bytes(range(256)) * 3, "old")]


@pytest.mark.parametrize("name, content, age", GARBAGE, ids=[f"{g[0]}-{g[2]}" for g in GARBAGE])
def test_a_store_file_that_is_not_one_gives_a_safe_start_or_one_error(workdir, name, content,
                                                                      age):
    store = workdir / "store"
    store.write_bytes(content)
    if age == "old":
        os.utime(store, (time.time() - 7200, time.time() - 7200))
    run = Run(workdir)
    if content or age == "young":
        proc = run.python(*FLAGS, "--nprocs", "2", "--init-method", str(store))
    else:  # under torchrun: each launcher's normal run is checked below
        proc = run.torchrun(*FLAGS, "--init-method", str(store))
    code, out = finish(proc, LIMIT_S)
    if content:
        assert code != 0 and len(error_lines(out)) == 1, out
        assert f"rendezvous file {store} is not a store file" in error_lines(out)[0]
        assert "delete it" in error_lines(out)[0] and "Traceback" not in out
    else:  # an empty file is what a new FileStore looks like: the run starts on it, and as
        # every normal run, leaves no process behind (its workers' watchdogs end with them)
        assert code == 0, out
        assert not run.alive()
    run.wait_until_gone(5)


def test_a_garbage_store_file_pytorch_spins_on_is_ended_by_the_backstop(workdir):
    """The check above off: PyTorch spins in FileStore holding the interpreter lock, and only
    the backstop can end the process."""
    store = workdir / "store"
    store.write_bytes(bytes(438))
    run = Run(workdir, "garbage-store-file")
    started = time.monotonic()
    code, out = finish(run.python(*FLAGS, "--init-method", str(store)), LIMIT_S)
    [line] = error_lines(out)
    assert code == -signal.SIGKILL and "stuck in rendezvous past its deadline" in line, out
    assert "stacks-rank0.txt" in line
    stacks = (workdir / "runs/latest/stacks-rank0.txt").read_text()
    assert "_make_store" in stacks, stacks
    run.wait_until_gone(5)
    print(f"garbage store file: ended after {time.monotonic() - started:.1f} s")


# ---------------------------------------------------------------- the interpreter lock
def test_ranks_stuck_in_a_call_that_holds_the_interpreter_lock_end_by_their_deadline(workdir):
    run = Run(workdir, "hold-the-lock")
    started = time.monotonic()
    code, out = finish(run.torchrun(*FLAGS), LIMIT_S + 5)
    took = time.monotonic() - started
    assert code != 0
    backstop = [line for line in error_lines(out) if "ended by the backstop" in line]
    assert backstop and "stuck in checkpoint I/O past its deadline" in backstop[0], out
    stacks = "".join(p.read_text() for p in (workdir / "runs/latest").glob("stacks-rank*.txt"))
    assert "hold_the_lock" in stacks, stacks
    run.wait_until_gone(5)
    print(f"interpreter lock held on both ranks: torchrun ended after {took:.1f} s")


# ---------------------------------------------------------------- stop signals
def started_watching(run: Run, proc: subprocess.Popen, limit_s: float = 60) -> None:
    """Wait until the process's backstop runs: signals are handled from then on."""
    started = time.monotonic()
    while not run.watchdogs():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - started < limit_s
        time.sleep(0.1)
    time.sleep(1.0)


PHASES = {
    # phase: (hook, extra flags, what shows the phase was reached, what the output must say)
    "rendezvous": ("none", [], None, "stopped by SIGTERM during start-up"),
    "store-holding-the-lock": ("garbage-store-file", ["--init-method", "./store"], None,
                               "error: rank 0: stopped by SIGTERM, but the process did not end"),
    "checkpoint-io": ("storage-hangs", [], "stuck", "stopped by SIGTERM during start-up"),
    "training": ("none", LONG, " step ", "stopped by SIGTERM at step"),
}


@pytest.mark.parametrize("phase", PHASES)
def test_sigterm_ends_the_process_within_5_s_in_every_phase(workdir, phase):
    hook, extra, reached, says = PHASES[phase]
    (workdir / "store").write_bytes(bytes(438))
    run = Run(workdir, hook)
    env = {}
    if phase == "rendezvous":  # rank 0 of 2 whose peer never comes
        env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(find_free_port())}
    proc = run.python(*FLAGS, "--timeout-s", "60", *extra, **env)
    if reached:
        wait_for(proc, reached)
    started_watching(run, proc)
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    code, out = finish(proc, 30)
    took = time.monotonic() - signalled
    assert took < STOP_GRACE_S + 1.5, f"{took:.1f} s\n{out}"
    assert says in out and "Traceback" not in out, out
    assert len(error_lines(out)) == (1 if says.startswith("error:") else 0), out
    run.wait_until_gone(5)
    print(f"SIGTERM in {phase}: exit {code} after {took:.1f} s")


def test_a_second_sigterm_ends_the_process_at_once(workdir):
    run = Run(workdir)
    # Log steps (where a stop is agreed) 100000 steps apart, and no epoch's end (which logs)
    # in the meantime: only the second signal ends it.
    proc = run.python(*LONG, "--log-every", "100000", "--save-every-steps", "5",
                      "--dataset-size", "131072")
    while not list((workdir / "checkpoints").glob("ckpt_*")):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.5)  # two separate signals, not one event seen twice
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    code, out = finish(proc, 30)
    assert time.monotonic() - signalled < 1.5, out
    assert code == 128 + signal.SIGTERM and "second SIGTERM: stopping now without saving" in out
    run.wait_until_gone(5)


# ---------------------------------------------------------------- launchers and stores that vanish
def test_workers_whose_torchrun_is_killed_stop_and_leave_no_process(workdir):
    run = Run(workdir)
    job = run.torchrun(*LONG)
    wait_for(job, " step ")
    os.kill(job.pid, signal.SIGKILL)  # the agent only: its workers run in sessions of their own
    killed = time.monotonic()
    took = run.wait_until_gone(5 + 5)
    out, err = job.communicate(timeout=10)
    assert "its launcher" in err and "is gone; stopping this process" in err, err
    assert "stopped by SIGTERM at step" in out, out  # they agreed, saved and left
    assert list((workdir / "checkpoints").glob("ckpt_*"))
    print(f"torchrun SIGKILLed: its workers were gone {took:.1f} s later "
          f"({time.monotonic() - killed:.1f} s)")


def test_a_rank_reports_its_error_while_the_store_host_is_frozen(workdir):
    """torchrun's agent holds the job's store. Frozen (SIGSTOP), it answers nothing: the rank
    that fails and the rank that loses it still end, each with one line, within the deadline."""
    run = Run(workdir, "fail-on-request")
    job = run.torchrun(*LONG)
    wait_for(job, " step ")
    os.kill(job.pid, signal.SIGSTOP)
    try:
        (workdir / "fail-now").touch()
        triggered = time.monotonic()
        while len(run.alive()) > 1:  # only the frozen agent is left
            assert time.monotonic() - triggered < 5 + 10, run.alive()
            time.sleep(0.1)
        took = time.monotonic() - triggered
    finally:
        os.kill(job.pid, signal.SIGCONT)
    code, out = finish(job, 60)
    errors = sorted(error_lines(out))  # one line of each rank
    assert code != 0 and len(errors) == 2, out
    assert errors[0].startswith("error: rank 0 on ") and "lost contact" in errors[0]
    assert errors[1] == (
        "error: rank 1 could not read its data (a test)"), errors
    run.wait_until_gone(5)
    print(f"store host frozen: both ranks ended {took:.1f} s after rank 1's error")
