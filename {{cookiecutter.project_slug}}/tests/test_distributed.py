"""The pure parts of set-up: who am I, which backend, which devices, where the ranks meet; and
how one rank's error reaches the others with its class."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import write_store_file

import {{ cookiecutter.package_name }}.failures as failures
from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.config import parse_args
from {{ cookiecutter.package_name }}.doctor import traps
from {{ cookiecutter.package_name }}.failures import (
    LostContact,
    PeerErrors,
    RunFailure,
    UsageError,
    agree,
    kind_name,
)
from {{ cookiecutter.package_name }}.main import work
from {{ cookiecutter.package_name }}.runtime import launch
from {{ cookiecutter.package_name }}.runtime.environments import (
    World,
    expand_nodelist,
    expand_tasks_per_node,
    find_free_port,
    resolve_world,
)
from {{ cookiecutter.package_name }}.runtime.launch import Setup, run
from {{ cookiecutter.package_name }}.runtime.nccl import nccl_env, startup_timeout_s
from {{ cookiecutter.package_name }}.runtime.rendezvous import (
    assign_devices,
    resolve_backend,
    resolve_rendezvous,
)
from {{ cookiecutter.package_name }}.runtime.workarounds import (
    stop_agent_if_store_lost,
    windows_env,
)

TORCHRUN_ENV = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "abc"}


@pytest.mark.parametrize("head", ["answers", "refuses", "is silent", "is unreachable"])
def test_an_agent_is_stopped_only_where_the_head_node_is_gone(monkeypatch, head):
    """A node whose process ends by a deadline stops its torchrun agent when the head node does
    not answer (the agent would wait on its store forever); not when it answers or refuses."""
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with socket.socket() as store:
            store.bind(("127.0.0.1", 0))
            store.listen()
            port = store.getsockname()[1]
            if head != "answers":
                store.close()  # nothing listens there: refused
            if head in ("is silent", "is unreachable"):  # what a host cut off gives
                gone = (TimeoutError() if head == "is silent"
                        else OSError(errno.EHOSTUNREACH, "No route to host"))
                monkeypatch.setattr(socket, "create_connection", lambda *a, **k: raise_(gone))
            stop_agent_if_store_lost(agent.pid, "127.0.0.1", port)
        stopped = head in ("is silent", "is unreachable")
        assert (agent.wait(timeout=10) == -9) if stopped else agent.poll() is None
    finally:
        agent.kill()
        agent.wait()


def raise_(exc: BaseException):
    raise exc


def test_torchrun_environment():
    world = resolve_world(TORCHRUN_ENV)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (3, 1, 4, 2)
    assert (world.launcher, world.master_addr, world.master_port) == ("torchrun", "10.0.0.1", 29400)


def test_local_rank_variable_wins_over_legacy_flag():
    assert resolve_world(TORCHRUN_ENV, local_rank_flag=0).local_rank == 1
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_RANK"}
    world = resolve_world(env, local_rank_flag=1)
    assert (world.local_rank, world.launcher) == (1, "launch")


def test_missing_local_rank_and_rank_outside_world_are_explained():
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_RANK"}
    with pytest.raises(UsageError, match="LOCAL_RANK"):
        resolve_world(env)
    with pytest.raises(UsageError, match="outside a world"):
        resolve_world({**TORCHRUN_ENV, "RANK": "4"})


def test_kubeflow_pod_without_torchrun_is_one_process_per_pod():
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "job-master-0",
           "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2", "PET_NNODES": "3"}
    world = resolve_world(env)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (2, 0, 3, 1)
    assert (world.launcher, world.master_addr, world.master_port) == ("kubeflow", "job-master-0",
                                                                      23456)
    # torchrun inside the pod sets its own variables: those win.
    pod_with_torchrun = {**env, "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "job"}
    assert resolve_world(pod_with_torchrun).launcher == "torchrun"


def test_no_launcher_is_a_world_of_one():
    world = resolve_world({})
    assert (world.rank, world.world_size, world.launcher) == (0, 1, "none")
    assert world.master_port and world.master_port > 0


# Recorded from a real SLURM 22.05: rank 1 of `srun` in `sbatch -N1 --ntasks-per-node=2
# --cpus-per-task=1`, less the variables that only name paths and ports. The template's tests check
# on a real cluster that srun still sets every one of them.
SLURM_STEP = {
    "SLURMD_NODENAME": "vm", "SLURM_CPUS_ON_NODE": "2", "SLURM_CPUS_PER_TASK": "1",
    "SLURM_DISTRIBUTION": "block", "SLURM_GTIDS": "0,1", "SLURM_JOBID": "5",
    "SLURM_JOB_CPUS_PER_NODE": "2", "SLURM_JOB_ID": "5", "SLURM_JOB_NAME": "wrap",
    "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1", "SLURM_LOCALID": "1",
    "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "vm", "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "1", "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "vm", "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2",
}
# The same step on two nodes of four tasks each (rank 5), in SLURM's compressed formats.
TWO_NODES = {**SLURM_STEP, "SLURM_PROCID": "5", "SLURM_NODEID": "1", "SLURM_NTASKS": "8",
             "SLURM_NPROCS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NNODES": "2",
             "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4",
             "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
             "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]",
             "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242"}


def test_slurm_environment():
    world = resolve_world(SLURM_STEP)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (1, 1, 2, 2)
    assert (world.launcher, world.master_addr, world.master_port) == ("slurm", "vm", 15000 + 5)
    world = resolve_world(TWO_NODES)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (5, 1, 8, 4)
    assert (world.launcher, world.master_addr) == ("slurm", "gpu07")
    assert world.master_port == 15000 + 4242


def test_a_slurm_step_on_fewer_nodes_than_the_job_uses_the_steps_counts():
    # `srun -N1 -n2 ...` inside a 5-node job of 4 tasks per node.
    env = {**TWO_NODES, "SLURM_PROCID": "1", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "5",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_NTASKS": "20", "SLURM_STEP_NUM_TASKS": "2",
           "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
           "SLURM_STEP_NODELIST": "gpu08"}
    world = resolve_world(env)
    assert (world.world_size, world.local_world_size, world.master_addr) == (2, 2, "gpu08")


def test_slurm_mistakes_are_explained():
    with pytest.raises(UsageError, match="not started by srun"):
        resolve_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1"})
    with pytest.raises(UsageError, match="add up to 5; use --ntasks-per-node"):
        resolve_world({**TWO_NODES, "SLURM_STEP_TASKS_PER_NODE": "4,1", "SLURM_NODEID": "0",
                       "SLURM_LOCALID": "0", "SLURM_PROCID": "0"})
    with pytest.raises(UsageError, match="SLURM_LOCALID=2"):
        resolve_world({**SLURM_STEP, "SLURM_LOCALID": "2"})
    # The doctor still sees what SLURM said.
    assert resolve_world({**SLURM_STEP, "SLURM_LOCALID": "2"}, check=False).local_rank == 2


def test_torchrun_inside_slurm_uses_torchrun_variables():
    assert resolve_world({**TORCHRUN_ENV, "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}).launcher == \
        "torchrun"


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_backend_auto_and_refusals():
    assert resolve_backend("auto", cuda_count=0, nccl_available=True) == "gloo"
    assert resolve_backend("auto", cuda_count=2, nccl_available=True) == "nccl"
    assert resolve_backend("auto", cuda_count=2, nccl_available=False) == "gloo"
    with pytest.raises(UsageError, match="--backend gloo"):
        resolve_backend("nccl", cuda_count=0, nccl_available=True)
    with pytest.raises(UsageError, match="Windows"):
        resolve_backend("nccl", cuda_count=1, nccl_available=True, platform="win32")


@pytest.mark.parametrize("local_rank, local_world, cuda, layout, visible, expected", [
    (1, 2, 0, "data_parallel", None, ["cpu"]),
    (1, 2, 2, "data_parallel", None, ["cuda:1"]),
    (1, 2, 8, "fsdp", "0,1,2,3,4,5,6,7", ["cuda:1"]),
    (0, 1, 1, "data_parallel", None, ["cuda:0"]),
    (3, 4, 1, "data_parallel", "3", ["cuda:0"]),  # --gpus-per-task=1: its own GPU
    (1, 2, 4, "model_parallel_2", None, ["cuda:2", "cuda:3"]),
    (0, 2, 0, "model_parallel_2", None, ["cpu", "cpu"]),
    (1, 2, 2, "model_parallel_2", "2,3", ["cuda:0", "cuda:1"]),  # --gpus-per-task=2
])
def test_assign_devices(local_rank, local_world, cuda, layout, visible, expected):
    devices = assign_devices(local_rank, local_world, cuda, layout, visible_devices=visible)
    assert devices == [torch.device(d) for d in expected]


def test_assign_devices_refuses_too_few_gpus():
    with pytest.raises(UsageError, match="need 4 GPUs .* 2 are visible; start fewer processes"):
        assign_devices(0, 4, 2, "data_parallel")
    with pytest.raises(UsageError, match="need 2 GPUs"):  # two processes, one GPU
        assign_devices(1, 2, 1, "data_parallel", visible_devices=None)
    with pytest.raises(UsageError, match="--stage-devices"):
        assign_devices(0, 2, 3, "model_parallel_2")
    assert assign_devices(0, 1, 1, "model_parallel_2", ["cuda:0", "cuda:0"]) == \
        [torch.device("cuda:0")] * 2
    with pytest.raises(UsageError, match="only 1 CUDA"):
        assign_devices(0, 1, 1, "model_parallel_2", ["cuda:0", "cuda:1"])


WORLD = World(0, 0, 2, 2, "spawn", "127.0.0.1", 12345, "run1")


def test_rendezvous_from_init_methods(tmp_path: Path):
    assert str(resolve_rendezvous("env", WORLD, tmp_path)) == "the TCP store at 127.0.0.1:12345"
    assert resolve_rendezvous("tcp", WORLD, tmp_path).port == 12345
    tcp = resolve_rendezvous("tcp://h.example:1", WORLD, tmp_path)
    assert (tcp.kind, tcp.host, tcp.port) == ("tcp", "h.example", 1)
    rdzv = resolve_rendezvous("file", WORLD, tmp_path / "rdzv")
    assert rdzv.path == (tmp_path / "rdzv" / "store-run1").resolve()
    assert (tmp_path / "rdzv").is_dir()
    assert resolve_rendezvous(str(tmp_path / "x" / "store"), WORLD, tmp_path).kind == "file"


@pytest.mark.parametrize("name", ["my run/store", "runs/é/store", "a%20b/store", "100%/store"])
def test_file_paths_that_need_url_escaping_are_taken_literally(tmp_path, name):
    assert resolve_rendezvous(str(tmp_path / name), WORLD, tmp_path).path == \
        (tmp_path / name).resolve()
    # The same path as a file:// URL, percent-escaped as Path.as_uri() writes it.
    url = (tmp_path / name).as_uri()
    assert resolve_rendezvous(url, WORLD, tmp_path).path == (tmp_path / name).resolve()


@pytest.mark.parametrize("method, says", [
    ("bogus://x", "is not one of env, tcp, file"),
    ("tpc", "is not one of env, tcp, file"),
    ("tcp://hostonly", "expected tcp://HOST:PORT"),
    ("tcp://h:notaport", "expected tcp://HOST:PORT"),
    ("file://tmp/store", "three slashes"),
])
def test_bad_init_methods_are_explained(tmp_path, method, says):
    with pytest.raises(UsageError, match=says):
        resolve_rendezvous(method, WORLD, tmp_path)


def test_stale_and_fresh_store_files(tmp_path: Path):
    fresh = write_store_file(tmp_path / "fresh", peer="of this launch, a moment ago")
    assert resolve_rendezvous(str(fresh), WORLD, tmp_path).path == fresh.resolve()
    os.utime(fresh, (0, 0))
    with pytest.raises(UsageError, match="left over from an earlier run"):
        resolve_rendezvous(str(fresh), WORLD, tmp_path)


def test_windows_branches(tmp_path: Path):
    assert resolve_backend("auto", cuda_count=2, nccl_available=True, platform="win32") == "gloo"
    assert windows_env("win32") == {"USE_LIBUV": "0"}
    assert windows_env("linux") == {}
    world = World(0, 0, 1, 1, "none", "127.0.0.1", 1, "w")
    # Without a launcher, Windows meets through a file instead of a TCP store.
    assert resolve_rendezvous("env", world, tmp_path, platform="win32").kind == "file"
    assert resolve_rendezvous("env", replace(world, launcher="launch"), tmp_path,
                              platform="win32").kind == "tcp"


def test_windows_path_trains_with_platform_patched(monkeypatch, tmp_path: Path, example_task):
    import torch._dynamo  # noqa: F401  (DDP imports it lazily; it reads sysconfig, which a
    # patched platform breaks)

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.delenv("USE_LIBUV", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = parse_args(["--epochs", "1", "--dataset-size", "64", "--no-progress", "--init-method",
                      "env", "--hidden-size", "8"], task.Settings)
    summary = run(cfg, World(0, 0, 1, 1, "none", "127.0.0.1", find_free_port(), "win-test"),
                  work)
    assert summary["backend"] == "gloo" and summary["steps"] == 2
    assert os.environ["USE_LIBUV"] == "0"
    assert not list((tmp_path / "runs/latest/rendezvous").iterdir()), "store file not removed"


def test_nccl_settings_fail_fast_leave_a_trace_and_never_override_the_user(tmp_path):
    env = nccl_env(tmp_path / "out", {})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    dump = str((tmp_path / "out").resolve() / "nccl_flight_recorder" / "rank_")
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == dump
    assert int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_FR_BUFFER_SIZE": "0"}
    kept = nccl_env(tmp_path, mine)
    assert not set(mine) & set(kept), "a variable the user set is never replaced"


def test_nccl_gets_a_long_start_up_and_gloo_keeps_timeout_s():
    assert startup_timeout_s(30, "nccl") == 600 and startup_timeout_s(900, "nccl") == 900
    assert startup_timeout_s(30, "gloo") == 30


def test_doctor_warns_about_known_traps(monkeypatch):
    import shutil
    world = World(0, 0, 4, 4, "torchrun")
    found = " | ".join(traps(world, cuda_count=2, backend="nccl"))
    assert "4 processes on this node but 2 visible GPU(s)" in found
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert "names 3 device(s) but 2 are visible" in " ".join(traps(world, 2, "nccl"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(
        64 * 2**20, 60 * 2**20, 4 * 2**20))
    assert "/dev/shm has 4 MB free" in " ".join(traps(World(0, 0, 1, 1, "none"), 0, "gloo"))


KINDS = [UsageError, RunFailure, LostContact]


@pytest.mark.parametrize("kind", KINDS)
def test_a_peers_recorded_error_keeps_its_class(kind):
    store = torch.distributed.HashStore()  # the job's key-value store, in this process
    failed, peer = PeerErrors(store, 1, 2), PeerErrors(store, 0, 2)
    failed.record("cannot write checkpoint x (disk full)", kind_name(kind("")))
    error = peer.explain(RuntimeError("Connection closed by peer"), timeout_s=30)
    assert type(error) is kind and error.quiet  # the same host: rank 1 printed it
    assert str(error) == (f"rank 0: stopped because rank 1 on {socket.gethostname()} failed: "
                          "cannot write checkpoint x (disk full)")


def test_a_silent_peer_a_crash_and_a_users_subclass_travel_as_their_nearest_kind():
    silent = PeerErrors(torch.distributed.HashStore(), 0, 2).explain(
        RuntimeError("Connection closed by peer"), timeout_s=30)  # rank 1 left no record
    assert type(silent) is RunFailure and "communication with the other ranks failed" in str(silent)
    assert kind_name(type("TasksOwn", (UsageError,), {})("")) == "UsageError"  # a user's subclass
    assert kind_name(ZeroDivisionError()) == "RunFailure"  # a crash


@pytest.mark.parametrize("kind", KINDS)
def test_rank_0s_error_reaches_every_rank_with_its_class(monkeypatch, kind):
    # One process plays rank 0, then rank 1; the wire stands in for broadcast_text's collectives
    # (a group of one process has no other rank to receive).
    wire: list[str] = []

    def broadcast_text(text, device):  # rank 0 sends its text, the others receive it
        if text is not None:
            wire.append(text)
        return wire[-1]

    def decide():
        raise kind("--checkpoint-dir x is in use by a run that is still going")

    monkeypatch.setattr(failures, "broadcast_text", broadcast_text)
    for rank in (0, 1):
        monkeypatch.setattr(failures.dist, "get_rank", lambda rank=rank: rank)
        with pytest.raises(kind) as raised:
            agree(decide, torch.device("cpu"))
        assert type(raised.value) is kind
    assert raised.value.quiet and str(raised.value) == (
        f"rank 0 on {socket.gethostname()}: --checkpoint-dir x is in use by a run that is still "
        "going")


# gloo's own timeout ("pair closure") can end a backward before our deadline: the same story.
@pytest.mark.parametrize("said", ["Connection closed by peer",
                                  "Application timeout caused pair closure"])
def test_under_nccl_a_rank_that_lost_the_store_still_raises_lost_contact(monkeypatch, tmp_path,
                                                                         said):
    # run() adds NCCL's flight-recorder hint to the error; the class must stay, or a node cut off
    # from the job's store would not stop torchrun's stuck agent (run_and_report).
    class GoneStore:  # the store's host dropped off the network
        def set(self, *args):
            raise RuntimeError("Connection reset by peer")

    @contextmanager
    def joined(cfg, world, workers=False):
        lifeline = SimpleNamespace(waiting=lambda *args, **kwargs: nullcontext())
        yield Setup("nccl", [torch.device("cpu")], SimpleNamespace(port=0, address=""), None, "",
                    lifeline, GoneStore())

    def work(*args):
        raise RuntimeError(said)

    monkeypatch.setattr(launch, "joined", joined)
    cfg = SimpleNamespace(num_workers=0, timeout_s=1.0, output_dir=str(tmp_path))
    with pytest.raises(LostContact, match="lost contact with the other ranks .*flight recorder"):
        run(cfg, World(0, 0, 2, 2, "torchrun"), work)
