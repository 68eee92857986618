"""Data: a synthetic regression task, a tensor-file data set, and a loader that cuts whole batches
by tensor indexing (one gather per batch instead of one `__getitem__` per sample).

Replace `build_datasets` with your own data. Anything with `__len__` and a `__getitem__` that
accepts a tensor of indices works unchanged; a per-sample data set works too if you build the
DataLoader with `batch_size=` instead of the batch sampler below.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .distributed import SetupError

IN_FEATURES = 20


class TensorPairDataset(Dataset):
    """Inputs and targets held in memory as two tensors with the same first dimension."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.shape[0] != y.shape[0]:
            raise SetupError(f"data: {x.shape[0]} inputs but {y.shape[0]} targets; they must match")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def synthetic_regression(size: int, seed: int, in_features: int = IN_FEATURES) -> TensorPairDataset:
    """A smooth non-linear target plus a little noise: an MLP fits it, a linear model does not.

    Seeded by its own generator so every rank builds the identical data set.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, in_features, generator=g)
    w = torch.randn(in_features, 1, generator=g) / math.sqrt(in_features)
    v = torch.randn(in_features, 1, generator=g) / math.sqrt(in_features)
    y = torch.sin(x @ w) + 0.5 * (x @ v) + 0.05 * torch.randn(size, 1, generator=g)
    return TensorPairDataset(x, y)


def save_tensor_file(path: str | Path, x: torch.Tensor, y: torch.Tensor) -> None:
    """Write a data file that `--data PATH` reads."""
    torch.save({"x": x, "y": y}, path)


def load_tensor_file(path: str | Path) -> TensorPairDataset:
    """Read `{'x': inputs, 'y': targets}` written by `save_tensor_file` (or any torch.save of that dict)."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise SetupError(f"--data {path}: cannot read it as a tensor file ({type(exc).__name__}); "
                         "write it with torch.save({'x': inputs, 'y': targets}, path)") from None
    if not isinstance(blob, dict) or not {"x", "y"} <= blob.keys():
        raise SetupError(f"--data {path}: expected a dict with tensors 'x' and 'y'")
    x, y = blob["x"].float(), blob["y"].float()
    if y.dim() == 1:
        y = y.unsqueeze(1)
    return TensorPairDataset(x, y)


class DistributedBatchSampler:
    """Yields this rank's batches as index tensors, from a DistributedSampler.

    `set_epoch(epoch, start_batch)` reshuffles (the step people forget) and can skip the batches
    already trained, so a run resumed mid-epoch sees exactly the batches it would have seen.
    """

    def __init__(self, sampler: DistributedSampler, batch_size: int) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.start_batch = start_batch

    def batches_per_epoch(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.start_batch

    def __iter__(self) -> Iterator[torch.Tensor]:
        indices = torch.tensor(list(self.sampler))
        for start in range(self.start_batch * self.batch_size, len(indices), self.batch_size):
            yield indices[start:start + self.batch_size]


class InMemoryLoader:
    """This rank's batches, cut in this process: what `DataLoader(num_workers=0)` does with our batch
    sampler, without its per-batch bookkeeping (about 20 us a step, a few percent of a small model's
    step). `build_loader` switches to a real DataLoader when --num-workers asks for worker processes."""

    def __init__(self, dataset: Any, sampler: DistributedBatchSampler, pin_memory: bool = False) -> None:
        self.dataset, self.sampler, self.pin_memory = dataset, sampler, pin_memory

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        for indices in self.sampler:
            batch = self.dataset[indices]
            # Pinned host memory lets the trainer's non_blocking copy to the GPU overlap with compute.
            yield tuple(t.pin_memory() for t in batch) if self.pin_memory else batch


def build_datasets(data_path: str | None, dataset_size: int, seed: int,
                   val_fraction: float = 0.0) -> tuple[TensorPairDataset, TensorPairDataset | None]:
    """Training and validation data, identical on every rank.

    Synthetic data: `dataset_size` training samples plus `val_fraction` of that as extra validation
    samples. A data file: `val_fraction` of its samples are held out, chosen by a seeded shuffle.
    """
    if data_path:
        dataset = load_tensor_file(data_path)
        n_val = int(len(dataset) * val_fraction)
    else:
        n_val = int(dataset_size * val_fraction)
        dataset = synthetic_regression(dataset_size + n_val, seed)
    if n_val == 0:
        return dataset, None
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + 1))
    return TensorPairDataset(*dataset[order[n_val:]]), TensorPairDataset(*dataset[order[:n_val]])


def eval_shard(size: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's validation indices: every sample exactly once across ranks, no padding duplicates
    (DistributedSampler would repeat samples to even out the shards and bias the metric)."""
    return torch.arange(rank, size, world_size)


def _seed_worker(worker_id: int) -> None:
    # Each DataLoader worker gets its own stream, derived from the loader's seeded generator.
    random.seed(torch.initial_seed() % 2**32)


def build_loader(dataset: Dataset, rank: int, world_size: int, batch_size: int, seed: int,
                 num_workers: int = 0, pin_memory: bool = False) -> InMemoryLoader | DataLoader:
    """Every rank gets its own shard of each epoch; all ranks get the same number of batches.

    The DistributedSampler pads the shards to equal length, so no rank waits for a step the others
    never take. Both loaders yield the same batches; only `num_workers > 0` needs DataLoader's processes.
    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    batches = DistributedBatchSampler(sampler, batch_size)
    if num_workers == 0:
        return InMemoryLoader(dataset, batches, pin_memory)
    return DataLoader(
        dataset,
        sampler=batches,
        batch_size=None,  # the sampler already yields whole batches
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=True,
        worker_init_fn=_seed_worker,
        generator=torch.Generator().manual_seed(seed + rank),  # seeds the workers, per rank
    )
