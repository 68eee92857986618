"""Checkpoints on disk: written atomically, never lost, loaded without unpickling code.

Two formats, one naming scheme (the step is in the name, so the newest is the highest step):
- `ckpt_stepNNNNNNNN.pt`: one file written by rank 0 (data_parallel, model_parallel_2). It loads
  with `torch.load(path, weights_only=True)`.
- `ckpt_stepNNNNNNNN/`: a torch.distributed.checkpoint (DCP) folder in which every rank writes its
  own shards (fsdp), plus `meta.json` with the position in training.
Both are written under a temporary name and renamed when complete, so a kill at any moment leaves
either the old set or the new one. The folder is locked by the run writing into it; checkpoints of
an earlier run are moved aside, never deleted; `--keep-last` only prunes this run's own.
The folder may be a URL (s3://bucket/prefix): storage.py says how a checkpoint there is complete.

    python -m {{ cookiecutter.package_name }}.checkpoint export SRC OUT.pt   # one weights_only file
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import storage
from .ema import model_state
from .failures import SetupError
from .storage import AnyPath, RemotePath

_NAME = re.compile(r"^ckpt_step(\d{8,})(\.pt)?$")
_TEMP = re.compile(r"^\.ckpt_step\d+.*\.tmp")
META = "meta.json"  # in a checkpoint folder: everything but the tensors


STALE_S = 3600  # an unfinished save in object storage older than this is removed


def checkpoint_path(directory: str | AnyPath, step: int, sharded: bool = False) -> AnyPath:
    return storage.location(directory) / f"ckpt_step{step:08d}{'' if sharded else '.pt'}"


def step_of(path: AnyPath) -> int:
    match = _NAME.match(path.name)
    if not match:
        raise ValueError(f"{path} is not named like a checkpoint (ckpt_stepNNNNNNNN)")
    return int(match.group(1))


def list_checkpoints(directory: str | AnyPath) -> list[AnyPath]:
    """Checkpoints (files and folders) in `directory`, newest (highest step) first."""
    directory = storage.location(directory)
    if not directory.is_dir():
        return []
    found = [(step_of(p), p) for p in directory.iterdir() if _NAME.match(p.name)]
    return [p for _, p in sorted(found, reverse=True)]


def is_complete(path: AnyPath) -> bool:
    """A file is complete once it has its name; a folder also needs DCP's metadata and ours."""
    if path.is_dir():
        return (path / ".metadata").is_file() and (path / META).is_file()
    return path.is_file() and path.stat().st_size > 0


def load_checkpoint(path: str | AnyPath,
                    map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint file, loaded with `weights_only=True`: tensors and plain types, never code."""
    return torch.load(storage.local_copy(storage.location(path)), map_location=map_location,
                      weights_only=True)


def read_meta(path: AnyPath) -> dict[str, Any]:
    """Position and settings of a checkpoint, without its tensors."""
    if path.is_dir():
        return json.loads((path / META).read_text())
    state = torch.load(storage.local_copy(path), map_location="cpu", weights_only=True, mmap=True)
    return {k: v for k, v in state.items() if k not in ("model", "optimizer", "rng")}


def unreadable(path: AnyPath, resuming: bool = False) -> str | None:
    """Why a checkpoint cannot be loaded (or, `resuming`, resumed from), or None if it can. Reads
    only its structure (a truncated file fails here) and its metadata, not its tensors."""
    if path.is_dir() and not is_complete(path):
        if any(path.glob("*.distcp")):
            return "incomplete: its save did not finish"
        return "a folder without a checkpoint's .metadata and meta.json"
    if not is_complete(path):
        return "empty: its save did not finish"
    if path.is_file() and not zipfile.is_zipfile(storage.local_copy(path)):
        return "not a checkpoint file: torch.save writes a zip archive; or one cut short"
    try:
        keys = set(read_meta(path)) if path.is_dir() else set(
            torch.load(storage.local_copy(path), map_location="cpu", weights_only=True,
                       mmap=True))
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    if "step" not in keys or (path.is_file() and "model" not in keys):
        return ("not a checkpoint of this project: it has no 'model' and 'step' (a torch.save of "
                "something else?)")
    if resuming and path.is_file() and "optimizer" not in keys:
        return ("an export, which holds the model's weights only: resume from a checkpoint of "
                "--checkpoint-dir")
    return None


def _fsync_dir(directory: Path) -> None:
    if sys.platform == "win32":
        return  # directories cannot be opened for fsync on Windows
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(state: dict[str, Any], path: AnyPath, newest: str = "",
               timeout_s: float = 300) -> None:
    """torch.save to a temp file in the same folder, fsync, rename: all or nothing. In object
    storage: to a local temp file, then one upload, each try within `timeout_s` (`newest` names
    the checkpoint to fall back on if it fails)."""
    if isinstance(path, RemotePath):
        with tempfile.TemporaryDirectory(prefix="ckpt-upload-") as tmp:
            write_file(state, Path(tmp) / path.name)
            storage.upload(Path(tmp) / path.name, path, newest, timeout_s)
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as either
        why = exc.__context__ if isinstance(exc, RuntimeError) and exc.__context__ else exc
        why = getattr(why, "strerror", None) or str(why).strip().splitlines()[0]
        raise SetupError(f"cannot write checkpoint {path} ({why}); free space or choose another "
                         "--checkpoint-dir") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    _fsync_dir(path.parent)


def _lock(handle: Any) -> bool:
    """Take an exclusive lock on an open file; False if another process holds it. The operating
    system releases it when the holder dies, so a killed run never leaves it stale."""
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt
        try:
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def newest_complete(saved: AnyPath | None) -> str:
    """The newest complete checkpoint, as an error line names it (kept by the run, not asked of
    the storage, which may be what failed)."""
    return (f"the newest complete checkpoint is {saved}" if saved is not None
            else "no checkpoint of this run is complete yet")


class CheckpointDir:
    """Rank 0's handle on --checkpoint-dir for one run: lock, set-aside, write, prune."""

    def __init__(self, directory: str | AnyPath, keep_last: int, timeout_s: float = 300) -> None:
        self.directory = storage.location(directory)
        self.remote = isinstance(self.directory, RemotePath)
        self.timeout_s = timeout_s
        self.saved: AnyPath | None = None  # this run's newest complete checkpoint
        self.keep_last = keep_last
        self.keep_step: int | None = None  # --keep-best's checkpoint: never pruned
        self._lock_file: Any = None
        self._thread: threading.Thread | None = None
        self._error: SetupError | None = None

    def open(self) -> None:
        """Create and lock the folder, check it is writable, clear leftovers of killed saves.
        In object storage: a write probe, and unfinished saves an hour old are removed."""
        if self.remote:
            storage.probe(self.directory, min(30.0, self.timeout_s / 2))
            try:
                for path in list_checkpoints(self.directory):
                    if not is_complete(path) and path.is_dir() and path.age_s() > STALE_S:
                        storage.remove(path)
            except OSError as exc:  # e.g. allowed to write but not to list
                raise SetupError(f"--checkpoint-dir {self.directory}: "
                                 f"{storage.diagnosis(str(self.directory), exc)}") from None
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle = open(self.directory / ".lock", "a+")
        except OSError as exc:
            raise SetupError(f"--checkpoint-dir {self.directory}: cannot write there "
                             f"({exc.strerror or exc}); choose a writable folder") from None
        if not _lock(handle):
            handle.seek(0)
            owner = handle.read().strip() or "another process"
            handle.close()
            raise SetupError(f"--checkpoint-dir {self.directory} is in use by a run that is still "
                             f"going ({owner}); wait for it, or use another --checkpoint-dir")
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}\n")
        handle.flush()
        self._lock_file = handle
        for leftover in self.directory.iterdir():
            if _TEMP.match(leftover.name):
                storage.remove(leftover)

    def check_space(self, needed: int) -> None:
        if self.remote:
            return
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise SetupError(f"--checkpoint-dir {self.directory} has {free / 2**20:.0f} MB free; "
                             f"a checkpoint of this model needs about {needed / 2**20:.0f} MB: "
                             "free space or choose another --checkpoint-dir")

    def close(self) -> None:
        self.wait()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def set_aside(self, resumed_from: Path | None) -> Path | None:
        """Move checkpoints that are not this run's history into `earlier-<time>/`.

        A run that resumes from step S of this folder continues its history: only checkpoints
        after S (an abandoned continuation, or a damaged newest one) move. A run that starts over,
        or resumes from another folder, moves them all. Nothing is deleted."""
        same_folder = (resumed_from is not None
                       and storage.location(str(resumed_from)).resolve().parent
                       == self.directory.resolve())
        keep_up_to = step_of(resumed_from) if same_folder else -1
        others = [p for p in list_checkpoints(self.directory) if step_of(p) > keep_up_to]
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
            complete = [p for p in list_checkpoints(self.directory) if is_complete(p)]
            for old in complete[self.keep_last:]:
                if step_of(old) != self.keep_step:
                    storage.remove(old)

    def commit(self, tmp: AnyPath, final: AnyPath) -> None:
        """Give a finished temp file or folder its real name, then prune. (In object storage the
        folder was written under its real name: its meta.json, just written, completes it.)"""
        if not self.remote:
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        self.saved = final
        self.prune()

    def newest(self) -> str:
        return newest_complete(self.saved)

    # ------------------------------------------------------------------ writing (rank 0)
    def save_file(self, state: dict[str, Any], step: int) -> Path:
        path = checkpoint_path(self.directory, step)
        write_file(state, path, self.newest(), 0.8 * self.timeout_s)  # before the others give up
        self.saved = path
        self.prune()
        return path

    def save_file_in_background(self, state: dict[str, Any], step: int, staging: Staging) -> None:
        """Copy the state to memory, then write it while training goes on (--async-save)."""
        self.wait()  # the staging buffers are free again only after the previous save
        snapshot = staging.copy(state)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies out of GPU memory have landed
        self.in_background(lambda: self.save_file(snapshot, step))

    def in_background(self, job: Callable[[], None]) -> None:
        """Run `job` (a save) on a thread; at most one at a time: wait for the previous first."""
        self.wait()

        def run() -> None:
            try:
                job()
            except SetupError as exc:
                self._error = exc
            except Exception as exc:  # report it at the next save instead of losing it
                self._error = SetupError(f"background checkpoint save failed: {exc!r}")

        self._thread = threading.Thread(target=run, name="checkpoint-save", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for a background save; raise its error, if it had one."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class Staging:
    """Reusable CPU copies of a state's tensors, so a background save writes a snapshot while
    training changes the live tensors. The buffers are allocated once and refilled by each save
    (on a GPU, in pinned memory: the copy out of GPU memory is one DMA per tensor)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, state: Any, prefix: str = "") -> Any:
        if isinstance(state, torch.Tensor):
            buffer = self._buffers.get(prefix)
            if buffer is None or buffer.shape != state.shape or buffer.dtype != state.dtype:
                buffer = torch.empty(state.shape, dtype=state.dtype, device="cpu",
                                     pin_memory=state.is_cuda)
                self._buffers[prefix] = buffer
            return buffer.copy_(state.detach(), non_blocking=state.is_cuda)
        if isinstance(state, dict):
            return {k: self.copy(v, f"{prefix}/{k}") for k, v in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self.copy(v, f"{prefix}/{i}") for i, v in enumerate(state))
        return state


def export(source: AnyPath, output: AnyPath, raw_weights: bool = False) -> None:
    """Any checkpoint (file or folder) as one file that loads with `weights_only=True`: `model`
    (the plain state_dict: the EMA's weights if the run kept one, unless `raw_weights`), which
    weights those are, epoch, step, world_size and config."""
    model, meta = model_and_meta(source, raw_weights)
    keep = ("epoch", "step", "world_size", "config", "weights")
    write_file({"model": model, **{k: meta[k] for k in keep if k in meta}}, output)


def model_and_meta(source: AnyPath, raw_weights: bool = False) -> tuple[dict[str, Any],
                                                                         dict[str, Any]]:
    """The plain model state_dict of any checkpoint (file, folder or export) and its metadata
    (with `weights`: "ema" or "raw"). A checkpoint with an EMA gives the EMA's weights unless
    `raw_weights`."""
    try:
        found = source.exists()
    except OSError as exc:  # object storage: credentials, endpoint
        raise SetupError(f"{source}: {storage.diagnosis(str(source), exc)}") from None
    if not found:
        raise SetupError(f"{source}: no such file or folder")
    why = unreadable(source)
    if why:
        raise SetupError(f"{source}: cannot load it ({why})")
    if source.is_dir():
        state, meta = load_full_state(storage.local_copy(source)), read_meta(source)
    else:
        state = meta = load_checkpoint(source)
    averaged = bool(state.get("ema")) and not raw_weights
    return model_state(state, raw_weights), {**meta, "weights": "ema" if averaged else
                                             meta.get("weights", "raw")}


def load_full_state(path: Path) -> dict[str, Any]:
    """A checkpoint folder's state with whole tensors, without a process group (export)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(path), str(whole))
        return torch.load(whole, map_location="cpu", weights_only=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {__package__}.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write any checkpoint as one weights_only file")
    exp.add_argument("source", help="a checkpoint file or folder: a path or a URL")
    exp.add_argument("output", help="the file to write: a path or a URL")
    exp.add_argument("--raw-weights", action="store_true",
                     help="the model's own weights, not the EMA's (for a run with --ema-decay)")
    args = parser.parse_args(argv)
    try:
        export(storage.given(args.source), storage.given(args.output), args.raw_weights)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
