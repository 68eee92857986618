"""Batches from any map-style Dataset, sharded across ranks.

`ShardedBatchSampler` deals each rank as many batches, shuffled anew every epoch (`set_epoch`, the
step people forget), from a start batch on a resume. `BatchFetcher` makes one batch (all at once
from a data set with `__getitems__`: in-memory tensors, one gather); `build_loader` runs it here or
in workers, each batch's random numbers seeded from (seed, rank, epoch, batch): augmentation does
not depend on the worker or on a resume. On a GPU, `place_on_device` keeps in-memory data that fits
there (batches cut on the device: no copy), other batches are copied ahead (runtime/prefetch.py)."""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info

from .failures import KINDS, ProjectError, RunFailure, kind_name
from .runtime.prefetch import DevicePrefetcher, apply_to_tensors
from .runtime.workers import worker_loader


class InMemoryDataset(Dataset):
    """Tensors with the same first dimension, served whole batches at a time: an item is a row (a
    tuple of rows with several tensors), and `__getitems__` cuts a batch with one indexing each."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        if len({t.shape[0] for t in tensors}) != 1:
            raise ValueError(f"tensors of different lengths: {[t.shape[0] for t in tensors]}")
        self.tensors = tensors

    def __len__(self) -> int:
        return self.tensors[0].shape[0]

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__(index)

    def __getitems__(self, indices: torch.Tensor) -> Any:
        if self.tensors[0].is_cuda and not (torch.is_tensor(indices) and indices.is_cuda):
            # pinned, the indices' copy does not wait for the GPU
            indices = torch.as_tensor(indices).pin_memory().to(self.tensors[0].device,
                                                               non_blocking=True)
        if len(self.tensors) == 1:
            return self.tensors[0][indices]
        return tuple(t[indices] for t in self.tensors)

    def subset(self, indices: torch.Tensor) -> InMemoryDataset:
        return InMemoryDataset(*(t[indices] for t in self.tensors))


def split_for_validation(size: int, n_val: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, validation indices): `n_val` of `size` held out by a seeded shuffle."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + 1))
    return order[n_val:], order[:n_val]


class ShardedBatchSampler:
    """This rank's batches of one epoch, as `(seed, indices)` pairs. Like DistributedSampler +
    BatchSampler: the epoch's permutation (seeded by seed + epoch) is padded to a multiple of the
    world size and dealt out round-robin, so every rank has the same number of samples; the last
    batch may be short. Batch k of every rank together is the same samples at any world size with
    the same global batch (batch size x world size)."""

    def __init__(self, size: int, rank: int, world_size: int, batch_size: int, seed: int,
                 order: Callable[[int, int], torch.Tensor] | None = None) -> None:
        if size < 1:
            raise ValueError("the data set is empty")
        self.size, self.rank, self.world_size = size, rank, world_size
        self.batch_size, self.seed = batch_size, seed
        self.order = order  # (seed, epoch) -> the epoch's order, if not a plain shuffle
        self.shard_size = math.ceil(size / world_size)
        self.epoch, self.start_batch = 0, 0
        self.device = torch.device("cpu")  # where the indices go: `to`

    def to(self, device: torch.device) -> ShardedBatchSampler:
        """Yield indices on `device`: the epoch's shard is copied there once, and each batch's
        indices are a slice of it (for data that lives there: no copy per step)."""
        self.device = device
        return self

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def batches_per_epoch(self) -> int:
        return math.ceil(self.shard_size / self.batch_size)

    def batch_len(self, batch: int) -> int:
        """Samples in batch number `batch` of an epoch (the last one may be short)."""
        return min(self.batch_size, self.shard_size - batch * self.batch_size)

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.start_batch

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        if self.order is not None:  # a data set's own (a shard set's: shards, then windows)
            order = self.order(self.seed, self.epoch)
        else:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(
                self.seed + self.epoch))
        padded = self.shard_size * self.world_size
        if padded > self.size:  # repeat samples from the start, as DistributedSampler does
            order = torch.cat([order, order.repeat(math.ceil(padded / self.size))[
                :padded - self.size]])
        shard = order[self.rank:padded:self.world_size].to(self.device)
        for batch in range(self.start_batch, self.batches_per_epoch()):
            start = batch * self.batch_size
            yield batch_seed(self.seed, self.rank, self.epoch, batch), shard[
                start:start + self.batch_size]


def batch_seed(seed: int, rank: int, epoch: int, batch: int) -> int:
    """A seed per batch of each rank and epoch, for the random numbers of data workers."""
    return hash((seed, rank, epoch, batch)) % 2**63


class FixedBatches(list):
    """The same batches every time, a list of `(seed, indices)` pairs: this rank's share of the
    validation set. Padded with batches to ignore (after the first `real` ones) up to `count`, so
    every rank runs as many forward passes as the others (fsdp gathers weights in each)."""

    def __init__(self, indices: torch.Tensor, batch_size: int, seed: int, count: int) -> None:
        chunks = list(indices.split(batch_size)) if len(indices) else []  # split gives 1 empty
        self.real = len(chunks)
        filler = indices[:1] if len(indices) else torch.zeros(1, dtype=torch.long)
        chunks += [filler] * (count - len(chunks))
        super().__init__((batch_seed(seed, -1, 0, i), chunk) for i, chunk in enumerate(chunks))


def validation_batches(size: int, rank: int, world_size: int, batch_size: int,
                       seed: int) -> FixedBatches:
    """Every validation sample exactly once across ranks (rank r takes r, r + world, ...), with
    no padding duplicates: DistributedSampler would repeat samples and bias the metric."""
    count = math.ceil(math.ceil(size / world_size) / batch_size)
    mine = torch.arange(rank, size, world_size) if rank < size else torch.zeros(0, dtype=torch.long)
    return FixedBatches(mine, batch_size, seed, count)


class BatchFetcher:
    """What a DataLoader worker (or, without workers, the training process) does for one batch."""

    def __init__(self, dataset: Dataset, collate: Callable[[list[Any]], Any] | None) -> None:
        self.dataset, self.collate = dataset, collate or default_collate
        self._getitems = getattr(dataset, "__getitems__", None)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, key: tuple[int, torch.Tensor]) -> Any:
        seed, indices = key
        if get_worker_info() is not None:  # a worker's own random state: seeded per batch
            torch.manual_seed(seed)
            random.seed(seed)
            if "numpy" in sys.modules:
                sys.modules["numpy"].random.seed(seed % 2**32)
        try:
            data = (self._getitems(indices) if self._getitems is not None
                    else [self.dataset[i] for i in indices.tolist()])
        except ProjectError as exc:
            if get_worker_info() is None:
                raise
            # DataLoader would re-raise it in the training process with the worker's traceback
            # as its message; handed over as a batch, it stays one line.
            return WorkerError(kind_name(exc), str(exc))
        # A list holds samples still to be collated; anything else is already a batch.
        return self.collate(data) if isinstance(data, list) else data


class WorkerError:
    """A data worker's ProjectError, as a KINDS name and a message, for `move_to` to raise."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind, self.message = kind, message


class InProcessLoader:
    """Batches made in the training process: `DataLoader(num_workers=0)` with our sampler, without
    its per-batch bookkeeping (about 20 us, a few percent of a small model's step)."""

    def __init__(self, fetcher: BatchFetcher, batches: Any) -> None:
        self.fetcher, self.batches = fetcher, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        return map(self.fetcher.__getitems__, self.batches)


def build_loader(dataset: Dataset, batches: Any, collate: Callable | None, num_workers: int,
                 device: torch.device) -> InProcessLoader | DataLoader | DevicePrefetcher:
    """`batches` (a ShardedBatchSampler or FixedBatches) of `dataset`, made here or by workers
    (runtime/workers.py: data set and `collate` must pickle), prefetched to a GPU unless there."""
    fetcher = BatchFetcher(dataset, collate)
    on_gpu = device.type == "cuda"
    # In-memory tensors already on the device are cut there: nothing to copy, nothing to prefetch.
    if num_workers == 0 and type(dataset) is InMemoryDataset and device.type != "cpu" and all(
            t.device == device for t in dataset.tensors):
        return InProcessLoader(fetcher, batches.to(device) if hasattr(batches, "to") else batches)
    loader = (worker_loader(fetcher, batches, num_workers, pin_memory=on_gpu) if num_workers
              else InProcessLoader(fetcher, batches))
    return DevicePrefetcher(loader, device, ahead=num_workers > 0) if on_gpu else loader


def place_on_device(datasets: list[Dataset | None], device: torch.device, num_workers: int,
                    policy: str, free_bytes: int | None = None) -> list[Dataset | None]:
    """--data-on-device auto: InMemoryDatasets move to the GPU when together they take at most a
    quarter of its free memory (`free_bytes`: now, before the model is built) and batches are made
    in this process: they are then cut on the GPU, nothing is copied per step."""
    movable = [d for d in datasets if type(d) is InMemoryDataset]
    if policy == "never" or device.type == "cpu" or num_workers > 0 or not movable:
        return datasets
    free_bytes = torch.cuda.mem_get_info(device)[0] if free_bytes is None else free_bytes
    if sum(t.numel() * t.element_size() for d in movable for t in d.tensors) > free_bytes // 4:
        return datasets
    return [InMemoryDataset(*(t.to(device) for t in d.tensors))
            if type(d) is InMemoryDataset else d for d in datasets]


def move_to(batch: Any, device: torch.device) -> Any:
    """A batch on `device`. Batches pinned by DataLoader workers copy without blocking the host."""
    if isinstance(batch, WorkerError):
        raise KINDS.get(batch.kind, RunFailure)(batch.message)
    if device.type == "cpu":  # where every loader makes its batches: nothing to move
        return batch
    if type(batch) is tuple and all(type(t) is torch.Tensor for t in batch):
        return tuple(t.to(device, non_blocking=True) for t in batch)  # the common case, fast
    return apply_to_tensors(batch, lambda t: t.to(device, non_blocking=True))
