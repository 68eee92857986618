"""No hang: every way a rank can fail to meet its peers ends, on every rank, within --timeout-s
(plus a small margin) with one `error:` line that says what it waited for.

Each case starts real processes by hand, the way a misconfigured cluster would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import TRAIN, child_env
from hosts import UNUSED_ADDRESS

from {{ cookiecutter.package_name }}.runtime.environments import find_free_port

pytestmark = pytest.mark.launchers

TIMEOUT_S = 3
# --timeout-s, the lifeline's margin (2 s + 10 %), and the start-up of a Python process with torch.
LIMIT_S = TIMEOUT_S + 2 + 0.1 * TIMEOUT_S + 12
FLAGS = ["--no-progress", "--epochs", "1", "--dataset-size", "64", "--hidden-size", "8",
         "--timeout-s", str(TIMEOUT_S)]


def start_rank(workdir, rank: int, world: int, port: int, *extra: str) -> subprocess.Popen:
    env = child_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.Popen([sys.executable, TRAIN, *FLAGS, *extra], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen], started: float) -> list[tuple[int, str, float]]:
    """(exit code, output, seconds) of each process; a process still running at LIMIT_S fails."""
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, started + LIMIT_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"still running after {LIMIT_S:.0f} s:\n{out}\n{err}") from None
        results.append((proc.returncode, out + err, time.monotonic() - started))
    return results


def assert_one_error(code: int, output: str, *says: str) -> None:
    errors = [line for line in output.splitlines() if "error:" in line]
    assert code != 0 and len(errors) == 1, f"exit {code}, errors {errors}\n{output}"
    assert "Traceback" not in output, output
    for text in says:
        assert text in errors[0], errors[0]
    print(errors[0])


def test_a_peer_that_never_starts(workdir):
    started = time.monotonic()
    [(code, out, took)] = finish([start_rank(workdir, 0, 2, find_free_port())], started)
    assert_one_error(code, out, "rank 0", "the other 1 rank(s) to join")
    print(f"rank 0 alone: exit after {took:.1f} s")


def test_a_rank_whose_master_never_starts(workdir):
    started = time.monotonic()
    [(code, out, took)] = finish([start_rank(workdir, 1, 2, find_free_port())], started)
    assert_one_error(code, out, "rank 1", "to join at the TCP store at 127.0.0.1")
    print(f"rank 1 alone: exit after {took:.1f} s")


def test_another_program_listening_on_master_port(workdir):
    with socket.socket() as other:  # accepts connections, never answers
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        started = time.monotonic()
        results = finish([start_rank(workdir, 0, 2, port), start_rank(workdir, 1, 2, port)],
                         started)
    (code0, out0, took0), (code1, out1, took1) = results
    assert_one_error(code0, out0, f"port {port} on 127.0.0.1 is already in use")
    assert_one_error(code1, out1, "rank 1", f"127.0.0.1:{port}", "no other program listens")
    print(f"foreign program on the port: rank 0 after {took0:.1f} s, rank 1 after {took1:.1f} s")


def test_two_processes_that_both_claim_rank_0(workdir):
    port = find_free_port()
    started = time.monotonic()
    results = finish([start_rank(workdir, 0, 2, port), start_rank(workdir, 0, 2, port)], started)
    outputs = sorted(results, key=lambda r: "in use" in r[1])
    assert_one_error(*outputs[0][:2], "the other 1 rank(s) to join")
    assert_one_error(*outputs[1][:2], "already in use")


def test_ranks_that_disagree_on_the_world_size(workdir):
    port = find_free_port()
    started = time.monotonic()
    results = finish([start_rank(workdir, 0, 2, port), start_rank(workdir, 1, 3, port)], started)
    for code, out, _ in results:
        assert_one_error(code, out)


@pytest.mark.parametrize("leftover", ["zero-filled", "killed-run"])
def test_a_young_store_file_left_behind(workdir, leftover):
    store = workdir / "store"
    spawn = [sys.executable, TRAIN, *FLAGS, "--nprocs", "2", "--init-method", str(store)]
    if leftover == "zero-filled":
        store.write_bytes(b"\0" * 4096)
    else:  # the keys of a run killed a moment ago: addresses of processes that are gone
        first = subprocess.Popen([*spawn, "--epochs", "1000", "--log-every", "1"], cwd=workdir,
                                 env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True, start_new_session=True)
        for line in first.stdout:
            if " step " in line:
                break
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
        assert store.stat().st_size > 0
    started = time.monotonic()
    proc = subprocess.Popen(spawn, cwd=workdir, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    [(code, out, took)] = finish([proc], started)
    # Either the run copes with the old file, or it ends in time and says what to do.
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 0 or (errors and str(store) in errors[0] and "delete it" in errors[0])
    assert "Traceback" not in out
    print(f"{leftover} store file: exit {code} after {took:.1f} s {errors[:1]}")


@pytest.mark.network
def test_an_unreachable_tcp_address(workdir, hosts):
    """A store address on the test hosts' LAN that no host holds: nothing ever answers."""
    target = f"{UNUSED_ADDRESS}:29999"
    env = child_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    started = time.monotonic()
    proc = hosts[0].popen([sys.executable, TRAIN, *FLAGS, "--init-method", f"tcp://{target}"],
                          cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    [(code, out, took)] = finish([proc], started)
    assert_one_error(code, out, target)
    # torch's socket warnings and retries (with C++ stack frames) go to the run's log.
    assert "frame #" not in out and "[c10d]" not in out, out
    assert "[c10d]" in (workdir / "runs/latest/torch-rank1.log").read_text()
    print(f"unreachable address: exit after {took:.1f} s")


HUNG_STORAGE = """
import sys, time
import {{ cookiecutter.package_name }}.checkpoint.resume as resume
from {{ cookiecutter.package_name }}.main import main

def hang(*args):  # rank 0's storage stops answering while it looks for checkpoints
    time.sleep(3600)

resume.pick_checkpoint = hang
sys.exit(main(sys.argv[1:]))
"""


def test_rank_0_stuck_on_its_checkpoint_storage(workdir):
    script = workdir / "hung.py"
    script.write_text(HUNG_STORAGE)
    port = find_free_port()
    procs = []
    for rank in (0, 1):
        env = child_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), *FLAGS], cwd=workdir, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    started = time.monotonic()
    (code0, out0, _), (code1, out1, _) = finish(procs, started)
    assert_one_error(code0, out0, "rank 0", "open --checkpoint-dir", "its storage answers")
    assert_one_error(code1, out1, "rank 1")
