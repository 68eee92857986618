"""The task: what to learn, from which data, and how to score it. Edit this file, and only this
file, to train your own model on your own data (README.md, "Your model and data").

This example: an MLP that predicts one number from 20 features, trained with mean squared error.
Synthetic data by default; `--data file.csv` reads rows of 20 features and a target, one sample at
a time from disk (use `--num-workers N` to read in worker processes).
All processes run this: print once under `if not dist.is_initialized() or dist.get_rank() == 0`.

The rest of the project relies on:
    build_datasets(cfg) -> (train, val)    map-style Datasets, the same on every rank (val or None)
    build_model(cfg) -> nn.Module          built on the CPU; the project places it on devices;
                                           its optional `rebuilt_weights`, a set of state_dict
                                           names: weights it makes again at every start, left
                                           out of checkpoints (a LoRA run's frozen base model)
    loss_fn(model, batch) -> Tensor        the batch's mean loss; batch is already on the device
    eval_metrics(model, batch) -> dict     per-batch sums plus a 'count'; reported as val_<name>
Optional:
    collate(samples) -> batch              how samples become a batch (default: default_collate)
    blocks(model) -> list[nn.Module]       the repeated blocks: fsdp shards each one,
                                           model_parallel_2 splits the model between them
    tensor_parallel_plan(model, tp_size)   {layer: "colwise" or "rowwise"}: what tensor_parallel
                                           splits over tp ranks (docs/performance.md)
    finalize_metrics(averages) -> dict     numbers derived from the averages (perplexity)
    predict(model, inputs, cfg) -> list    one line per input (scripts/predict.py)
    tokens_per_sample(cfg), flops_per_token(model, cfg)    tokens/s and MFU in the metrics
    configure_optimizer(model, cfg)        an optimizer (default: AdamW), (optimizer, scheduler)
                                           or {name: either} over parts of the model
    train_step(step, batch) -> dict        a step of your own (docs/custom-step.md)
    TEST_FLAGS: list[str]                  flags for a few quick steps in the tests' kill and
                                           resume (default: none, this file's defaults)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .data import InMemoryDataset, split_for_validation
from .failures import UsageError
from .settings import setting

if TYPE_CHECKING:  # for the type hints only
    from .config import Config

IN_FEATURES = 20


@dataclass
class Settings:
    """This task's own settings. Each field is a --flag (hidden_size: --hidden-size) and a key of
    --config files, is saved with the run and its checkpoints, and is read below as
    cfg.task.<name>. Add your own here: nothing else needs to change."""

    dataset_size: int = setting(2048, "samples in the synthetic data set (without --data)",
                                low=1, unused_with="data")
    hidden_size: int = setting(64, "width of the MLP", low=1)
    num_layers: int = setting(2, "hidden blocks of the MLP", low=1)
    batch_norm: bool = setting(False, "BatchNorm in every block")


# ---------------------------------------------------------------------- data
def synthetic_regression(size: int, seed: int) -> InMemoryDataset:
    """A smooth non-linear target plus a little noise: an MLP fits it, a linear model does not.
    Seeded by its own generator, so every rank builds the identical data set."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, IN_FEATURES, generator=g)
    w = torch.randn(IN_FEATURES, 1, generator=g) / math.sqrt(IN_FEATURES)
    v = torch.randn(IN_FEATURES, 1, generator=g) / math.sqrt(IN_FEATURES)
    y = torch.sin(x @ w) + 0.5 * (x @ v) + 0.05 * torch.randn(size, 1, generator=g)
    return InMemoryDataset(x, y)


class CsvRows(Dataset):
    """Rows of a CSV file (20 features, then the target), each read and parsed when asked for.
    Only the byte offset of every row is kept in memory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offsets: list[int] = []
        with open(self.path, "rb") as f:
            offset = 0
            for number, line in enumerate(f, start=1):
                if line.strip():
                    columns = len(line.split(b","))
                    if columns != IN_FEATURES + 1:
                        raise UsageError(f"--data {path}: line {number} has {columns} columns; "
                                         f"this model reads {IN_FEATURES} features and a target "
                                         f"({IN_FEATURES + 1} columns)", everywhere=True)
                    self.offsets.append(offset)
                offset += len(line)
        if not self.offsets:
            raise UsageError(f"--data {path}: no rows", everywhere=True)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        with open(self.path, "rb") as f:
            f.seek(self.offsets[index])
            values = [float(v) for v in f.readline().split(b",")]
        return torch.tensor(values[:-1]), torch.tensor(values[-1:])


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset | None]:
    """Training and validation data, identical on every rank. Synthetic: --dataset-size samples
    plus --val-fraction of that as validation. A CSV file: --val-fraction of its rows held out."""
    if cfg.data:
        rows = CsvRows(cfg.data)
        train, val = split_for_validation(len(rows), int(len(rows) * cfg.val_fraction), cfg.seed)
        return (torch.utils.data.Subset(rows, train.tolist()),
                torch.utils.data.Subset(rows, val.tolist()) if len(val) else None)
    n_val = int(cfg.task.dataset_size * cfg.val_fraction)
    data = synthetic_regression(cfg.task.dataset_size + n_val, cfg.seed)
    train, val = split_for_validation(len(data), n_val, cfg.seed)
    return data.subset(train), data.subset(val) if n_val else None


# ---------------------------------------------------------------------- model
class MLP(nn.Module):
    """IN_FEATURES inputs, `num_layers` hidden blocks (Linear, optional BatchNorm, GELU), one
    output."""

    def __init__(self, hidden_size: int = 64, num_layers: int = 2,
                 batch_norm: bool = False) -> None:
        super().__init__()
        widths = [IN_FEATURES] + [hidden_size] * num_layers
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.BatchNorm1d(b) if batch_norm else nn.Identity(),
                          nn.GELU())
            for a, b in zip(widths, widths[1:], strict=False))
        self.head = nn.Linear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(cfg: Config) -> nn.Module:
    return MLP(cfg.task.hidden_size, cfg.task.num_layers, cfg.task.batch_norm)


def blocks(model: MLP) -> list[nn.Module]:
    return list(model.blocks)


def tensor_parallel_plan(model: MLP, tp_size: int) -> dict[str, str]:
    """--model-layout tensor_parallel: the blocks' linear layers in pairs, as Megatron splits an
    MLP: the first keeps 1/tp of its outputs (colwise), the second 1/tp of its inputs (rowwise);
    an odd last block and the output layer stay whole."""
    if isinstance(model.blocks[0][1], nn.BatchNorm1d):
        raise UsageError("--batch-norm normalizes each block's whole output, which "
                         "tensor_parallel splits: leave out --batch-norm, or use --model-layout "
                         "fsdp", everywhere=True)
    if len(model.blocks) < 2:
        raise UsageError("tensor_parallel splits the MLP's blocks in pairs: give --num-layers 2 "
                         "or more", everywhere=True)
    pairs = range(len(model.blocks) // 2)
    return {f"blocks.{2 * i}.0": "colwise" for i in pairs} | {
        f"blocks.{2 * i + 1}.0": "rowwise" for i in pairs}


# ---------------------------------------------------------------------- loss and metrics
def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def eval_metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    x, y = batch
    error = model(x).double() - y.double()
    return {"loss": error.square().sum(), "mae": error.abs().sum(), "count": y.numel()}


def predict(model: nn.Module, inputs: list[str], cfg: Config) -> list[str]:
    """Rows of IN_FEATURES comma-separated numbers -> the model's estimate (scripts/predict.py)."""
    try:
        rows = torch.tensor([[float(v) for v in row.split(",")] for row in inputs])
    except ValueError as exc:
        raise UsageError(f"each input is {IN_FEATURES} comma-separated numbers ({exc})") from None
    if rows.shape[1] != IN_FEATURES:
        raise UsageError(f"each input is {IN_FEATURES} comma-separated numbers, got "
                         f"{rows.shape[1]}")
    return [f"{value:.6g}" for value in model(rows).float().flatten().tolist()]
