"""Errors a user can act on, and what a rank says when its peers fail.

Every known failure is a `ProjectError`: a `UsageError` (a mistake the user fixes) or a `RunFailure`
(something failed while running). The entry point prints it as one `error: ...` line and exits 1.
Three rules keep the output of a many-rank job readable:

- an error every rank finds (a bad flag value, data that does not fit the model) is printed once per
  node, by local rank 0 (`everywhere=True`);
- an error of one rank (rank 0 cannot write a checkpoint, rank 1 cannot read a sample) is printed by
  that rank, which also leaves it in the job's key-value store; a peer that then loses contact
  points to it instead of blaming the broken connection;
- a rank that lost contact and finds no such record names the ranks that stopped answering."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

QUIET_EXIT_DELAY_S = 1.0
PRINTER_WAIT_S = 10.0  # under torchrun: how long a silent rank waits for local rank 0's line
# What gloo and NCCL say when a peer died, stalled past --timeout-s, or dropped its connection.
_CLOSED = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused")
# "pair closure": gloo's own timeout, which can fire in a backward before our deadline does.
_COMMUNICATION_FAILURES = (*_CLOSED, "Timed out", "timed out", "NCCL error", "Socket Timeout",
                           "pair closure")
# How long the error path may talk to the store. A store whose host vanished answers nothing: a call
# would block for the store timeout (--timeout-s) or TCP's retransmission timeout (minutes).
RECORD_S = 2.0
EXPLAIN_S = 5.0


class ProjectError(RuntimeError):
    """A known failure, printed as one `error: ...` line. `everywhere`: every rank found it, only
    local rank 0 prints it; `quiet`: another rank prints it (this rank only learned of it)."""

    def __init__(self, message: str, *, everywhere: bool = False, quiet: bool = False) -> None:
        super().__init__(message)
        self.everywhere, self.quiet = everywhere, quiet


class UsageError(ProjectError):
    """A mistake the user fixes: a flag, the environment, the data, the task's code."""


class RunFailure(ProjectError):
    """A failure while running: a write or load, a NaN loss, peers that stopped answering."""


class LostContact(RunFailure):
    """This rank lost its peers and the job's store: its host may be cut off from the network."""


# An error crosses ranks and processes as text: its class travels by name, back through KINDS.
KINDS = {c.__name__: c for c in (UsageError, RunFailure, LostContact)}


def kind_name(exc: BaseException) -> str:
    """The name of `exc`'s nearest class in KINDS; a crash is a RunFailure."""
    return next((c.__name__ for c in type(exc).__mro__ if c in KINDS.values()), "RunFailure")


def local_rank_from_env() -> int:
    """This process's local rank as far as the launcher's variables tell (0 when none does)."""
    values = (os.environ.get(name, "") for name in ("LOCAL_RANK", "SLURM_LOCALID"))
    return next((int(value) for value in values if value.isdigit()), 0)


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


def report_error(exc: ProjectError, local_rank: int | None = None) -> None:
    final = exc.everywhere or isinstance(exc, UsageError)  # a restart cures neither
    if exc.quiet:  # printed by a rank that may be on another node, a moment behind
        leave_for_torchrun(str(exc), final)
        time.sleep(QUIET_EXIT_DELAY_S)
    elif exc.everywhere:
        say_once_per_node(str(exc), local_rank_from_env() if local_rank is None else local_rank)
    else:
        _say(str(exc), final)


def say_once_per_node(line: str, local_rank: int) -> None:
    """Print `error: line` on local rank 0 only. The others wait until it is out: a rank that
    exited first would have its launcher stop rank 0 before it spoke (a failed job that says
    nothing). Under torchrun rank 0's error file shows when; elsewhere a pause must do."""
    if local_rank == 0:
        _say(line)
        return
    leave_for_torchrun(line)
    own = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    printer = Path(own).parent.parent / "0" / "error.json" if own else None
    if printer is None or not printer.parent.is_dir():
        time.sleep(QUIET_EXIT_DELAY_S)
        return
    deadline = time.monotonic() + PRINTER_WAIT_S
    while not printer.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _say(line: str, final: bool = True) -> None:
    sys.stderr.write(f"error: {line}\n")  # one write: lines of several ranks do not interleave
    sys.stderr.flush()
    leave_for_torchrun(line, final)  # after the line: a waiting rank takes the file as the sign


def leave_for_torchrun(line: str, final: bool = True) -> None:
    """torchrun ends a failed job with a traceback and a box naming the first rank that failed; the
    file it gives each worker puts this line in that box, printed last, in place of a doc link.
    `final`: no restart can cure it (a mistake, or what every rank found, not a lost peer); the
    agent of runtime/workarounds.py then ends the job at once, without that box."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not path or os.path.exists(path):
        return
    info = {"py_callstack": line, "timestamp": str(int(time.time()))}
    with suppress(OSError):  # else the box shows torch's link; the line itself is printed
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"message": {"message": line, "extraInfo": info}, "final": final}, handle)


def is_communication_failure(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistError) or any(t in str(exc) for t in _COMMUNICATION_FAILURES)


def bounded(call: Callable[[], Any], seconds: float) -> Any:
    """`call()` in a helper thread; TimeoutError after `seconds` (left behind: the process ends)."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name="store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise TimeoutError(f"no answer within {seconds:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


class PeerErrors:
    """Failure records in the job's key-value store, which every rank reaches. Under torchrun it
    lives in the launcher's agent and outlives the workers; elsewhere rank 0 hosts it, so rank 0's
    own failures reach peers through the collectives that agree on its decisions instead (see
    `agree`). Every store call here is bounded in time: the store may have gone with a host."""

    def __init__(self, store: Any, rank: int, world_size: int, address: str = "",
                 store_at: str = "") -> None:
        """address: this rank's address on the job's network (host names may repeat);
        store_at: where the store is, for messages."""
        self.store, self.rank, self.world_size, self.store_at = store, rank, world_size, store_at
        self.host = socket.gethostname() + (f" ({address})" if address else "")

    def announce(self) -> None:
        """Say where this rank runs, so a peer can name the host of a rank that went silent."""
        with suppress(Exception):
            bounded(lambda: self.store.set(f"host/{self.rank}", self.host), RECORD_S)

    def record(self, message: str, kind: str) -> None:
        """Leave this rank's error and kind for its peers (best effort: the store may be gone)."""
        with suppress(Exception):
            bounded(lambda: self.store.set(f"error/{self.rank}",
                                           f"{self.host}\n{kind}\n{message}"), RECORD_S)

    def _look(self, wait_s: float, closed: bool) -> ProjectError | list[str]:
        """A peer's own error, or the ranks that did not mark the failure within `wait_s`."""
        self.store.set(f"comm_failure/{self.rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            for rank in range(self.world_size):
                if rank != self.rank and self.store.check([f"error/{rank}"]):
                    host, kind, message = self.store.get(f"error/{rank}").decode().split("\n", 2)
                    return KINDS.get(kind, RunFailure)(
                        f"rank {self.rank}: stopped because rank {rank} on {host} failed: "
                        f"{message}", quiet=host == self.host)
            missing = [r for r in range(self.world_size)
                       if not self.store.check([f"comm_failure/{r}"])]
            # Two ranks: if the other one left no record, it is the one that is gone.
            if (not missing or time.monotonic() > deadline
                    or (closed and len(missing) == 1 and self.world_size == 2)):
                return [f"{r} on {self._host_of(r)}" for r in missing]
            time.sleep(0.05)

    def _host_of(self, rank: int) -> str:
        key = f"host/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else "an unknown host"

    def explain(self, exc: BaseException, timeout_s: float) -> ProjectError:
        """The error to raise on this rank after a collective failed with `exc`."""
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # A closed connection means the peer is gone (noticed within milliseconds): a short look is
        # enough. A stalled peer never answers: wait longer for the live ones to mark themselves.
        closed = any(text in first_line for text in _CLOSED)
        try:
            found = bounded(lambda: self._look(0.5 if closed else 3.0, closed), EXPLAIN_S)
        except Exception:  # the store may have died with the rank or the host that held it
            return LostContact(f"rank {self.rank} on {self.host}: lost contact with the other "
                               f"ranks ({first_line}) and with the job's store{self.store_at}, "
                               "which does not answer either: this host may have dropped off the "
                               "network, or the store's host is gone; see the other ranks' output")
        if isinstance(found, ProjectError):
            return found
        silent = ", ".join(found) if found else "none found (all saw the failure)"
        return RunFailure(
            f"rank {self.rank}: communication with the other ranks failed ({first_line}); "
            f"rank(s) that stopped answering: {silent}. A rank that dies or hangs longer than "
            f"--timeout-s={timeout_s:g} ends the job; see that rank's own output for why")


def broadcast_text(text: str | None, device: torch.device) -> str | None:
    """Rank 0's `text` on every rank (None stays None)."""
    data = text.encode() if dist.get_rank() == 0 and text is not None else b""
    length = torch.tensor([len(data) if dist.get_rank() != 0 or text is not None else -1],
                          dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    if (n := int(length.item())) < 0:
        return None
    buffer = torch.zeros(n, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0 and n:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return bytes(buffer.tolist()).decode()


def agree(decide: Callable[[], str | None], device: torch.device) -> str | None:
    """Rank 0 runs `decide`; every rank returns its result, or raises its error's class. Rank 0's
    failure reaches the others as a message, not a broken connection, so every rank's output points
    to the reason (ranks on rank 0's machine stay quiet: its own line says it)."""
    outcome: str | None = None
    if dist.get_rank() == 0:
        try:
            result = decide()
            outcome = "ok\n" + ("" if result is None else "=" + result)
        except ProjectError as exc:
            outcome = f"error\n{kind_name(exc)}\n{socket.gethostname()}\n{exc}"
            broadcast_text(outcome, device)
            raise
    outcome = broadcast_text(outcome, device)
    status, _, rest = outcome.partition("\n")
    if status == "error":
        kind, host, message = rest.split("\n", 2)
        raise KINDS.get(kind, RunFailure)(f"rank 0 on {host}: {message}",
                                          quiet=host == socket.gethostname())
    return rest[1:] if rest.startswith("=") else None
