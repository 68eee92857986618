"""What makes a resumed run continue exactly: the choice of checkpoint, agreed by every rank, and
each rank's random-number state.

Everything here talks to the other ranks through tensor collectives only. Object collectives
(`broadcast_object_list`, `all_gather_object`) would unpickle whatever a peer sends, which can run
code, and they need numpy; tensors need neither.
"""

from __future__ import annotations

import random
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import is_complete, list_checkpoints, read_meta
from .failures import SetupError


# ---------------------------------------------------------------------- rank 0 decides, all know
def broadcast_text(text: str | None, device: torch.device) -> str | None:
    """Rank 0's `text` on every rank (None stays None)."""
    data = text.encode() if dist.get_rank() == 0 and text is not None else b""
    length = torch.tensor([len(data) if dist.get_rank() != 0 or text is not None else -1],
                          dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    n = int(length.item())
    if n < 0:
        return None
    buffer = torch.zeros(n, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0 and n:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return bytes(buffer.tolist()).decode()


def agree(decide: Callable[[], str | None], device: torch.device) -> str | None:
    """Rank 0 runs `decide`; every rank returns its result, or raises its SetupError.

    Rank 0's failure reaches the others as a message, not as a broken connection, so every
    rank's output points to the real reason (the others stay quiet when they share rank 0's
    machine, whose own line already says it)."""
    outcome: str | None = None
    if dist.get_rank() == 0:
        try:
            result = decide()
            outcome = "ok\n" + ("" if result is None else "=" + result)
        except SetupError as exc:
            outcome = f"error\n{socket.gethostname()}\n{exc}"
            broadcast_text(outcome, device)
            raise
    outcome = broadcast_text(outcome, device)
    status, _, rest = outcome.partition("\n")
    if status == "error":
        host, _, message = rest.partition("\n")
        raise SetupError(f"rank 0 on {host}: {message}", quiet=host == socket.gethostname())
    return rest[1:] if rest.startswith("=") else None


# ---------------------------------------------------------------------- which checkpoint
def unreadable(path: Path) -> str | None:
    """Why a checkpoint cannot be resumed from, or None if it can. Reads only its metadata: the
    structure of a file (a truncated one fails here), the metadata of a folder."""
    if not is_complete(path):
        return "incomplete: its save did not finish"
    try:
        read_meta(path)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    return None


def pick_checkpoint(resume: str, directory: str | Path) -> Path | None:
    """What --resume asks for (rank 0): never -> None, auto -> the newest that reads, or PATH."""
    if resume == "never":
        return None
    if resume != "auto":
        why = unreadable(Path(resume))
        if why:
            raise SetupError(f"--resume {resume}: cannot load it ({why}); pick another checkpoint "
                             "or use --resume auto")
        return Path(resume)
    for path in list_checkpoints(directory):
        why = unreadable(path)
        if why is None:
            return path
        # A kill during a copy, a full disk: fall back to the one before.
        print(f"warning: skipping unreadable checkpoint {path} ({why})", file=sys.stderr,
              flush=True)
    return None


def check_same_shapes(model_state: dict[str, torch.Tensor], saved: dict[str, Any],
                      path: Path) -> None:
    """A checkpoint of another model is one clear line, not a load_state_dict traceback."""
    way_out = ("use --resume never to start over, or another --checkpoint-dir for the new model")
    for key, value in model_state.items():
        if key not in saved:
            raise SetupError(f"checkpoint {path} has no '{key}' (is it of another model?); "
                             f"{way_out}", everywhere=True)
        if tuple(saved[key].shape) != tuple(value.shape):
            raise SetupError(f"checkpoint {path} does not fit the model: '{key}' is "
                             f"{tuple(saved[key].shape)} there and {tuple(value.shape)} here; "
                             f"{way_out}", everywhere=True)
    extra = sorted(set(saved) - set(model_state))
    if extra:
        raise SetupError(f"checkpoint {path} has '{extra[0]}', which the model does not; "
                         f"{way_out}", everywhere=True)


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Settings that differ between a checkpoint's run and this one, as 'key: old -> new'."""
    launch_only = {"resume", "config", "nprocs", "local_rank"}
    return [f"{key}: {saved[key]!r} -> {now[key]!r}" for key in now
            if key in saved and key not in launch_only and saved[key] != now[key]]


# ---------------------------------------------------------------------- random-number state
def pack_rng_state(device: torch.device) -> torch.Tensor:
    """This process's random state as one byte tensor: torch (CPU), CUDA, and Python's."""
    version, internal, gauss = random.getstate()
    python = torch.tensor([version, *internal, gauss is not None], dtype=torch.int64)
    parts = [torch.get_rng_state(), python.view(torch.uint8),
             torch.tensor([gauss or 0.0], dtype=torch.float64).view(torch.uint8)]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return torch.cat(parts)


def unpack_rng_state(packed: torch.Tensor, device: torch.device) -> bool:
    """Restore what `pack_rng_state` saved; False if it came from another kind of device."""
    packed = packed.cpu()
    n_torch = torch.get_rng_state().numel()
    n_python = (1 + 625 + 1) * 8
    n_cuda = torch.cuda.get_rng_state(device).numel() if device.type == "cuda" else 0
    if packed.numel() != n_torch + n_python + 8 + n_cuda:
        return False
    torch.set_rng_state(packed[:n_torch].clone())
    python = packed[n_torch:n_torch + n_python].clone().view(torch.int64).tolist()
    gauss = packed[n_torch + n_python:n_torch + n_python + 8].clone().view(torch.float64).item()
    random.setstate((python[0], tuple(python[1:-1]), gauss if python[-1] else None))
    if n_cuda:
        torch.cuda.set_rng_state(packed[-n_cuda:].clone(), device)
    return True


def gather_rng_states(device: torch.device, comm_device: torch.device) -> torch.Tensor:
    """Every rank's packed random state, as a [world_size, n] tensor on every rank."""
    mine = pack_rng_state(device).to(comm_device)
    states = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(states, mine)
    return torch.stack(states).cpu()
