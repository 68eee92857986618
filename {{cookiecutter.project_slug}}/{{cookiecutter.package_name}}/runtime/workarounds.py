"""Work-arounds for PyTorch behaviour, in one place so each can go the day PyTorch fixes it.

Each entry says what goes wrong without it, the upstream report, and the torch versions it was seen
with. Delete a function (and its one call) once the oldest supported torch no longer needs it."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

from .torch_private import stop_restarts, wrap_agent_monitor

UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN}  # a host that is gone
CLEANUPS: list[Callable[[], object]] = []  # e.g. downloads to delete: exit_process runs them
# torch's TCPStore protocol: VALIDATE with its magic number, then PING with 4 bytes a store sends
# straight back.
STORE_PING = b"\x00\xce\xf7\x85\x3c\x0dLOOK"


def exit_process(code: int) -> NoReturn:
    """End a training process without Python's interpreter shutdown. Without it: a run that
    finished fine can abort at exit ("terminate called without an active exception", exit -6, and
    torchrun calls the job failed): gloo's worker threads still hold tensors at teardown (a process
    group used by DDP outlives destroy_process_group), and releasing them needs the GIL of a dying
    interpreter. Upstream: https://github.com/pytorch/pytorch/issues/190489 (an atexit fix, #179291,
    was abandoned). Seen with torch 2.13 (gloo, 1 in 20-60 resumed runs under load). Cost: atexit
    handlers do not run: what the project writes is closed explicitly first, CLEANUPS run here."""
    for cleanup in CLEANUPS:
        with suppress(Exception):
            cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_stuck_agent(agent_pid: int) -> None:
    """SIGKILL torchrun's agent on this node, once this node has lost the job's store. Without it:
    the agent's monitoring loop asks its rendezvous store how many nodes wait, and a TCPStore get
    whose host dropped off the network blocks in recv() forever (no timeout; SIGTERM does nothing,
    recv is retried): the training processes end by their deadlines, the agent never does, and the
    node stays busy. Upstream: https://github.com/pytorch/pytorch/issues/129367 (a get stuck in
    recv). Seen with torch 2.13 on two network-namespace hosts, one cut off."""
    with suppress(OSError):
        os.kill(agent_pid, signal.SIGKILL)


def stop_agent_if_store_lost(agent_pid: int, host: str, port: int | None) -> None:
    """stop_stuck_agent, for a process that ends another way (a deadline, another error) while
    the head node, which holds the job's store and the agents', does not answer within 2 s. (A
    refusal is an answer: the head is there, and its agent may be restarting the job.)"""
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        if port and (isinstance(exc, TimeoutError) or exc.errno in UNREACHABLE):
            stop_stuck_agent(agent_pid)


def remove_file_store(store: dist.Store, path: Path, world_size: int) -> None:
    """Remove a FileStore's file once the last rank leaves. Without it: `exit_process` skips the
    FileStore destructor, which removes it, and the next launch finds it (needed while that is)."""
    try:
        last = store.add("ranks_done", 1) == world_size
    except Exception:  # a peer already removed the file: nothing left to do
        return
    if last:
        path.unlink(missing_ok=True)


def agent_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.Store:
    """The store of torchrun's agent, seen through a prefix that is new for every restart. Without
    it: torchrun keeps one store for every restart attempt of a job, and the workers of a restart
    read the addresses the dead workers published there and never connect (gloo hangs in
    connectFullMesh). Upstream: https://github.com/pytorch/pytorch/issues/135712 (restart counts are
    tracked per worker, not per job). Seen with torch 2.5 to 2.13 under --max-restarts."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(host, port, world_size, is_master=False,
                          timeout=timedelta(seconds=timeout_s), use_libuv=use_libuv())
    return dist.PrefixStore(f"/worker/attempt_{attempt}", store)


def windows_env(platform: str) -> dict[str, str]:
    """Environment Windows needs before any TCP store starts. Without it: PyTorch 2.4+ defaults to
    a libuv TCPStore, missing from its Windows builds ("use_libuv was requested but PyTorch was
    built without libuv support"). Upstream: https://github.com/pytorch/pytorch/issues/139990
    (init_process_group defaults to USE_LIBUV=0 there since 2.7, #148266; torchrun not, #178600)."""
    return {"USE_LIBUV": "0"} if platform == "win32" else {}


def use_libuv() -> bool:
    return os.environ.get("USE_LIBUV", "1") == "1"


def taken_rendezvous(endpoint: str, run_id: str, local_addr: str | None,
                     fresh_s: float = 20.0) -> str | None:
    """Why torchrun's c10d rendezvous at `endpoint` cannot take this node, or None: a running
    job's nodes completed round `run_id` there and all keep it alive (none is a dead agent of
    this machine, `local_addr`, which this node would replace), or the store there holds no
    rendezvous `run_id` (another job's, of another id). Without this check, a node that arrives
    at a running job (a second job on the same port, a node rank too many) waits silently as a
    spare for that job's next round until torchrun's own timeouts end it in a
    RendezvousConnectionError traceback, minutes later; at another id's store, it runs its own
    rendezvous on a store that ends with the other job (or, hosting, a traceback); at a program
    that is not a store, it waits minutes for an answer. Seen with torch 2.6 to 2.13."""
    import pickle
    from base64 import b64decode
    from datetime import datetime, timezone

    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:  # nothing there yet: this node hosts it, or waits for its host as torchrun does
        probe = socket.create_connection((host, int(port)), timeout=2)
    except (OSError, ValueError):
        return None
    with probe:  # the store client below would wait for ever on a program that never answers
        try:
            probe.sendall(STORE_PING)
            answer = probe.recv(len(b"LOOK"), socket.MSG_WAITALL)
        except OSError:  # 2 s without an answer
            answer = b""
    if answer != b"LOOK":
        return (f"{endpoint} is held by a program that is not a torchrun rendezvous; stop it, or "
                "give this job another port (HEAD_HOST:PORT)")
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5),
                              use_libuv=use_libuv())
        key = f"torch.rendezvous.{run_id}"
        if not store.check([key]):
            time.sleep(1)  # a peer hosting the store writes the key right after starting it
            if not store.check([key]):
                return (f"{endpoint} is another job's: a torch store answers there without "
                        f"rendezvous id {run_id}; give this job another port (HEAD_HOST:PORT), "
                        "or every node of one job the same rendezvous id (RDZV_ID)")
        state = pickle.loads(b64decode(store.get(key)))
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError, AttributeError):
        return None  # not a store, or not torch's state: torchrun says what it finds
    if not getattr(state, "complete", False) or state.closed or not state.participants:
        return None
    now, here = datetime.now(timezone.utc), local_addr or socket.getfqdn()

    def gone(node: Any) -> bool:  # a node that died: this may be its return
        silent = (now - state.last_heartbeats.get(node, now)).total_seconds() > fresh_s
        return silent or (node.addr == here and not alive(node.pid))

    if any(map(gone, state.participants)):
        return None
    hosts = sorted({node.addr for node in state.participants})
    return (f"the rendezvous at {endpoint} (id {run_id}) is taken: a running job of "
            f"{len(state.participants)} node(s) on {', '.join(hosts)} started there already; "
            "give this job another port (HEAD_HOST:PORT) or rendezvous id (RDZV_ID), or wait "
            "for that job to end")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def torchrun_quietly(argv: list[str]) -> int:
    """torchrun, where a failure no restart cures ends the job at once and quietly (its processes
    said why), and a stop by a signal with one line and exit 128 + the signal. Without it: torchrun
    restarts the job (--max-restarts) whatever failed, so a mistake is printed once per attempt,
    then under about 30 lines of its ChildFailedError; so is every preemption or `scancel`
    (SignalException: https://github.com/pytorch/pytorch/pull/61602). Its agent has no notion of a
    failure not worth a restart: here it reads each worker's error file, whose "final"
    failures.leave_for_torchrun sets. Seen with torch 2.5 to 2.13."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    def final(failures: dict) -> bool:
        return any(f.error_file_data.get("final") for f in failures.values())

    log = logging.getLogger(api.__name__)

    def no_restart_if_final(monitor: Any, agent: Any, group: Any) -> Any:
        held: list[logging.LogRecord] = []  # its lines on a failure: said unless final
        log.addFilter(held.append)
        result = monitor(agent, group)
        log.removeFilter(held.append)
        if final(result.failures) and stop_restarts(agent):
            held.clear()
        for record in held:
            log.handle(record)
        return result

    wrap_agent_monitor(no_restart_if_final)
    logging.getLogger("torch.distributed.run").propagate = False  # plain lines, as from torchrun
    args = parse_args(argv)
    if args.rdzv_backend == "c10d" and (taken := taken_rendezvous(
            args.rdzv_endpoint, args.rdzv_id, args.local_addr)):
        print(f"error: {taken}", file=sys.stderr, flush=True)
        return 1
    try:
        run(args)
    except api.SignalException as stop:
        print(f"torchrun: stopped by {signal.Signals(stop.sigval).name}; its training processes "
              "were stopped too", file=sys.stderr, flush=True)
        return 128 + stop.sigval
    except ChildFailedError as failed:
        if not final(failed.failures):
            raise
        return 1
    return 0


if __name__ == "__main__":  # the SLURM scripts: python -m <package>.runtime.workarounds torchrun
    if sys.argv[1:2] != ["torchrun"]:
        sys.exit("usage: python -m <package>.runtime.workarounds torchrun [torchrun arguments]")
    sys.exit(torchrun_quietly(sys.argv[2:]))

