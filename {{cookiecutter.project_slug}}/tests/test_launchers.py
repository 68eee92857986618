"""Every way of starting the job, each run for real with 2 gloo processes on CPU (and one
in-process check: a bad flag takes the way out that the late-rank-0 run shows)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    PROJECT_ROOT,
    TRAIN,
    child_env,
    ok,
    one_error,
    path_with,
    python_train,
    run_cmd,
    summary,
    torchrun,
    write_store_file,
)

from {{ cookiecutter.package_name }} import settings, task
from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints, read_meta
from {{ cookiecutter.package_name }}.config import parse_args
from {{ cookiecutter.package_name }}.runtime.environments import find_free_port

pytestmark = pytest.mark.launchers

QUICK = ["--epochs", "1", "--dataset-size", "256", "--batch-size", "32", "--hidden-size", "8"]


def start(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, TRAIN, "--no-progress", *args], cwd=cwd,
                            env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_two_spawn_runs_at_the_same_time_both_succeed(workdir):
    runs = [start(["--nprocs", "2", *QUICK, "--output-dir", f"r{i}", "--checkpoint-dir", f"c{i}"],
                  workdir) for i in range(2)]
    for run in runs:
        _, err = run.communicate(timeout=240)
        assert run.returncode == 0, err
    assert summary(workdir / "r0")["launcher"] == summary(workdir / "r1")["launcher"] == "spawn"


def _worker_pids(parent: int) -> list[int]:
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return [int(pid) for pid in children
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers through /proc")
def test_a_killed_spawn_worker_ends_the_run_with_its_error(workdir):
    run = start(["--nprocs", "2", "--epochs", "1000", "--log-every", "1"], workdir)
    for line in run.stdout:  # wait until the workers are training
        if " step " in line:
            break
    workers = _worker_pids(run.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    started = time.monotonic()
    _, err = run.communicate(timeout=120)
    assert run.returncode != 0
    assert time.monotonic() - started < 60, "the surviving worker was not stopped promptly"
    assert "error: worker" in err and "SIGKILL" in err
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or "(Z)" in Path(f"/proc/{pid}/stat").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers through /proc")
def test_ctrl_c_under_spawn_saves_and_exits_130(workdir):
    """Ctrl-C reaches the whole process group: every worker saves, and the run ends with 130 so
    that `python train.py --nprocs 2 ... && next-step` does not go on. The workers meet through
    --init-method file (a new file for the launch, in the output folder), gone afterwards."""
    run = subprocess.Popen([sys.executable, TRAIN, "--no-progress", "--nprocs", "2", "--epochs",
                            "1000", "--log-every", "1", "--init-method", "file"], cwd=workdir,
                           env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)  # a terminal's process group
    for line in run.stdout:
        if " step " in line:
            break
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "stopped by SIGINT at step" in out and "error:" not in err, err
    saved = list_checkpoints(workdir / "checkpoints")
    assert saved and read_meta(saved[0])["world_size"] == 2
    leftovers = [p for p in workdir.rglob("*store*") if p.is_file()]
    assert not leftovers, f"rendezvous files left behind: {leftovers}"


def test_legacy_launch(workdir):
    """It passes --local-rank. (With --use-env it passes LOCAL_RANK instead: its processes then
    see exactly what torchrun's do, which every torchrun run here shows.) Its processes meet
    through a file whose path has a space, accents and a % (a path, not a URL), gone afterwards.
    (--init-method file: test_ctrl_c_under_spawn_saves_and_exits_130. A tcp:// URL is the TCP
    store every spawn run meets at: test_distributed reads the URL in-process, test_mistakes and
    test_network run it, where no store answers and across hosts.)"""
    store = workdir / "my dé jà 100%" / "store"
    cmd = [sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node=2",
           f"--master-port={find_free_port()}", TRAIN, "--no-progress", *QUICK,
           "--init-method", str(store)]
    ok(run_cmd(cmd, workdir))
    done = summary(workdir / "runs/latest")
    assert done["world_size"] == 2 and done["launcher"] == "launch"
    leftovers = [p for p in workdir.rglob("*store*") if p.is_file()]
    assert store.parent.is_dir() and not leftovers, f"rendezvous files left behind: {leftovers}"


def two_nodes(args: list[str], workdir: Path, bin_dir: Path, restarts: int) -> list:
    """scripts/train_multinode.sh on two 'nodes' (both 127.0.0.1), run from `workdir`: each
    node's (exit code, stdout, stderr)."""
    port = find_free_port()
    script = str(PROJECT_ROOT / "scripts/train_multinode.sh")
    env = child_env(PATH=path_with(bin_dir), NPROC="1", RDZV_ID=f"test-{port}",
                    MAX_RESTARTS=str(restarts), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    nodes = [subprocess.Popen(["bash", script, "2", "0", f"127.0.0.1:{port}", *args], env=env,
                              cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True),
             # the second node finds the head through MASTER_ADDR/MASTER_PORT
             subprocess.Popen(["bash", script, "2", "1", "-", *args], env=env, cwd=workdir,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    return [(node.returncode, *out) for node, out in zip(nodes, outputs, strict=True)]


def test_two_torchrun_nodes_on_localhost(workdir, bin_dir):
    """c10d rendezvous; relative paths are read from where the script ran. A mistake every
    process finds ends each node at once with its one line, though torchrun may restart 3 times
    (in a fine-tuning run: the script's check takes --resume weights-only as the newest
    checkpoint, not a folder); a wrong flag is one line on each node before torchrun starts."""
    args = ["--no-progress", *QUICK, "--output-dir", "runs", "--checkpoint-dir", "ck"]
    for code, _, err in two_nodes(args, workdir, bin_dir, restarts=0):
        assert code == 0, err
    done = summary(workdir / "runs")
    assert done["world_size"] == 2 and done["launcher"] == "torchrun" and done["steps"] == 4
    started = time.monotonic()
    mistake = [*args, "--keep-best", "val_nope:max", "--output-dir", "runs2",
               "--resume", "weights-only"]
    for code, out, err in two_nodes(mistake, workdir, bin_dir, restarts=3):
        line = one_error(subprocess.CompletedProcess([], code, out, err))
        assert "--keep-best val_nope: the evaluation reports no such metric" in line
        assert code == 1 and "Traceback" not in err, err
    assert time.monotonic() - started < 120
    for code, out, err in two_nodes(["--epochs", "0"], workdir, bin_dir, restarts=3):
        assert code == 2 and out == "" and err.startswith("error: argument --epochs") \
            and err.count("\n") == 1, err


def test_stale_store_file_is_refused(workdir):
    stale = write_store_file(workdir / "store", key="of a run that was killed")
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    started = time.monotonic()
    line = one_error(python_train(["--nprocs", "2", *QUICK, "--init-method", str(stale)], workdir,
                                  timeout=120))
    assert time.monotonic() - started < 60
    assert f"error: rendezvous file {stale} is left over from an earlier run" in line
    assert stale.exists(), "the user's file is reported, not deleted behind their back"


def test_an_error_every_rank_finds_is_printed_though_local_rank_0_is_late(workdir):
    """On a loaded machine local rank 0 can reach the error seconds after rank 1; rank 1 must
    not exit first (torchrun would stop rank 0 before its line is out)."""
    slow = workdir / "slow_rank_0"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('LOCAL_RANK') == '0':\n    time.sleep(4)\n")
    pythonpath = os.pathsep.join([str(slow), str(PROJECT_ROOT)])
    result = torchrun(["--nprocs", "2", *QUICK], workdir, PYTHONPATH=pythonpath)
    line = one_error(result)
    assert "--nprocs starts processes itself" in line
    # torchrun's closing box, the last thing printed, repeats it
    assert line.split("error: ", 1)[1] in result.stderr.split("Root Cause", 1)[1]


def test_a_bad_flag_leaves_its_line_to_local_rank_0_as_the_errors_every_rank_finds_do(monkeypatch):
    """argparse's errors go out the same way as the error of the run above (say_once_per_node,
    which waits for local rank 0's line): shown here in-process, as local rank 1."""
    said = []
    monkeypatch.setattr(settings, "say_once_per_node", lambda *args: said.append(args))
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--epochs", "x"], getattr(task, "Settings", None))
    assert exc.value.code == 2 and len(said) == 1 and said[0][1] == 1, said
    assert "--epochs: invalid integer value" in said[0][0], said


def test_a_silent_rank_waits_a_bounded_time_for_a_local_rank_0_that_never_prints(workdir):
    """Local rank 0 hangs before it reaches the error: rank 1 stops waiting for its line after
    PRINTER_WAIT_S, and the job ends, with the line in torchrun's closing box."""
    never = workdir / "rank_0_never_prints"
    never.mkdir()
    (never / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('LOCAL_RANK') == '0':\n    time.sleep(600)\n")
    pythonpath = os.pathsep.join([str(never), str(PROJECT_ROOT)])
    started = time.monotonic()
    result = torchrun(["--nprocs", "2", *QUICK], workdir, timeout=120, PYTHONPATH=pythonpath)
    assert result.returncode != 0 and time.monotonic() - started < 90
    assert "--nprocs starts processes itself" in result.stderr.split("Root Cause", 1)[1]


def test_port_in_use_is_one_error_line(workdir):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_error(run_cmd([sys.executable, TRAIN, "--no-progress", *QUICK], workdir,
                                 timeout=120, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    assert line == (f"error: port {port} on 127.0.0.1 is already in use; set MASTER_PORT to a "
                    "free port (or use torchrun --standalone)")
