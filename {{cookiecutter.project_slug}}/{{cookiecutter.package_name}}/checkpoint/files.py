"""Checkpoints on disk: written atomically, never lost, loaded without unpickling code.

Two formats, one naming scheme (the step is in the name, so the newest is the highest step):
- `ckpt_stepNNNNNNNN.pt`: one file, written by rank 0 (data_parallel, model_parallel_2).
- `ckpt_stepNNNNNNNN/`: a torch.distributed.checkpoint (DCP) folder in which every rank writes its
  own shards (fsdp), plus `meta.json` with the position in training.
Both are written under a temporary name and renamed when complete, so a kill at any moment leaves
either the old set or the new one (folder.py: the run's folder, its lock and pruning). The folder
may be a URL (s3://bucket/prefix): storage.py says how a checkpoint there is complete."""

from __future__ import annotations

import json
import os
import pickletools
import re
import sys
import tempfile
import zipfile
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

from ..failures import RunFailure
from . import storage
from .storage import AnyPath, RemotePath

CHECKPOINT_NAME = re.compile(r"^ckpt_step(\d{8,})(\.pt)?$")
META = "meta.json"  # in a checkpoint folder: everything but the tensors
AGAIN = "run the same command to resume from it once the storage works"


def checkpoint_path(directory: str | AnyPath, step: int, sharded: bool = False) -> AnyPath:
    return storage.location(directory) / f"ckpt_step{step:08d}{'' if sharded else '.pt'}"


def step_of(path: AnyPath) -> int:
    if not (match := CHECKPOINT_NAME.match(path.name)):
        raise ValueError(f"{path} is not named like a checkpoint (ckpt_stepNNNNNNNN)")
    return int(match.group(1))


def list_checkpoints(directory: str | AnyPath) -> list[AnyPath]:
    """Checkpoints (files and folders) in `directory`, newest (highest step) first."""
    if not (directory := storage.location(directory)).is_dir():
        return []
    found = [(step_of(p), p) for p in directory.iterdir() if CHECKPOINT_NAME.match(p.name)]
    return [p for _, p in sorted(found, reverse=True)]


def is_complete(path: AnyPath) -> bool:
    """A file is complete once it has its name; a folder also needs DCP's metadata and ours."""
    if path.is_dir():
        return (path / ".metadata").is_file() and (path / META).is_file()
    return path.is_file() and path.stat().st_size > 0


def load_checkpoint(path: str | AnyPath, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint file, loaded `weights_only` (never code); `mmap`: tensors read when used."""
    return torch.load(storage.local_copy(storage.location(path)), map_location="cpu",
                      weights_only=True, mmap=mmap)


def read_meta(path: AnyPath) -> dict[str, Any]:
    """Position and settings of a checkpoint, without its tensors."""
    if path.is_dir():
        return json.loads((path / META).read_text())
    state = load_checkpoint(path, mmap=True)
    return {k: v for k, v in state.items() if k not in ("model", "optimizer", "rng")}


def unreadable(path: AnyPath, resuming: bool = False) -> str | None:
    """Why a checkpoint cannot be loaded (or, `resuming`, resumed from), or None if it can. Reads
    only its structure (a truncated file fails here) and its metadata, not its tensors."""
    if not path.exists():
        return missing(path)
    if path.is_dir() and not is_complete(path):
        return ("incomplete: its save did not finish" if any(path.glob("*.distcp"))
                else "a folder without a checkpoint's .metadata and meta.json")
    if not is_complete(path):
        return "empty: its save did not finish"
    if path.is_file() and not zipfile.is_zipfile(storage.local_copy(path)):
        return "not a checkpoint file: torch.save writes a zip archive; or one cut short"
    if path.is_dir() and isinstance(path, Path):  # a bucket's objects are whole or absent
        try:  # DCP's .metadata, read as opcodes: nothing is built
            list(pickletools.genops((path / ".metadata").read_bytes()))
        except ValueError:
            return "its .metadata is cut short (a copy that did not finish?)"
    try:
        keys = set(read_meta(path)) if path.is_dir() else set(load_checkpoint(path, mmap=True))
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    if "step" not in keys or (path.is_file() and "model" not in keys):
        return ("not a checkpoint of this project: it has no 'model' and 'step' (a torch.save of "
                "something else?)")
    if resuming and path.is_file() and "optimizer" not in keys:
        return ("an export, which holds the model's weights only: resume from a checkpoint of "
                "--checkpoint-dir")
    return None


def missing(path: AnyPath) -> str:
    """What an error line says of a checkpoint path where nothing is."""
    return ("nothing is stored at that URL" if isinstance(path, RemotePath)
            else "no such file or folder")


def fsync_dir(directory: Path) -> None:
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
    storage: a local file, then one upload (tries within `timeout_s`; the error names `newest`)."""
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
        fallback = f"{newest}; " if newest else ""
        raise RunFailure(f"cannot write checkpoint {path} ({why}); {fallback}free space or "
                         "choose another --checkpoint-dir") from None
    finally:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def newest_complete(saved: AnyPath | None) -> str:
    """The newest complete checkpoint for an error line, as the run kept it (storage may fail)."""
    return (f"the newest complete checkpoint is {saved}" if saved is not None
            else "no checkpoint of this run is complete yet")


def rebuilt_weights(model: torch.nn.Module) -> set[str]:
    """The state_dict names of the weights build_model makes again at every start, which
    checkpoints and the EMA leave out: the model's `rebuilt_weights`, where task.py sets one (a
    LoRA run's frozen base model, read from its folder each time), else none."""
    return set(getattr(model, "rebuilt_weights", ()))


def saved_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The part of the model's state_dict that a checkpoint holds: all but rebuilt_weights."""
    rebuilt = rebuilt_weights(model)
    return {name: t for name, t in model.state_dict().items() if name not in rebuilt}
