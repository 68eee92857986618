"""The task: what to learn, from which data, and how to score it. Edit this file, and only this
file, to train your own model on your own data (README.md, "Your model and data").

This example: a small CNN that sorts 3x16x16 images into classes, trained with cross-entropy and
scored by accuracy. Synthetic images by default; `--data FOLDER` reads an image folder, one
sub-folder per class (`FOLDER/cat/001.jpg`, ...: what torchvision's ImageFolder reads), decoded
one at a time by Pillow (images.py), flipped at random for training (`--num-workers N` decodes
in worker processes), or a shard set made from one, in a folder or a bucket (docs/data.md).
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

import copy
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset

from .data import InMemoryDataset, split_for_validation
from .images import (  # image files: decoded, checked, resized (images.py)
    CHANNELS,
    IMAGE_SIZE,
    ImageFolder,
    class_names,
    image_sample,
    model_input,
    read_image,
)
from .settings import setting
from .shards.read import shard_index, shard_parts

if TYPE_CHECKING:  # for the type hints only
    from .config import Config

SYNTHETIC_CLASSES = 10


@dataclass
class Settings:
    """This task's own settings. Each field is a --flag (hidden_size: --hidden-size) and a key of
    --config files, is saved with the run and its checkpoints, and is read below as
    cfg.task.<name>. Add your own here: nothing else needs to change."""

    dataset_size: int = setting(2048, "images in the synthetic data set (without --data)",
                                low=1, unused_with="data")
    hidden_size: int = setting(64, "channels of the CNN's convolutions", low=1)
    num_layers: int = setting(2, "convolution blocks of the CNN", low=1)
    batch_norm: bool = setting(False, "BatchNorm after every convolution")
    skip_bad_images: bool = setting(False, "with --data: leave out files that cannot be decoded "
                                           "(checked at start, with a warning) instead of stopping")


# ---------------------------------------------------------------------- data
def synthetic_images(size: int, seed: int) -> InMemoryDataset:
    """Each class is a smooth random pattern; a sample is its class's pattern under heavy noise.
    Seeded by its own generator, so every rank builds the identical data set."""
    g = torch.Generator().manual_seed(seed)
    patterns = F.interpolate(torch.randn(SYNTHETIC_CLASSES, CHANNELS, 4, 4, generator=g),
                             size=IMAGE_SIZE, mode="bilinear", align_corners=False)
    labels = torch.randint(SYNTHETIC_CLASSES, (size,), generator=g)
    images = patterns[labels] + 1.5 * torch.randn(size, CHANNELS, IMAGE_SIZE, IMAGE_SIZE,
                                                  generator=g)
    return InMemoryDataset(images, labels)


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset | None]:
    """Training and validation data, identical on every rank. Synthetic: --dataset-size images
    plus --val-fraction of that as validation. A folder: --val-fraction of its images held out.
    A shard set: --val-fraction of its images held out, spread over its shards."""
    if index := shard_index(cfg.data):
        return shard_parts(cfg, index, *(partial(image_sample, augment=a) for a in (True, False)))
    if cfg.data:
        train_files = ImageFolder(cfg.data, augment=True, skip_bad=cfg.task.skip_bad_images)
        val_files = copy.copy(train_files)  # the same files, listed and checked once
        val_files.augment = False
        n_val = int(len(train_files) * cfg.val_fraction)
        train, val = split_for_validation(len(train_files), n_val, cfg.seed)
        train_set = Subset(train_files, train.tolist())
        if cfg.task.skip_bad_images:
            train_set.summary = {"skipped_images": train_files.skipped}  # into summary.json
        return train_set, Subset(val_files, val.tolist()) if n_val else None
    n_val = int(cfg.task.dataset_size * cfg.val_fraction)
    data = synthetic_images(cfg.task.dataset_size + n_val, cfg.seed)
    train, val = split_for_validation(len(data), n_val, cfg.seed)
    return data.subset(train), data.subset(val) if n_val else None


# ---------------------------------------------------------------------- model
class ConvBlock(nn.Module):
    """3x3 convolution, optional BatchNorm, ReLU, with a residual connection."""

    def __init__(self, width: int, batch_norm: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=not batch_norm)
        self.norm = nn.BatchNorm2d(width) if batch_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.conv(x)))


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int, width: int = 64, depth: int = 2,
                 batch_norm: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(CHANNELS, width, 3, stride=2, padding=1)  # 16x16 -> 8x8
        self.blocks = nn.ModuleList(ConvBlock(width, batch_norm) for _ in range(depth))
        # The classifier: a hidden layer, then the classes (tensor_parallel splits the pair).
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(),
                                  nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def build_model(cfg: Config) -> nn.Module:
    num_classes = len(class_names(cfg.data)) if cfg.data else SYNTHETIC_CLASSES
    return SmallCNN(num_classes, cfg.task.hidden_size, cfg.task.num_layers, cfg.task.batch_norm)


def blocks(model: SmallCNN) -> list[nn.Module]:
    return list(model.blocks)


def tensor_parallel_plan(model: SmallCNN, tp_size: int) -> dict[str, str]:
    """--model-layout tensor_parallel: the classifier's hidden layer keeps 1/tp of its outputs
    (colwise), the class layer after it 1/tp of its inputs (rowwise); the convolutions stay whole
    (DTensor splits linear layers)."""
    return {"head.0": "colwise", "head.2": "rowwise"}


# ---------------------------------------------------------------------- loss and metrics
def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images).float(), labels)


def eval_metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    images, labels = batch
    logits = model(images).float()
    return {"loss": F.cross_entropy(logits, labels, reduction="sum"),
            "accuracy": (logits.argmax(dim=1) == labels).sum(),
            "count": labels.numel()}


def predict(model: nn.Module, inputs: list[str], cfg: Config) -> list[str]:
    """Image files -> the most likely class of each (scripts/predict.py)."""
    names = class_names(cfg.data) if cfg.data and Path(cfg.data).is_dir() else None
    images = torch.stack([model_input(read_image(Path(path))) for path in inputs])
    best, labels = model(images).float().softmax(-1).max(-1)
    return [f"{path}: {names[k] if names else f'class {k}'} ({p:.2f})"
            for path, k, p in zip(inputs, labels.tolist(), best.tolist(), strict=True)]
