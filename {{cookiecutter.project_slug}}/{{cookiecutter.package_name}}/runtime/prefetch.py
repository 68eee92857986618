"""Batches copied to a GPU ahead of the step that uses them (data.py's loaders on a GPU), and
`apply_to_tensors`, which maps a function over the tensors of a batch."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch


class DevicePrefetcher:
    """A loader's batches on a GPU, each copied there on a stream of its own.

    The copy is from pinned memory (DataLoader's pin thread pins with `--num-workers`, else it is
    pinned here) and overlaps the kernels still queued for the step before. The step's stream
    waits for the copy's event, and `record_stream` keeps the allocator from handing the memory
    out again while the step runs. With workers (`ahead`), the next batch's copy starts before
    this one is handed out; batches made in this process are not made ahead: their random draws
    come from the training process's random state, which a checkpoint saves, in step order."""

    def __init__(self, loader: Any, device: torch.device, ahead: bool) -> None:
        self.loader, self.device, self.ahead = loader, device, ahead
        self.stream = torch.cuda.Stream(device)

    def __len__(self) -> int:
        return len(self.loader)

    def _start_copy(self, batch: Any) -> tuple[Any, torch.cuda.Event]:
        pinned = lambda t: t if t.is_cuda or t.is_pinned() else t.pin_memory()  # noqa: E731
        batch = apply_to_tensors(batch, pinned)
        with torch.cuda.stream(self.stream):
            batch = apply_to_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
            return batch, self.stream.record_event()

    def _ready(self, batch: Any, copied: torch.cuda.Event) -> Any:
        step = torch.cuda.current_stream(self.device)
        step.wait_event(copied)
        apply_to_tensors(batch, lambda t: t.record_stream(step))  # every tensor was copied there
        return batch

    def __iter__(self) -> Iterator[Any]:
        copying = []  # with `ahead`, a batch's copy starts before the one before it is handed out
        for batch in self.loader:
            copying.append(self._start_copy(batch))
            if len(copying) > self.ahead:
                yield self._ready(*copying.pop(0))
        for started in copying:
            yield self._ready(*started)


def apply_to_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` on every tensor of a batch or of a model's output: a tensor, or tuples, lists and dicts
    of them, each kept as its own type (a namedtuple, transformers' ModelOutput, whose fields
    loss_fn reads as attributes: `out.logits`)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple takes its fields
        return type(obj)(*(apply_to_tensors(o, fn) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(apply_to_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        mapped = {k: apply_to_tensors(v, fn) for k, v in obj.items()}
        if type(obj) is dict:
            return mapped
        same = copy.copy(obj)  # a dict class of its own: ModelOutput sets the attribute too
        for key, value in mapped.items():
            same[key] = value
        return same
    return obj
