"""--checkpoint-dir for one run (rank 0): locked by the run writing into it; checkpoints of an
earlier run are moved aside, never deleted; `--keep-last` only prunes this run's own. Saves may
run in the background (--async-save) from a `Staging` copy."""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..failures import ProjectError, RunFailure, UsageError
from . import files, storage
from .storage import AnyPath, RemotePath

_TEMP = re.compile(r"^\.ckpt_step\d+.*\.tmp")
STALE_S = 3600  # an unfinished save in object storage older than this is removed


def probe(directory: RemotePath, timeout_s: float, flag: str = "--checkpoint-dir") -> None:
    """Write, list and delete a small object in `directory`: a missing bucket, bad credentials, an
    unreachable endpoint or a read-only prefix is one UsageError before training, in `timeout_s`."""
    key = f"{directory.key}/.write-probe-{socket.gethostname()}-{os.getpid()}"

    def attempt() -> None:
        directory.fs.pipe_file(key, b"probe\n")
        directory.fs.ls(directory.key, detail=False)
        directory.fs.rm_file(key)

    failure, where = storage.within(attempt, timeout_s), f"{flag} {storage.redact(directory.url)}"
    if isinstance(failure, TimeoutError):
        raise UsageError(f"{where}: {failure}; check AWS_ENDPOINT_URL and the network")
    if failure is not None:
        raise UsageError(f"{where}: {storage.diagnosis(directory.url, failure)}")


class CheckpointDir:
    """Rank 0's handle on --checkpoint-dir for one run: lock, set-aside, write, prune."""

    def __init__(self, directory: str | AnyPath, keep_last: int, timeout_s: float = 300) -> None:
        self.directory = storage.location(directory)
        self.remote, self.timeout_s = isinstance(self.directory, RemotePath), timeout_s
        self.keep_last, self.saved = keep_last, None  # saved: this run's newest complete one
        self.keep_step: int | None = None  # --keep-best's checkpoint: never pruned
        self._lock_file: Any = None
        self._thread: threading.Thread | None = None
        self._error: ProjectError | None = None

    def open(self) -> None:
        """Create and lock the folder, check it is writable, clear leftovers of killed saves.
        In object storage: a write probe, and unfinished saves an hour old are removed."""
        if self.remote:
            probe(self.directory, min(30.0, self.timeout_s / 2))
            try:
                for path in files.list_checkpoints(self.directory):
                    if not files.is_complete(path) and path.is_dir() and path.age_s() > STALE_S:
                        storage.remove(path)
            except OSError as exc:  # e.g. allowed to write but not to list
                raise UsageError(f"--checkpoint-dir {self.directory}: "
                                 f"{storage.diagnosis(str(self.directory), exc)}") from None
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle = open(self.directory / ".lock", "a+")
        except OSError as exc:
            raise UsageError(f"--checkpoint-dir {self.directory}: cannot write there "
                             f"({exc.strerror or exc}); choose a writable folder") from None
        try:  # exclusive; the system releases it when its holder dies: a killed run leaves none
            if os.name == "nt":  # no fcntl on Windows
                import msvcrt
                msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
            else:
                import fcntl
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process holds it
            handle.seek(0)
            owner = handle.read().strip() or "another process"
            handle.close()
            raise UsageError(f"--checkpoint-dir {self.directory} is in use by a run that is "
                             f"still going ({owner}); wait for it, or use another "
                             "--checkpoint-dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}\n")
        handle.flush()
        self._lock_file = handle
        for leftover in self.directory.iterdir():
            if _TEMP.match(leftover.name):
                storage.remove(leftover)

    def check_space(self, needed: int) -> None:
        if not self.remote and (free := shutil.disk_usage(self.directory).free) < needed:
            raise UsageError(f"--checkpoint-dir {self.directory} has {free / 2**20:.0f} MB free; "
                             f"a checkpoint of this model needs about {needed / 2**20:.0f} MB: "
                             "free space or choose another --checkpoint-dir")

    def close(self) -> None:
        self.wait()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def set_aside(self, resumed_from: Path | None) -> Path | None:
        """Move checkpoints that are not this run's history into `earlier-<time>/` (nothing is
        deleted): those after step S for a run resumed from step S of this folder (an abandoned
        continuation, or a damaged newest one), else all of them."""
        same_folder = resumed_from and resumed_from.resolve().parent == self.directory.resolve()
        keep_up_to = files.step_of(resumed_from) if same_folder else -1
        others = [p for p in files.list_checkpoints(self.directory)
                  if files.step_of(p) > keep_up_to]
        if not others:
            return None
        target = self.directory / f"earlier-{time.strftime('%Y%m%d-%H%M%S')}"
        target.mkdir(exist_ok=True)
        for path in others:
            storage.move(path, target / path.name)
        return target

    def prune(self) -> None:
        """Delete complete checkpoints beyond the newest --keep-last (never --keep-best's)."""
        if self.keep_last > 0:
            complete = [p for p in files.list_checkpoints(self.directory) if files.is_complete(p)]
            for old in complete[self.keep_last:]:
                if files.step_of(old) != self.keep_step:
                    storage.remove(old)

    def commit(self, tmp: AnyPath, final: AnyPath) -> None:
        """Give a finished temp file or folder its real name, then prune. (In object storage the
        folder was written under its real name: its meta.json, just written, completes it.)"""
        if not self.remote:
            os.replace(tmp, final)
            files.fsync_dir(self.directory)
        self.saved = final
        self.prune()

    def save_file(self, state: dict[str, Any], step: int) -> Path:
        path = files.checkpoint_path(self.directory, step)
        # Within 0.8 x --timeout-s: before the other ranks give up.
        files.write_file(state, path, files.newest_complete(self.saved), 0.8 * self.timeout_s)
        self.saved = path
        self.prune()
        return path

    def save_file_in_background(self, state: dict[str, Any], step: int, staging: Staging) -> None:
        """Copy the state to memory, then write it while training goes on (--async-save)."""
        self.wait()  # the staging buffers are free again only after the previous save
        copy = staging.copy(state)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies out of GPU memory have landed
        self.in_background(lambda: self.save_file(copy, step))

    def in_background(self, job: Callable[[], None]) -> None:
        """Run `job` (a save) on a thread; at most one at a time: wait for the previous first."""
        self.wait()

        def run() -> None:
            try:
                job()
            except ProjectError as exc:  # kept whole: its class and flags
                self._error = exc
            except BaseException as exc:  # DCP's CheckpointException too: no thread traceback
                why, again = storage.reason(exc), f"; {files.AGAIN}" if self.remote else ""
                self._error = RunFailure(f"a background checkpoint save failed ({why}); "
                                         f"{files.newest_complete(self.saved)}{again}")

        self._thread = threading.Thread(target=run, name="checkpoint-save", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class Staging:
    """Reusable CPU copies of a state's tensors, for a background save to write while training goes
    on: allocated once, refilled by each save (on a GPU, pinned: one DMA per tensor)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, state: Any, prefix: str = "") -> Any:
        if isinstance(state, torch.Tensor):
            buffer = self._buffers.get(prefix)
            if buffer is None or buffer.shape != state.shape or buffer.dtype != state.dtype:
                buffer = self._buffers[prefix] = torch.empty(state.shape, dtype=state.dtype,
                                                             device="cpu", pin_memory=state.is_cuda)
            return buffer.copy_(state.detach(), non_blocking=state.is_cuda)
        if isinstance(state, dict):
            return {k: self.copy(v, f"{prefix}/{k}") for k, v in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self.copy(v, f"{prefix}/{i}") for i, v in enumerate(state))
        return state
