"""Ray Train (launcher=ray): scripts/train_ray.py on a real local Ray cluster.

One cluster for the file (`ray start --head`, 2 CPUs, on 127.0.0.1, no dashboard): a 2-worker run
that trains and reports to Ray, a worker SIGKILLed mid-run that Ray restarts and that ends with the
uninterrupted run's weights bit for bit, Ctrl-C on the driver (the workers save; frozen workers
that never do: the driver's unsaved line within its bound, and Ray ends them), and the
mistakes that end with one line: a flag typo, a mistake the workers find (no restart), too few
CPUs, no cluster, the cluster killed mid-run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import (
    PROJECT_ROOT,
    assert_same_model,
    child_env,
    error_lines,
    final_model,
    ok,
    one_error,
    project_copy,
    read_metrics,
    run_cmd,
    skip_unless_example_task,
    summary,
)

from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints, read_meta
from {{ cookiecutter.package_name }}.runtime.backstop import STOP_SAVE_S
from {{ cookiecutter.package_name }}.runtime.environments import find_free_port

pytestmark = [pytest.mark.full,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="needs Ray Train: pip install -e \".[ray]\""),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="finds Ray's processes through /proc")]

SCRIPT = str(PROJECT_ROOT / "scripts" / "train_ray.py")
# As test_recovery.py: 16 steps an epoch, 64 in all, a checkpoint every 4 steps.
FLAGS = ["--no-progress", "--dataset-size", "512", "--batch-size", "16", "--epochs", "4",
         "--hidden-size", "64", "--save-every-steps", "4", "--keep-last", "0",
         "--log-every", "1000"]
LAST_STEP = 64
# Ray's one-machine mode: every address is 127.0.0.1 (`ray start` would advertise the node's IP).
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def cluster_processes(temp: str) -> list[int]:
    """The processes of the Ray cluster whose files are in `temp`: named on their command line,
    or open (logs, sockets; Ray's agents rewrite their command line, its workers are groups of
    their own)."""
    def ours(pid: str) -> bool:
        try:
            if temp.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
            return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(temp)
                       for fd in os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            return False  # gone meanwhile

    return [int(pid) for pid in os.listdir("/proc")
            if pid.isdigit() and int(pid) != os.getpid() and ours(pid)]


def train_workers(temp: str) -> list[int]:
    """The Ray Train workers of the cluster in `temp` (their output goes to its logs)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if (Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RayTrainWorker")
                    and os.readlink(f"/proc/{pid}/fd/1").startswith(temp)):
                found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def cluster() -> dict[str, str]:
    """A Ray cluster of 2 CPUs for this file; the variables that reach it, and its folder. Ended
    by killing its own processes (`ray stop` would stop every cluster on the machine)."""
    skip_unless_example_task()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must be short
    port = find_free_port()
    try:
        started = subprocess.run(
            [str(Path(sys.executable).with_name("ray")), "start", "--head", "--node-ip-address",
             "127.0.0.1", "--port", str(port), "--num-cpus", "2", "--disable-usage-stats",
             "--include-dashboard=false", "--temp-dir", temp],
            env=child_env(**LOOPBACK), capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr
        yield {"RAY_ADDRESS": f"127.0.0.1:{port}", "temp": temp}
    finally:
        for pid in cluster_processes(temp):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def ray_env(cluster: dict[str, str]) -> dict[str, str]:
    return child_env(**LOOPBACK, RAY_ADDRESS=cluster["RAY_ADDRESS"])


def train_ray(args: list[str], cwd: Path, cluster: dict[str, str], timeout: float = 240,
              **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, env={**ray_env(cluster), **env},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory) -> dict:
    """A 2-worker run that was never interrupted: it trains, in Ray's process group, and reports
    to Ray; its final weights. Variables set for the driver alone (a documented one, and one
    named by --env) reach the workers, which Ray starts from the cluster's environment."""
    workdir = tmp_path_factory.mktemp("reference")
    result = ok(train_ray(["--workers", "2", "--env", "MY_TASK_SETTING", *FLAGS], workdir, cluster,
                          AWS_ENDPOINT_URL="http://127.0.0.1:9", MY_TASK_SETTING="x"))
    assert "world: 2 process(es), launcher ray, backend gloo" in result.stdout + result.stderr
    passed = re.search(r"ray: passing (.*) to the workers \(docs/launching.md\)", result.stdout)
    assert passed and {"AWS_ENDPOINT_URL", "MY_TASK_SETTING"} <= set(passed[1].split(", "))
    # Rank 0's worker has each (the cluster was started without them).
    assert f"ray: the workers have {passed[1]} of the driver's {passed[1]}" in result.stdout
    done = summary(workdir / "runs/latest")
    assert done["steps"] == LAST_STEP and done["world_size"] == 2
    assert [r["step"] for r in read_metrics(workdir / "runs/latest")] == [16, 32, 48, 64]
    # Ray Train logs each report it takes (rank 0's metrics line, sent by every rank).
    assert "metrics={'step': 64, 'epoch': 3, 'loss'" in result.stderr + result.stdout
    return final_model(workdir / "checkpoints")


def test_trains_in_rays_process_group_and_reports_to_ray(reference):
    assert reference  # the `reference` fixture's run, checked there


def test_a_killed_worker_is_restarted_and_ends_bit_for_bit(cluster, reference, tmp_path):
    """SIGKILL a worker once step 20 is saved: Ray restarts the group (--max-restarts 1), which
    resumes from the project's newest checkpoint, as under torchrun."""
    job = subprocess.Popen([sys.executable, SCRIPT, "--workers", "2", "--max-restarts", "1",
                            *FLAGS], cwd=tmp_path, env=ray_env(cluster),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not any(read_meta(p)["step"] >= 20 for p in list_checkpoints(tmp_path / "checkpoints")
                      if p.suffix == ".pt"):
            assert job.poll() is None, job.communicate()
            time.sleep(0.01)
        workers = train_workers(cluster["temp"])
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        out, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out + err
    assert "resumed from" in out, out + err
    # docs/launching.md: Ray's own messages (its controller's, the lost worker's traceback) go to
    # stderr and the run's lines to stdout, so `2>ray.log` leaves the run's alone on the screen.
    assert "(TrainController" in err and "(TrainController" not in out, out
    assert "Traceback" not in out, out
    assert summary(tmp_path / "runs/latest")["steps"] == LAST_STEP
    assert_same_model(reference, final_model(tmp_path / "checkpoints"))


def test_a_mistake_a_worker_finds_is_one_line_and_no_restart(cluster, tmp_path):
    # --init-method is checked in the workers (where ranks meet), not by the driver.
    result = train_ray(["--workers", "2", "--max-restarts", "2", "--epochs", "1",
                        "--dataset-size", "64", "--init-method", "bogus"], tmp_path, cluster)
    assert result.returncode == 1
    assert "--init-method 'bogus' is not one of" in one_error(result)
    output = result.stdout + result.stderr
    assert output.count("Started training worker group") == 1, output  # no restart


def test_rays_own_log_lines_are_not_counted_as_errors_of_the_run():
    # Seen in CI: the cluster's gcs_server logged this while the job shut down, after the
    # worker's one line; counted, the one-line check failed one run in some.
    worker = "\x1b[36m(RayTrainWorker pid=29166)\x1b[0m error: --init-method 'bogus' is not one of"
    gcs = ("\x1b[36m(pid=gcs_server)\x1b[0m [2026-12-06 16:31:36,807 E 25278 25278] (gcs_server) "
           "gcs_actor_scheduler.cc:538: Failed to kill actor d6b9, return status: Invalid: "
           "KillActor RPC failed for actor d6b9: RpcError: RPC error: Socket closed rpc_code: 14")
    argparse = "train_ray.py: error: unrecognized arguments: --epoch 3"
    remote = "(RayTrainWorker pid=7, ip=10.0.0.2) error: rank 1: waited 60 s (--timeout-s)"
    output = "\n".join([worker, gcs, argparse, remote])
    result = subprocess.CompletedProcess([], 1, stdout=output, stderr="")
    assert error_lines(result) == [worker, argparse, remote]


def test_a_flag_typo_is_one_line_before_ray_starts(cluster, tmp_path):
    result = train_ray(["--workers", "2", "--epoch", "3"], tmp_path, cluster, timeout=60)
    assert result.returncode == 2
    assert "unrecognized arguments: --epoch 3" in one_error(result)
    result = train_ray(["--workers", "2:x"], tmp_path, cluster, timeout=60)
    assert result.returncode == 2 and "--workers" in one_error(result)
    result = train_ray(["--env", "NOT_SET_HERE"], tmp_path, cluster, timeout=60)
    assert result.returncode == 2 and "--env NOT_SET_HERE: no such variable" in one_error(result)
    result = train_ray(["--env", "MY_KEY=1"], tmp_path, cluster, timeout=60)
    assert result.returncode == 2 and ("--env MY_KEY=1: --env takes a variable's name, whose "
                                       "value goes from here: export MY_KEY=1, then --env MY_KEY"
                                       ) in one_error(result)
    for name in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES"):
        result = train_ray(["--env", name], tmp_path, {**cluster, name: "0"}, timeout=60)
        assert result.returncode == 2 and (f"--env {name}: Ray's own, which Ray sets in each "
                                           "worker") in one_error(result), name


def test_too_small_a_cluster_or_none_is_one_line_naming_ray_start(cluster, tmp_path,
                                                                  monkeypatch):
    result = train_ray(["--workers", "3", "--epochs", "1"], tmp_path, cluster, timeout=60)
    assert result.returncode == 1
    line = one_error(result)
    assert "--workers 3 needs 3 CPUs but the Ray cluster has 2" in line and "ray start" in line
    # Addresses that are none (the driver's `error:` line is the one above): in this process.
    from {{ cookiecutter.package_name }}.runtime.ray_train import connect
    for address, said in (("http://127.0.0.1:8265", "is a dashboard's address; give the cluster's"),
                          ("127.0.0.1:abc", "no Ray cluster to join at RAY_ADDRESS=127.0.0.1:abc"),
                          ("not-an-address", "no Ray cluster to join at RAY_ADDRESS=not-an")):
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert said in (connect(2, {}, 60) or ""), address
    if importlib.util.find_spec("grpc") is None:  # Ray Client's packages: not in .[ray]
        monkeypatch.setenv("RAY_ADDRESS", "ray://127.0.0.1:10001")
        assert ("RAY_ADDRESS=ray://127.0.0.1:10001 is a Ray Client address, which needs pip "
                'install "ray[client]" here') in (connect(2, {}, 60) or "")
    nowhere = {**cluster, "RAY_ADDRESS": f"127.0.0.1:{find_free_port()}"}
    result = train_ray(["--workers", "2", "--epochs", "1"], tmp_path, nowhere, timeout=60)
    assert result.returncode == 1
    line = one_error(result)
    assert "no Ray cluster answers at RAY_ADDRESS=127.0.0.1:" in line and "ray start" in line
    # A port that answers but is not Ray's (ray.init would retry it for ever): --timeout-s.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        other = {**cluster, "RAY_ADDRESS": f"127.0.0.1:{silent.getsockname()[1]}"}
        asked = time.monotonic()
        result = train_ray(["--workers", "2", "--epochs", "1", "--timeout-s", "15"], tmp_path,
                           other, timeout=120)
    assert result.returncode == 1 and time.monotonic() - asked < 15 + 30, result.stderr
    assert (f"no Ray cluster answered at RAY_ADDRESS={other['RAY_ADDRESS']} within --timeout-s "
            "15 (something listens there, but not Ray's GCS)") in one_error(result)


def test_a_variable_only_the_driver_has_is_named_after_the_workers_traceback(monkeypatch, capsys):
    """task.py reading os.environ[NAME] in a worker, where only the driver has NAME (a worker
    starts in the cluster's environment): after the KeyError's traceback, one line naming the
    variable and --env NAME. A KeyError of anything else stays the traceback alone."""
    from {{ cookiecutter.package_name }}.runtime import launch
    from {{ cookiecutter.package_name }}.runtime.ray_train import driver_only

    def task_reads_it(*args) -> dict:
        return {"setting": os.environ["ONLY_THE_DRIVERS"]}

    monkeypatch.delenv("ONLY_THE_DRIVERS", raising=False)
    monkeypatch.setattr(launch, "crash_hint",
                        functools.partial(driver_only, ["HOME", "ONLY_THE_DRIVERS"]))
    monkeypatch.setattr(launch, "run", task_reads_it)
    assert launch.run_and_report(None, None, None) == 1
    said = capsys.readouterr().err.splitlines()
    assert said[-2] == "KeyError: 'ONLY_THE_DRIVERS'" and said[0].startswith("Traceback"), said
    assert said[-1] == ("error: KeyError 'ONLY_THE_DRIVERS': ONLY_THE_DRIVERS is set where "
                        "scripts/train_ray.py runs, not in Ray's workers (they start in the "
                        "cluster's environment); pass it: --env ONLY_THE_DRIVERS")
    assert driver_only(["HOME"], KeyError("HOME")) is None  # the worker has it: another dict's
    assert driver_only(["HOME"], KeyError("layer.3")) is None


def test_a_syntax_error_in_task_py_is_pythons_own_lines_before_ray_starts(tmp_path):
    """scripts/train_ray.py imports train.py first: the file, the line and the error, as the
    other entry points give them, not a traceback through the driver's imports."""
    project = project_copy(tmp_path)
    task = project / "{{ cookiecutter.package_name }}/task.py"
    line = task.read_text().count("\n") + 2
    task.write_text(task.read_text() + "\ndef broken(:\n")
    result = run_cmd([sys.executable, str(project / "scripts/train_ray.py"), "--workers", "2"],
                     tmp_path, PYTHONPATH=str(project), timeout=60)
    said = result.stderr.splitlines()
    assert result.returncode == 1 and result.stdout == "", result.stderr
    assert said[0] == f'  File "{task}", line {line}' and len(said) == 4, result.stderr
    assert said[-1].startswith("SyntaxError: ")


def run_until_saved(cluster, tmp_path) -> subprocess.Popen:
    """A 2-worker run, once its first checkpoint is written."""
    job = subprocess.Popen([sys.executable, SCRIPT, "--workers", "2", *FLAGS], cwd=tmp_path,
                           env=ray_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    while not [p for p in list_checkpoints(tmp_path / "checkpoints") if p.suffix == ".pt"]:
        assert job.poll() is None, job.communicate()
        time.sleep(0.05)
    return job


def ended(job: subprocess.Popen, timeout: float = 90) -> tuple[str, str]:
    try:
        return job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            job.kill()


@pytest.mark.parametrize("signum, what", [(signal.SIGINT, "Ctrl-C"),
                                           (signal.SIGTERM, "SIGTERM")])
def test_ctrl_c_or_sigterm_to_the_driver_saves_and_stops_as_under_torchrun(cluster, tmp_path,
                                                                         signum, what):
    """The driver tells the workers (Ray's own handlers would end them unsaved): they save at
    their next log step and stop as that signal would, rank 0 says where, exit 130 or 143 (a
    scheduler's SIGTERM), and no worker is left."""
    job = run_until_saved(cluster, tmp_path)
    job.send_signal(signum)
    out, err = ended(job)
    assert job.returncode == 128 + signum, out + err
    assert (out + err).count(f"ray: {what}: the workers save at their next log step") == 1, (
        out + err)
    said = re.search(rf"stopped by {signum.name} at step (\d+): checkpoint saved in ", out + err)
    assert said and "Traceback" not in err, out + err
    steps = [read_meta(p)["step"] for p in list_checkpoints(tmp_path / "checkpoints")
             if p.suffix == ".pt"]
    assert max(steps) == int(said[1]) < LAST_STEP, (steps, said[0])
    deadline = time.monotonic() + 30
    while train_workers(cluster["temp"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not train_workers(cluster["temp"])


def test_ctrl_c_with_workers_that_never_answer_ends_unsaved_within_its_bound(cluster, tmp_path):
    """Workers frozen (SIGSTOP, as a hung node) never save: the driver gives up after its bound
    (STOP_SAVE_S): the unsaved line naming the newest checkpoint, exit 130, and Ray ends them."""
    job = run_until_saved(cluster, tmp_path)
    workers = train_workers(cluster["temp"])
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    asked = time.monotonic()
    job.send_signal(signal.SIGINT)
    out, err = ended(job)
    assert job.returncode == 130 and time.monotonic() - asked < STOP_SAVE_S + 20, out + err
    newest = list_checkpoints(tmp_path / "checkpoints")[0]
    assert (f"stopped by Ctrl-C, without a save; the newest checkpoint is checkpoints/"
            f"{newest.name}, which the same command resumes from") in err, err
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "frozen workers left"


def test_the_cluster_killed_mid_run_is_one_line_naming_the_newest_checkpoint(cluster, tmp_path):
    """Last in this file: it SIGKILLs the cluster (its head, its workers). The driver's run ends
    with one line, not Ray's traceback; the checkpoints are the project's and stay."""
    job = run_until_saved(cluster, tmp_path)
    for pid in cluster_processes(cluster["temp"]):
        if pid != job.pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    out, err = ended(job)
    assert job.returncode == 1 and "Traceback" not in err, out + err
    line = one_error(subprocess.CompletedProcess([], 1, out, err))
    assert line.startswith("error: the Ray cluster stopped answering (") and \
        "the newest checkpoint is " in line and "ray start" in line, line
