"""What makes a resumed run continue exactly: which checkpoint (rank 0 chooses, every rank loads the
same one), the position inside the epoch, and each rank's random-number state.

Only tensor collectives here: object collectives (`broadcast_object_list`, `all_gather_object`)
unpickle whatever a peer sends, which can run code, and need numpy."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import Config
from ..failures import UsageError, warn
from ..optim import Optimization
from . import storage
from .files import (
    is_complete,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    saved_weights,
    step_of,
    unreadable,
)


# ---------------------------------------------------------------------- which checkpoint
def pick_checkpoint(resume: str, directory: str) -> storage.AnyPath | None:
    """What --resume asks for (rank 0): never -> None, auto, weights-only -> the newest, or PATH."""
    if resume == "never":
        return None
    if resume not in ("auto", "weights-only"):
        path = storage.location(resume)
        if inside := (list_checkpoints(path) if not is_complete(path) else []):
            raise UsageError(f"--resume {resume} is a folder of checkpoints, not one; name one of "
                             f"them (the newest is {inside[0]}), or use --resume auto "
                             f"--checkpoint-dir {resume}")
        if (why := unreadable(path, resuming=True)) and not path.exists():  # (local: checked)
            raise UsageError(f"--resume {resume}: {why}; name a checkpoint there, or use "
                             f"--resume auto --checkpoint-dir URL for the newest in a folder")
        if why:
            raise UsageError(f"--resume {resume}: cannot load it ({why}); pick another checkpoint "
                             "or use --resume auto")
        return path
    for path in list_checkpoints(directory):
        if (why := unreadable(path, resuming=True)) is None:
            return path
        # A kill during a copy, a full disk: fall back to the one before.
        warn(f"skipping unreadable checkpoint {path} ({why})")
    if resume == "weights-only":
        raise UsageError(f"--resume weights-only: no checkpoint in {storage.shown(directory)} to "
                         "take the weights of; give --checkpoint-dir the run's folder")
    return None


def newest_finite(directory: str, before_step: int) -> str:
    """Where to resume from when a checkpoint's weights are not finite (rank 0)."""
    from .export import model_and_meta
    for path in list_checkpoints(directory):
        if step_of(path) < before_step and unreadable(path, resuming=True) is None:
            weights, _ = model_and_meta(path, raw_weights=True)
            if all(t.isfinite().all() for t in weights.values() if t.is_floating_point()):
                return f"the newest finite one is {path}: use --resume {path}"
    return "no older checkpoint is finite: use --resume never to start over"


def check_same_shapes(model_state: dict[str, torch.Tensor], saved: dict[str, Any],
                      path: Path) -> None:
    """A checkpoint of another model is one clear line, not a load_state_dict traceback."""
    way_out = ("use --resume never to start over, or another --checkpoint-dir for the new model")
    for key, value in model_state.items():
        if key not in saved:
            raise UsageError(f"checkpoint {path} has no '{key}' (is it of another model?); "
                             f"{way_out}", everywhere=True)
        if tuple(saved[key].shape) != tuple(value.shape):
            raise UsageError(f"checkpoint {path} does not fit the model: '{key}' is "
                             f"{tuple(saved[key].shape)} there and {tuple(value.shape)} here; "
                             f"{way_out}", everywhere=True)
    if extra := sorted(set(saved) - set(model_state)):
        raise UsageError(f"checkpoint {path} has '{extra[0]}', which the model does not; "
                         f"{way_out}", everywhere=True)


def saved_model(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A local checkpoint's model tensors by name, unread (a file's stay on disk, mmap; a folder's,
    fsdp's, are their shapes in DCP's metadata), and its metadata."""
    if not path.is_dir():
        return (state := load_checkpoint(path, mmap=True))["model"], state
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
    return ({k[6:]: torch.empty(v.size, device="meta") for k, v in saved
             if k.startswith("model.")}, read_meta(path))


def check_resumable(cfg: Config, path: Path, task: Any) -> None:
    """What the run's resume would refuse, before any process starts: other shapes, and (unless
    --resume weights-only) other optimizers or schedules than the checkpoint's."""
    weights, meta = saved_model(path)
    with torch.device("meta"):  # the model's shapes, and its optimizers, without memory
        model = task.build_model(cfg)
        check_same_shapes(saved_weights(model), weights, path)
        if cfg.resume != "weights-only":
            cfg.total_steps = cfg.total_steps or 1  # (a schedule's length: not checked here)
            Optimization(model, cfg, torch.device("cpu"), cfg.total_steps,
                         configure=getattr(task, "configure_optimizer", None)
                         ).check_saved(meta, path)


def load_into(path: Path, model: torch.nn.Module, optim: Optimization, world_size: int,
              rank: int, batch_size: int, device: torch.device,
              weights_only: bool = False) -> dict[str, Any]:
    """Load a checkpoint (file or folder, from any layout) into this rank's model, optimizers and
    EMA (`weights_only`: model and EMA); returns its metadata. Random states are restored when
    the world and batch size are the same: then the run continues bit for bit."""
    from . import sharded  # torch.distributed.checkpoint: imported by the runs that resume
    ema, optimizers = optim.ema, type(optim.optimizers)() if weights_only else optim.optimizers
    check = (lambda meta, path: None) if weights_only else optim.check_saved
    if path.is_dir():
        meta = read_meta(path)
        check(meta, path)
        extra = {"ema": ema.state_dict()} if ema is not None and meta.get("has_ema") else {}
        rng = sharded.load(path, model, optimizers, meta, extra)  # loads the EMA into `extra`
        saved_ema = extra.get("ema")
    else:
        state = load_checkpoint(path)
        check_same_shapes(saved_weights(model), state["model"], path)
        check(state, path)
        sharded.set_full_state(model, optimizers, state["model"], state["optimizer"])
        meta, rng, saved_ema = state, state.get("rng"), state.get("ema")
    if ema is not None and saved_ema:
        ema.load_state_dict(saved_ema)
    elif ema is not None:  # a checkpoint of a run without one: the average starts here
        ema.restart()
        if rank == 0:
            print(f"note: {path} has no EMA; --ema-decay starts averaging from its weights",
                  flush=True)
    if (meta["world_size"], meta["batch_size"]) == (world_size, batch_size) and rng is not None:
        unpack_rng_state(rng[rank], device)
    return meta


def restore_position(meta: dict[str, Any], cfg: Config, world_size: int, batches_per_epoch: int,
                     path: Path, say: bool, data: dict[str, Any]) -> tuple[int, int, int]:
    """(epoch, batch of the epoch, step) to go on from. From another world or batch size: after
    the same number of samples; if the data shrank below that: the next epoch. Refused: `data`
    (the training set's summary) of another tokenizer or token file, or mid-epoch of another
    shuffle window."""
    epoch, batch, step = meta["epoch"], meta["batch_in_epoch"], meta["step"]
    if (saved := meta.get("data", {}).get("tokenizer")) and saved != data.get("tokenizer"):
        raise UsageError(f"{path} was trained on tokens of another tokenizer than --data's; use "
                         "--data with its shard set, or --resume never", everywhere=True)
    if (saved := meta.get("data", {}).get("file")) and saved != data.get("file"):  # a .bin's
        raise UsageError(f"{path} was trained on --data {saved}, not on this one "
                         f"({data.get('file', 'another kind of data')}); give that file again, "
                         "--resume weights-only to go on from its weights, or --resume never",
                         everywhere=True)
    per_batch = cfg.batch_size * world_size
    if (meta["world_size"], meta["batch_size"]) != (world_size, cfg.batch_size):
        seen = meta["samples_in_epoch"]
        batch = seen // per_batch // cfg.grad_accum * cfg.grad_accum
        if say and batch:
            warn(f"checkpoint is from {meta['world_size']} processes x batch {meta['batch_size']}; "
                 f"continuing epoch {epoch} after {batch * per_batch} of the {seen} samples "
                 "already seen (exact resume needs the same world and batch size)")
    if batch >= batches_per_epoch:
        if say:
            warn(f"{path.name} is {batch} batches into epoch {epoch}, which now has "
                 f"{batches_per_epoch}; going on with epoch {epoch + 1}")
        epoch, batch = epoch + 1, 0
    window = meta.get("config", {}).get("shuffle_window")
    if batch and window != data.get("shuffle_window", window):
        raise UsageError(f"{path} is part way through an epoch of --shuffle-window {window}: give "
                         "that window again (another would train samples twice or never)",
                         everywhere=True)
    return epoch, batch, step


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Settings that differ from the checkpoint's run as 'key: old -> new', the task's included."""
    launch_only = {"resume", "config", "nprocs", "local_rank", "task", "given", "total_steps"}
    saved, now = {**saved, **saved.get("task", {})}, {**now, **now.get("task", {})}
    return [f"{key}: {saved[key]!r} -> {now[key]!r}" for key in now
            if key in saved and key not in launch_only and saved[key] != now[key]]


def keep_retention(cfg: Config, saved: dict[str, Any]) -> list[str]:
    """Take the retention settings the command line leaves at their default from the checkpoint's
    run (changing `cfg`); returns notes on those given that differ from it. A resumed run never
    deletes what the earlier run kept because a flag was left at its default."""
    notes = []
    for key in ("keep_last", "keep_best"):
        if key not in saved or saved[key] == getattr(cfg, key):
            continue
        flag = f"--{key.replace('_', '-')}"
        if key in cfg.given:
            notes.append(f"{flag} {getattr(cfg, key)} given (the earlier run had {saved[key]}): "
                         "it applies to the checkpoints already there too")
        else:
            setattr(cfg, key, saved[key])
            notes.append(f"{flag} {saved[key]}, as in the earlier run (give {flag} to change it)")
    return notes


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


def unpack_rng_state(packed: torch.Tensor, device: torch.device) -> None:
    """Restore what `pack_rng_state` saved, unless it came from another kind of device."""
    packed = packed.cpu()
    n_torch, n_python = torch.get_rng_state().numel(), (1 + 625 + 1) * 8
    n_cuda = torch.cuda.get_rng_state(device).numel() if device.type == "cuda" else 0
    if packed.numel() != n_torch + n_python + 8 + n_cuda:
        return
    torch.set_rng_state(packed[:n_torch].clone())
    python = packed[n_torch:n_torch + n_python].clone().view(torch.int64).tolist()
    gauss = packed[n_torch + n_python:n_torch + n_python + 8].clone().view(torch.float64).item()
    random.setstate((python[0], tuple(python[1:-1]), gauss if python[-1] else None))
    if n_cuda:
        torch.cuda.set_rng_state(packed[-n_cuda:].clone(), device)


def gather_rng_states(device: torch.device, comm_device: torch.device) -> torch.Tensor:
    """Every rank's packed random state, as a [world_size, n] tensor on every rank."""
    mine = pack_rng_state(device).to(comm_device)
    states = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(states, mine)
    return torch.stack(states).cpu()
