"""Set-up and clean-up: which backend, which devices, where the ranks meet, and joining the group.

`ddp_setup` builds the store (TCP, a shared file, or torchrun's agent) for `init_process_group`:
one code path for every launcher, a store the failure handling can use, no file:// URL to escape."""

from __future__ import annotations

import os
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path, PureWindowsPath
from urllib.parse import unquote, urlparse

import torch
import torch.distributed as dist

from ..failures import ProjectError, RunFailure, UsageError
from .environments import World
from .lifeline import Lifeline
from .network import VARIABLES, advertised_address, route_to
from .torch_private import default_store
from .workarounds import agent_store, remove_file_store, use_libuv, windows_env

INIT_METHODS = "env, tcp, file, tcp://HOST:PORT, file:///abs/path or a path like ./rdzv/store"
# How old a non-empty store file must be to count as a leftover rather than a peer's file of this
# launch. A younger leftover is caught by the --timeout-s deadline of the rendezvous instead.
STALE_AFTER_S = 60.0


def resolve_backend(requested: str, cuda_count: int, nccl_available: bool,
                    platform: str | None = None) -> str:
    """Turn `auto` into a real backend, and refuse combinations that cannot start."""
    platform = platform or sys.platform
    if requested == "auto":
        return "nccl" if cuda_count > 0 and nccl_available and platform != "win32" else "gloo"
    if requested == "nccl":
        why = (" does not exist on Windows" if platform == "win32" else
               ": this PyTorch build has no NCCL" if not nccl_available else
               " needs CUDA GPUs and none are visible" if cuda_count == 0 else "")
        if why:
            raise UsageError(f"backend nccl{why}; use --backend gloo", everywhere=True)
    return requested


def assign_devices(local_rank: int, local_world_size: int, cuda_count: int,
                   layout: str = "data_parallel", stage_devices: list[str] | None = None,
                   visible_devices: str | None = None) -> list[torch.device]:
    """The devices of one process: two (first and last stage) for model_parallel_2, else one. One
    given only its own (SLURM's --gpus-per-task: CUDA_VISIBLE_DEVICES per task) counts from 0."""
    if stage_devices:
        if layout != "model_parallel_2":
            raise UsageError("--stage-devices only applies to --model-layout model_parallel_2",
                             everywhere=True)
        devices = [torch.device(d) for d in stage_devices]
        for d in devices:
            if d.type == "cuda" and (d.index or 0) >= cuda_count:
                raise UsageError(f"--stage-devices names {d} but only {cuda_count} CUDA devices "
                                 "are visible", everywhere=True)
        return devices
    per_process = 2 if layout == "model_parallel_2" else 1
    if cuda_count == 0:
        return [torch.device("cpu")] * per_process
    if cuda_count >= per_process * local_world_size:
        first = per_process * local_rank
    elif cuda_count == per_process and visible_devices:
        first = 0  # CUDA_VISIBLE_DEVICES gave this process its own devices
    else:
        raise UsageError(
            f"{local_world_size} processes on this node need {per_process * local_world_size} "
            f"GPUs ({layout}) but {cuda_count} are visible; start fewer processes "
            f"(--nproc-per-node {max(1, cuda_count // per_process)}), "
            + ("or choose devices with --stage-devices" if per_process == 2
               else "or use --backend gloo on CPU"), everywhere=True)
    return [torch.device("cuda", first + i) for i in range(per_process)]


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where tensors of the project's own collectives live: the GPU for NCCL, else the CPU."""
    return device if backend == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one launch meet: a TCP store, a shared file, or torchrun's agent."""

    kind: str  # "tcp", "file" or "agent"
    host: str = ""
    port: int | None = None
    path: Path | None = None

    def __str__(self) -> str:
        if self.kind == "file":
            return f"the file {self.path}"
        owner = "torchrun's store" if self.kind == "agent" else "the TCP store"
        return f"{owner} at {self.address}"

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def resolve_rendezvous(method: str, world: World, rendezvous_dir: Path,
                       platform: str | None = None) -> Rendezvous:
    """Turn --init-method into a Rendezvous. `env`, `tcp`, `file` are the template's short names."""
    platform = platform or sys.platform
    if method == "env" and platform == "win32" and world.launcher in ("none", "spawn"):
        method = "file"  # no TCP store to start on Windows: a file next to the run is reliable
    under_torchrun = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if method in ("env", "env://", "tcp"):
        if world.master_port is None:
            raise UsageError("MASTER_PORT is not set; set MASTER_ADDR and MASTER_PORT, or start "
                             "with torchrun", everywhere=True)
        # torchrun's agent already serves a store on MASTER_PORT; env:// and tcp reuse it.
        kind = "agent" if under_torchrun and world.launcher == "torchrun" else "tcp"
        return Rendezvous(kind, world.master_addr, world.master_port)
    if method.startswith("tcp://"):
        url = urlparse(method)
        with suppress(ValueError):  # a port that is no number, or out of range
            if url.hostname and url.port is not None:
                return Rendezvous("tcp", url.hostname, url.port)
        raise UsageError(f"--init-method {method}: expected tcp://HOST:PORT", everywhere=True)
    if method == "file":
        path = rendezvous_dir / f"store-{world.run_id}"  # a new file for every launch
    elif method.startswith("file://"):
        if (host := method[len("file://"):].split("/", 1)[0]) not in ("", "localhost"):
            raise UsageError(f"--init-method {method}: '{host}' would be read as a host name; use "
                             "three slashes (file:///abs/path) or pass a plain path",
                             everywhere=True)
        rest = unquote(method[len("file://"):].removeprefix("localhost"))
        path = Path(PureWindowsPath(rest.lstrip("/")) if platform == "win32" else rest)
    elif "://" not in method and ("/" in method or os.sep in method or method.startswith(".")):
        path = Path(method)
    else:  # a word, or a URL scheme, of none of them
        raise UsageError(f"--init-method {method!r} is not one of {INIT_METHODS}", everywhere=True)
    if (path := path.resolve()).is_dir():
        raise UsageError(f"--init-method {method}: {path} is a folder; name a file inside it",
                         everywhere=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--init-method {method}: cannot create {path.parent} ({exc.strerror}); "
                         "pick a writable shared folder", everywhere=True) from None
    check_store_file(path)
    return Rendezvous("file", path=path)


def store_file_problem(data: bytes) -> str | None:
    """Why `data` is not a FileStore file, or None. The format: records of a 4-byte length and
    that many bytes, key then value. PyTorch reads any other content forever, holding the
    interpreter lock (seen with torch 2.13: 1, 7 or 438 zero bytes, random bytes)."""
    position, fields = 0, 0
    while position < len(data):
        if position + 4 > len(data):
            return f"it ends inside a record ({len(data)} bytes)"
        size = int.from_bytes(data[position:position + 4], "little")
        position += 4 + size
        if position > len(data):
            return f"a record runs past its end ({len(data)} bytes)"
        if fields % 2 == 0 and size == 0:
            return "it holds an empty key (zeros?)"
        fields += 1
    return None if fields % 2 == 0 else "a key has no value"


def _read_shared(path: Path) -> bytes:
    """The file's bytes, read under the lock FileStore writers take (no half-written record)."""
    with open(path, "rb") as file:
        if os.name != "nt":  # Windows has no flock
            import fcntl
            for _ in range(50):  # a writer holds it for microseconds: give up after ~1 s
                try:
                    fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except OSError:
                    time.sleep(0.02)
        return file.read()


def check_store_file(path: Path) -> None:
    """A FileStore file left by a killed run holds the old run's keys and would confuse this one;
    a file that is no store file at all would make PyTorch spin."""
    try:
        info = path.stat()
        problem = store_file_problem(_read_shared(path)) if info.st_size > 0 else None
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UsageError(f"rendezvous file {path} cannot be read ({exc.strerror}); delete it or "
                         "pick another path", everywhere=True) from None
    if problem:
        raise UsageError(f"rendezvous file {path} is not a store file: {problem}; delete it, or "
                         "use --init-method file for a new file per launch", everywhere=True)
    if info.st_size > 0 and info.st_mtime < time.time() - STALE_AFTER_S:
        raise UsageError(f"rendezvous file {path} is left over from an earlier run (last written "
                         f"{time.ctime(info.st_mtime)}); delete it, or use --init-method file for "
                         "a new file per launch", everywhere=True)


def _make_store(rdzv: Rendezvous, world: World, timeout_s: float) -> dist.Store:
    timeout = timedelta(seconds=timeout_s)
    if rdzv.kind == "file":
        store = dist.FileStore(str(rdzv.path), world.world_size)
        store.set_timeout(timeout)
        return store
    if rdzv.kind == "agent":
        return agent_store(rdzv.host, rdzv.port, world.world_size, timeout_s)
    try:
        return dist.TCPStore(rdzv.host, rdzv.port, world.world_size, is_master=world.is_main,
                             timeout=timeout, wait_for_workers=False, use_libuv=use_libuv())
    except dist.DistNetworkError as exc:
        if "in use" in str(exc).lower():
            raise UsageError(f"port {rdzv.port} on {rdzv.host} is already in use; set "
                             "MASTER_PORT to a free port (or use torchrun --standalone)") from None
        raise


def ddp_setup(world: World, backend: str, rdzv: Rendezvous, timeout_s: float,
              devices: list[torch.device], lifeline: Lifeline) -> dist.Store:
    """Set the device and join the process group, under one --timeout-s deadline (a rank that never
    meets its peers ends with an `error:` line, not a hang); returns the job's key-value store."""
    for name, value in windows_env(sys.platform).items():
        os.environ.setdefault(name, value)
    if devices[0].type == "cuda":
        torch.cuda.set_device(devices[0])
    if rdzv.kind == "file" and not rdzv.path.exists():  # a new file: removed if this fails
        lifeline.cleanups.append(lambda: rdzv.path.unlink(missing_ok=True))
    others = f"the other {world.world_size - 1} rank(s)" if world.world_size > 1 else "the store"
    what = f"{others} to join at {rdzv}"
    hint = f"check that all {world.world_size} processes were started " + (
        f"and see the same file; if a killed run left {rdzv.path} behind, delete it"
        if rdzv.kind == "file" else "with the same MASTER_ADDR/MASTER_PORT, that "
        f"{rdzv.address} is reachable from every node and that no other program listens there")
    with lifeline.waiting(what, hint, timeout_s, phase="rendezvous"):
        try:
            if dist.is_initialized():  # the launcher made the group: it is ours
                store = default_store(world.launcher)
            else:
                store = _make_store(rdzv, world, timeout_s)
                kwargs = {"device_id": devices[0]} if backend == "nccl" else {}
                dist.init_process_group(backend, store=store, rank=world.rank,
                                        world_size=world.world_size,
                                        timeout=timedelta(seconds=timeout_s), **kwargs)
            dist.barrier()  # the first collective: everyone is here and the backend works
        except ProjectError:
            raise
        except Exception as exc:  # a timeout, a refused or reset connection, a foreign server
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if " trying to connect to (" in first:  # torch's copy of the address can be garbled
                first = f"{first.split(' trying to connect to (')[0]} trying to connect"
            route = route_to(rdzv.host or world.master_addr)
            if "connectFullMesh" in first and route is not None and not route.loopback:
                # Several machines, and the store worked: the address peers were told did not.
                raise UsageError(
                    f"rank {world.rank}: met the other ranks at {rdzv} but could not connect to "
                    f"them ({first}); this rank told them to reach it at "
                    f"{advertised_address(backend, os.environ)}; set {VARIABLES[backend]} on every "
                    "node to the interface that reaches the others (`ip route get "
                    f"{rdzv.host or world.master_addr}` names it)") from None
            raise RunFailure(f"rank {world.rank}: gave up after {timeout_s:g} s waiting for "
                             f"{what} ({first}); if they were still starting, raise --timeout-s; "
                             f"else {hint}") from None
    return store


def cleanup(store: dist.Store | None = None, rdzv: Rendezvous | None = None) -> None:
    """Leave the process group; safe to call when it was never joined."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world_size = dist.get_world_size()
    dist.destroy_process_group()
    if store is not None and rdzv is not None and rdzv.kind == "file":
        remove_file_store(store, rdzv.path, world_size)
