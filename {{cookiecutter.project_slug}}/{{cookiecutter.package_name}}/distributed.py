"""Who am I in the job, which devices do I use, and how do the processes meet.

Each launcher announces rank and world size in its own environment variables. One small class per
launcher turns them into a `World`; `resolve_world` picks the first class that recognises the
environment. To support another cluster, add a class with `detect` and `world` and list it in
`ENVIRONMENTS`.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path, PureWindowsPath
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

import torch
import torch.distributed as dist


class SetupError(RuntimeError):
    """A problem the user can fix. The entry point prints it as one `error: ...` line and exits 1.

    `quiet=True` on ranks that only learned of the error from rank 0, so the job prints it once.
    """

    def __init__(self, message: str, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


def report_error(exc: SetupError) -> None:
    if not exc.quiet:
        sys.stderr.write(f"error: {exc}\n")  # one write: lines of several ranks do not interleave
        sys.stderr.flush()


@dataclass(frozen=True)
class World:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launcher: str
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    run_id: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_var(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise SetupError(f"environment variable {name} is not set; start the job with its launcher") from None
    except ValueError:
        raise SetupError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _check_ranks(rank: int, local_rank: int, world_size: int, source: str) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise SetupError(f"{source}: rank {rank} is outside a world of {world_size} processes; "
                         "check the process counts given to the launcher")
    if local_rank < 0:
        raise SetupError(f"{source}: local rank {local_rank} is negative")


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it), so two jobs on one machine don't collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TorchrunEnvironment:
    """torchrun, `python -m torch.distributed.launch`, or anything else exporting RANK and WORLD_SIZE."""

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "RANK" in env and "WORLD_SIZE" in env

    @staticmethod
    def world(env: Mapping[str, str], local_rank_flag: int | None = None) -> World:
        rank, world_size = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
        # The legacy launcher passes --local-rank unless --use-env is given; the variable wins.
        if "LOCAL_RANK" in env:
            local_rank = _int_var(env, "LOCAL_RANK")
        elif local_rank_flag is not None:
            local_rank = local_rank_flag
        else:
            raise SetupError("RANK and WORLD_SIZE are set but LOCAL_RANK is not; "
                             "start with torchrun, or pass --local-rank")
        _check_ranks(rank, local_rank, world_size, "torchrun")
        local_world_size = _int_var(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size
        # A fixed --rdzv-id repeats across launches; the restart count and the port torchrun picked do not.
        run_id = "-".join(env.get(name, "0") for name in
                          ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT"))
        return World(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            launcher="launch" if local_rank_flag is not None else "torchrun",
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
            run_id=run_id,
        )


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list: 'node[01-03,07],gpu1' -> node01 node02 node03 node07 gpu1."""
    hosts: list[str] = []
    # Split on commas that are not inside brackets.
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        match = re.match(r"^(.*?)\[([^\]]*)\](.*)$", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if hi:
                for n in range(int(lo), int(hi) + 1):
                    hosts.extend(expand_nodelist(f"{prefix}{n:0{len(lo)}d}{suffix}"))
            else:
                hosts.extend(expand_nodelist(f"{prefix}{lo}{suffix}"))
    return hosts


class SlurmEnvironment:
    """`srun python train.py`: one task per device, ranks from SLURM's variables."""

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in env and "SLURM_NTASKS" in env

    @staticmethod
    def world(env: Mapping[str, str], local_rank_flag: int | None = None) -> World:
        rank, world_size = _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_NTASKS")
        if world_size > 1 and "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
            raise SetupError(f"SLURM_NTASKS={world_size} but this process was not started by srun; "
                             "run `srun python train.py` inside the batch script (or use torchrun)")
        local_rank = _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        _check_ranks(rank, local_rank, world_size, "SLURM (SLURM_PROCID/SLURM_NTASKS)")
        if "SLURM_NTASKS_PER_NODE" in env:
            local_world_size = _int_var(env, "SLURM_NTASKS_PER_NODE")
        else:  # SLURM_TASKS_PER_NODE looks like '2(x3),1'; this node's count is what matters here.
            first = env.get("SLURM_TASKS_PER_NODE", str(world_size)).split(",")[0]
            local_world_size = int(first.split("(")[0])
        if local_rank >= local_world_size:
            raise SetupError(f"SLURM_LOCALID={local_rank} but only {local_world_size} tasks per node; "
                             "make --ntasks-per-node match the tasks srun starts")
        nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
        if "SLURM_NTASKS_PER_NODE" in env and nodes and int(nodes) * local_world_size != world_size:
            raise SetupError(f"SLURM_NTASKS={world_size} but {nodes} nodes x SLURM_NTASKS_PER_NODE="
                             f"{local_world_size} = {int(nodes) * local_world_size}; use --ntasks-per-node "
                             "(not --ntasks) so every node runs the same number of tasks")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        job_id = env.get("SLURM_JOB_ID", "0")
        # A port derived from the job id: two jobs sharing a node do not pick the same one.
        port = _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else 15000 + int(job_id) % 20000
        return World(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            launcher="slurm",
            master_addr=env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
            master_port=port,
            run_id=f"slurm-{job_id}.{env.get('SLURM_STEP_ID', '0')}-{env.get('SLURM_RESTART_COUNT', '0')}",
        )


class SingleProcessEnvironment:
    """`python train.py` with no launcher: a world of one."""

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return True

    @staticmethod
    def world(env: Mapping[str, str], local_rank_flag: int | None = None) -> World:
        port = _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else find_free_port()
        return World(0, 0, 1, 1, "none", env.get("MASTER_ADDR", "127.0.0.1"), port, f"single-{uuid.uuid4().hex[:8]}")


ENVIRONMENTS = (TorchrunEnvironment, SlurmEnvironment, SingleProcessEnvironment)


def resolve_world(env: Mapping[str, str] | None = None, local_rank_flag: int | None = None) -> World:
    """The World of this process, from the first environment class that recognises `env`."""
    env = os.environ if env is None else env
    for environment in ENVIRONMENTS:
        if environment.detect(env):
            return environment.world(env, local_rank_flag)
    raise AssertionError("SingleProcessEnvironment always matches")


def resolve_backend(requested: str, cuda_count: int, nccl_available: bool, platform: str | None = None) -> str:
    """Turn `auto` into a real backend, and refuse combinations that cannot start."""
    platform = platform or sys.platform
    if requested == "auto":
        return "nccl" if cuda_count > 0 and nccl_available and platform != "win32" else "gloo"
    if requested == "nccl":
        if platform == "win32":
            raise SetupError("backend nccl does not exist on Windows; use --backend gloo")
        if not nccl_available:
            raise SetupError("backend nccl: this PyTorch build has no NCCL; use --backend gloo")
        if cuda_count == 0:
            raise SetupError("backend nccl needs CUDA GPUs and none are visible; use --backend gloo")
    return requested


def assign_devices(
    local_rank: int,
    local_world_size: int,
    cuda_count: int,
    layout: str = "data_parallel",
    stage_devices: list[str] | None = None,
    visible_devices: str | None = None,
) -> list[torch.device]:
    """The devices of one process: one for data_parallel, two (first and last stage) for model_parallel_2.

    Pure: device count and CUDA_VISIBLE_DEVICES are passed in, so every case is testable without GPUs.
    When each process is given exactly its own devices (CUDA_VISIBLE_DEVICES per task, as SLURM's
    `--gpus-per-task` does), device indices restart at 0 in every process.
    """
    if stage_devices:
        if layout != "model_parallel_2":
            raise SetupError("--stage-devices only applies to --model-layout model_parallel_2")
        devices = [torch.device(d) for d in stage_devices]
        for d in devices:
            if d.type == "cuda" and (d.index or 0) >= cuda_count:
                raise SetupError(f"--stage-devices names {d} but only {cuda_count} CUDA devices are visible")
        return devices
    per_process = 2 if layout == "model_parallel_2" else 1
    if cuda_count == 0:
        return [torch.device("cpu")] * per_process
    if cuda_count >= per_process * local_world_size:
        first = per_process * local_rank
    elif cuda_count == per_process and visible_devices:
        first = 0  # CUDA_VISIBLE_DEVICES gave this process its own devices
    else:
        raise SetupError(
            f"{local_world_size} processes on this node need {per_process * local_world_size} GPUs "
            f"({layout}) but {cuda_count} are visible; start fewer processes (--nproc-per-node "
            f"{max(1, cuda_count // per_process)}), "
            + ("or choose devices with --stage-devices" if per_process == 2 else "or use --backend gloo on CPU")
        )
    return [torch.device("cuda", first + i) for i in range(per_process)]


def file_uri(path: str | Path, platform: str | None = None) -> str:
    """A file:// URL from an absolute path. Never build one by hand: 'file://tmp/x' names a host 'tmp'.

    C:\\runs\\store -> file:///C:/runs/store; \\\\server\\share\\store -> file://server/share/store.
    """
    if isinstance(path, Path):
        return path.resolve().as_uri()  # a concrete path already has this machine's flavour
    if (platform or sys.platform) == "win32":
        return PureWindowsPath(path).as_uri()
    return Path(path).resolve().as_uri()


# How old a non-empty store file must be to count as a leftover rather than a peer's file of this launch.
STALE_AFTER_S = 60.0


def check_store_file(path: Path) -> None:
    """A FileStore file left by a killed run holds the old run's keys and would confuse (or hang) this one."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return
    if info.st_size > 0 and info.st_mtime < time.time() - STALE_AFTER_S:
        raise SetupError(f"rendezvous file {path} is left over from an earlier run (last written "
                         f"{time.ctime(info.st_mtime)}); delete it, or use --init-method file for a new file "
                         "per launch")


def resolve_init_method(method: str, world: World, rendezvous_dir: Path, platform: str | None = None) -> str:
    """The init_method URL for init_process_group. `env`, `tcp` and `file` are the template's short names."""
    platform = platform or sys.platform
    if method == "env" and platform == "win32" and world.launcher in ("none", "spawn"):
        method = "file"  # no TCP store to start on Windows: a file next to the run is the reliable way
    if method == "env" or method.startswith("env://"):
        return "env://"
    if method == "tcp":
        if world.launcher in ("torchrun", "launch"):
            # torchrun's agent already serves a store on MASTER_PORT; env:// reuses it.
            return "env://"
        return f"tcp://{world.master_addr}:{world.master_port}"
    if method.startswith("tcp://"):
        return method
    if method == "file":
        path = rendezvous_dir / f"store-{world.run_id}"  # a new file for every launch
    elif method.startswith("file://"):
        host = method[len("file://"):].split("/", 1)[0]
        if host not in ("", "localhost"):
            raise SetupError(f"--init-method {method}: '{host}' would be read as a host name; "
                             "use three slashes (file:///abs/path) or pass a plain path")
        path = Path(unquote(method[len("file://"):].removeprefix("localhost")))
    else:
        path = Path(method)
    path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    check_store_file(path)
    return file_uri(path)


def windows_env(platform: str, torch_version: str) -> dict[str, str]:
    """Environment Windows needs before any TCP store starts: PyTorch 2.4+ defaults to a libuv TCPStore,
    which Windows builds do not have."""
    if platform != "win32":
        return {}
    major, minor = (int(part) for part in torch_version.split(".")[:2])
    return {"USE_LIBUV": "0"} if (major, minor) >= (2, 4) else {}


def ddp_setup(world: World, backend: str, init_method: str, timeout_s: float,
              devices: list[torch.device], rendezvous_dir: Path) -> str:
    """Set the device, then join the process group. Returns the init URL used (for `cleanup`)."""
    for name, value in windows_env(sys.platform, torch.__version__).items():
        os.environ.setdefault(name, value)
    if devices[0].type == "cuda":
        torch.cuda.set_device(devices[0])
    url = resolve_init_method(init_method, world, rendezvous_dir)
    if url == "env://":
        os.environ["MASTER_ADDR"] = world.master_addr
        if world.master_port is not None:
            os.environ["MASTER_PORT"] = str(world.master_port)
    kwargs = {}
    if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = devices[0]
    if url == "env://" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one store for the whole job, across restarts. Without a prefix per attempt, the
        # workers of a restart read the addresses the dead workers published and never connect.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        agent_store = dist.TCPStore(world.master_addr, world.master_port, world.world_size, is_master=False,
                                    timeout=timedelta(seconds=timeout_s),
                                    use_libuv=os.environ.get("USE_LIBUV", "1") == "1")
        kwargs["store"] = dist.PrefixStore(f"/worker/attempt_{attempt}", agent_store)
    else:
        kwargs["init_method"] = url
    try:
        dist.init_process_group(
            backend,
            rank=world.rank,
            world_size=world.world_size,
            timeout=timedelta(seconds=timeout_s),
            **kwargs,
        )
    except dist.DistNetworkError as exc:
        if "in use" in str(exc).lower():
            raise SetupError(f"port {world.master_port} on {world.master_addr} is already in use; "
                             "set MASTER_PORT to a free port (or use torchrun --standalone)") from None
        raise
    return url


# What gloo and NCCL say when a peer died, stalled past --timeout-s, or dropped its connection.
_COMMUNICATION_FAILURES = ("Timed out", "timed out", "Connection closed", "Connection reset", "Broken pipe",
                           "NCCL error", "Socket Timeout")


def is_communication_failure(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistError) or any(text in str(exc) for text in _COMMUNICATION_FAILURES)


def describe_communication_failure(world: World, exc: BaseException, timeout_s: float, wait_s: float = 3.0) -> str:
    """Name the ranks that stopped answering. Every surviving rank leaves a mark in the job's key-value
    store (it outlives the workers under torchrun); the ranks without a mark are the dead or stalled ones."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    suspects = "unknown (the job's store is gone too)"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"comm_failure/{world.rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            silent = [r for r in range(world.world_size) if not store.check([f"comm_failure/{r}"])]
            if not silent or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        suspects = ", ".join(map(str, silent)) if silent else "none found (all ranks saw the failure)"
    except Exception:  # the store may have died with the rank that hosted it
        pass
    return (f"rank {world.rank}: communication with the other ranks failed ({first_line}); "
            f"rank(s) that stopped answering: {suspects}. A rank that dies or hangs longer than "
            f"--timeout-s={timeout_s:g} ends the job; see that rank's own output for why")


def cleanup(init_url: str = "") -> None:
    """Leave the process group; safe to call when it was never joined.

    Pass the URL `ddp_setup` returned: the file of a file:// store is removed by the last rank to leave.
    (torch removes it when the store is freed, but DDP keeps the group and its store until the process
    ends, and training processes end with os._exit: see train.exit_process.)
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    last_to_leave = False
    if init_url.startswith("file://"):
        store = dist.distributed_c10d._get_default_store()
        last_to_leave = store.add("ranks_done", 1) == dist.get_world_size()
    dist.destroy_process_group()
    if last_to_leave:
        Path(url2pathname(urlparse(init_url).path)).unlink(missing_ok=True)
