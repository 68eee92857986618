"""Checkpoints: written by rank 0 only, atomically, and loaded without unpickling arbitrary objects.

File names carry the optimizer step (`ckpt_step00000123.pt`), so the newest is the highest step.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from .distributed import SetupError

_NAME = re.compile(r"^ckpt_step(\d+)\.pt$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"ckpt_step{step:08d}.pt"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoints in `directory`, newest (highest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def save_checkpoint(state: dict[str, Any], directory: str | Path, step: int, keep_last: int) -> Path:
    """Write `state` atomically, then delete all but the newest `keep_last` (0 = keep all).

    A temp file in the same directory, fsync, then `os.replace`: a kill at any moment leaves either the
    old file set or the new one, never a half-written checkpoint under a real name.
    """
    path = checkpoint_path(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(".ckpt_step*.pt.tmp-*"):
        stale.unlink(missing_ok=True)  # left by a save that was killed half-way
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    if keep_last > 0:
        for old in list_checkpoints(directory)[keep_last:]:
            old.unlink(missing_ok=True)
    return path


def _fsync_dir(directory: Path) -> None:
    if sys.platform == "win32":
        return  # directories cannot be opened for fsync on Windows
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load with `weights_only=True`: tensors and plain Python types only, never arbitrary pickles."""
    return torch.load(path, map_location=map_location, weights_only=True)


def find_resumable(directory: str | Path,
                   map_location: str | torch.device = "cpu") -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads, and its contents. Broken ones (a kill during a copy, a full
    disk) are skipped with a warning, so the run falls back to the one before."""
    for path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path, map_location)
        except Exception as exc:
            print(f"warning: skipping unreadable checkpoint {path} ({type(exc).__name__}: {exc})",
                  file=sys.stderr, flush=True)
    return None


def load_for_resume(resume: str, directory: str | Path,
                    map_location: str | torch.device = "cpu") -> tuple[Path, dict[str, Any]] | None:
    """What `--resume` asks for: `never` -> None, `auto` -> newest readable or None, else that file."""
    if resume == "never":
        return None
    if resume == "auto":
        return find_resumable(directory, map_location)
    path = Path(resume)
    try:
        return path, load_checkpoint(path, map_location)
    except FileNotFoundError:
        raise SetupError(f"--resume {resume}: no such file; use --resume auto or --resume never") from None
    except Exception as exc:
        raise SetupError(f"--resume {resume}: cannot load it ({type(exc).__name__}); "
                         "pick another checkpoint or use --resume auto") from None
