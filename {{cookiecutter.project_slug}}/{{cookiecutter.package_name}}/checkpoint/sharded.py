"""Model and optimizer state for every layout; sharded checkpoints (torch.distributed.checkpoint).

`get_state_dict` / `set_state_dict` speak every layout: a DDP or split model gives plain tensors,
an FSDP2 model its local shards (DTensors). DCP writes each rank's shards into one checkpoint
folder and reads them back on any number of ranks, resharding as needed. Rank 0 adds `meta.json`
and gives the folder its real name (folder.py's commit) once DCP has written its `.metadata` (the
last file, after every rank's data): a folder with the real name is complete."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..failures import RunFailure, agree
from ..runtime.torch_private import reusable_stager
from . import storage
from .files import AGAIN, META, checkpoint_path, newest_complete, rebuilt_weights
from .folder import CheckpointDir
from .storage import AnyPath, RemotePath

if TYPE_CHECKING:
    from ..optim import Optimizers


def _fqn_optimizer_state(model: nn.Module, optimizers: Optimizers,
                         state: dict[str, Any]) -> dict[str, Any]:
    """A file checkpoint's optimizer state (each optimizer's parameters numbered in its own
    order) with parameter names instead, merged over the optimizers: what set_state_dict takes."""
    names = {id(p): name for name, p in model.named_parameters()}
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for name, optimizer in optimizers.items():
        own = state if list(optimizers) == ["default"] else state[name]
        fqns = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        merged["state"].update({fqns[i]: s for i, s in own["state"].items()})
        merged["param_groups"] += [{**g, "params": [fqns[i] for i in g["params"]]}
                                   for g in own["param_groups"]]
    return merged


def set_full_state(model: nn.Module, optimizers: Optimizers, model_state: dict[str, Any],
                   optimizer_state: dict[str, Any]) -> None:
    """Load a file checkpoint's full (unsharded) state into any layout. Weights it leaves out
    (files.rebuilt_weights) stay as built; resume.check_same_shapes checked the rest."""
    strict = not rebuilt_weights(model)
    if not any(type(p).__name__ == "DTensor" for p in model.parameters()):  # not fsdp's shards
        model.load_state_dict(model_state, strict=strict)
        optimizers.load_state_dict(optimizer_state)
        return
    set_state_dict(model, list(optimizers.values()), model_state_dict=model_state,
                   optim_state_dict=_fqn_optimizer_state(model, optimizers, optimizer_state),
                   options=StateDictOptions(full_state_dict=True, strict=strict))


def saved_state(model: nn.Module, optimizers: Optimizers) -> tuple[dict, dict]:
    """The model's state as a checkpoint folder holds it (all but files.rebuilt_weights), and the
    optimizers' (by parameter name): local shards under fsdp."""
    model_state, optimizer_state = get_state_dict(model, list(optimizers.values()))
    rebuilt = rebuilt_weights(model)
    return {k: v for k, v in model_state.items() if k not in rebuilt}, optimizer_state


def load(path: AnyPath, model: nn.Module, optimizers: Optimizers, meta: dict[str, Any],
         extra: dict[str, Any] | None = None) -> torch.Tensor | None:
    """Load a checkpoint folder (`meta`: its meta.json) into any layout (every rank), and `extra`
    state (the EMA) in place; returns the random states saved at the same world size, else None."""
    model_state, optimizer_state = saved_state(model, optimizers)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state, **(extra or {})}
    if meta["world_size"] == dist.get_world_size():
        state["rng"] = torch.empty(meta["rng_shape"], dtype=torch.uint8)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as exc:  # a BaseException: made an Exception its callers catch
        raise RuntimeError(storage.reason(exc)) from exc
    set_state_dict(model, list(optimizers.values()), model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"],
                   options=StateDictOptions(strict=not rebuilt_weights(model)))
    return state.get("rng")


class ShardedCheckpoints:
    """Saves of one run in the DCP format; with `background`, the writing overlaps training."""

    def __init__(self, ckpt_dir: CheckpointDir | None, directory: str, background: bool,
                 comm_device: torch.device) -> None:
        self.ckpt_dir, self.directory = ckpt_dir, storage.location(directory)
        self.background, self.comm_device = background, comm_device
        self._pending: Future | None = None
        self.saved: AnyPath | None = None  # the newest complete checkpoint, on every rank
        self._in_flight: AnyPath | None = None
        self._group = self._stager = None  # made by the first background save

    def save(self, model: nn.Module, optimizers: Optimizers, rng: torch.Tensor,
             meta: dict[str, Any], step: int, prepare: Callable[[], None],
             extra: dict[str, Any] | None = None) -> None:
        final = checkpoint_path(self.directory, step, sharded=True)
        tmp = final if isinstance(final, RemotePath) else final.with_name(f".{final.name}.tmp")
        meta = {**meta, "rng_shape": list(rng.shape)}
        self.wait()  # at most one save in flight
        agree(prepare, self.comm_device)
        model_state, optimizer_state = saved_state(model, optimizers)
        state = {"model": model_state, "optimizer": optimizer_state, "rng": rng, **(extra or {})}

        def commit() -> None:  # rank 0, after every rank's shards and DCP's metadata are written
            (tmp / META).write_text(json.dumps(meta))
            self.ckpt_dir.commit(tmp, final)

        try:
            if not self.background:
                dcp.save(state, checkpoint_id=str(tmp))
                agree(commit, self.comm_device)
                self.saved = final
                return
            if self._group is None:  # background saves talk over a group of their own
                self._group = dist.new_group(backend="gloo")
                self._stager = reusable_stager(self.comm_device)
            extra = {"async_stager": self._stager} if self._stager is not None else {}
            self._pending = dcp.async_save(state, checkpoint_id=str(tmp),
                                           process_group=self._group, **extra)
        except CheckpointException as exc:  # a full disk, a folder that went away
            raise RunFailure(f"cannot write checkpoint {final} {self._failure(exc)}",
                             everywhere=True) from None
        self._in_flight = final
        if self.ckpt_dir is not None:
            pending = self._pending
            self.ckpt_dir.in_background(lambda: (pending.result(), commit()))

    def wait(self) -> None:
        """Every rank: wait for the save in flight; rank 0's commit result reaches all ranks."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except (Exception, CheckpointException) as exc:
                raise RunFailure(f"a background checkpoint save failed {self._failure(exc)}",
                                 everywhere=True) from None
            agree(lambda: self.ckpt_dir.wait(), self.comm_device)
            self.saved = self._in_flight

    def _failure(self, exc: BaseException) -> str:
        if isinstance(self.directory, RemotePath):  # the storage client's retries are spent
            return f"({storage.reason(exc)}); {newest_complete(self.saved)}; {AGAIN}"
        return (f"({str(exc).strip().splitlines()[0]}); free space or choose another "
                "--checkpoint-dir")

    def finish(self) -> None:
        """The end of the run: wait for the save in flight, then free the staging copy."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
