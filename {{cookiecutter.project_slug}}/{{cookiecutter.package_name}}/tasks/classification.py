"""The task: what to learn, from which data, and how to score it. Edit this file, and only this
file, to train your own model on your own data (README.md, "Your model and data").

This example: a small CNN that sorts 3x16x16 images into classes, trained with cross-entropy and
scored by accuracy. Synthetic images by default; `--data FOLDER` reads an image folder, one
sub-folder per class (`FOLDER/cat/001.jpg`, ...: what torchvision's ImageFolder reads), decoded
one at a time by Pillow, flipped at random for training (`--num-workers N` decodes in worker
processes), or a shard set made from one, in a folder or a bucket (docs/data.md).
All processes run this: print once under `if not dist.is_initialized() or dist.get_rank() == 0`.

The rest of the project relies on:
    build_datasets(cfg) -> (train, val)    map-style Datasets, the same on every rank (val or None)
    build_model(cfg) -> nn.Module          built on the CPU; the project places it on devices
    loss_fn(model, batch) -> Tensor        the batch's mean loss; batch is already on the device
    eval_metrics(model, batch) -> dict     per-batch sums plus a 'count'; reported as val_<name>
Optional:
    collate(samples) -> batch              how samples become a batch (default: default_collate)
    blocks(model) -> list[nn.Module]       the repeated blocks: fsdp shards each one,
                                           model_parallel_2 splits the model between them
    finalize_metrics(averages) -> dict     numbers derived from the averages (perplexity)
    predict(model, inputs, cfg) -> list    one line per input (scripts/predict.py)
    tokens_per_sample(cfg), flops_per_token(model, cfg)    tokens/s and MFU in the metrics
    configure_optimizer(model, cfg)        an optimizer (default: AdamW), (optimizer, scheduler)
                                           or {name: either} over parts of the model
    train_step(step, batch) -> dict        a step of your own (docs/custom-step.md)
"""

from __future__ import annotations

import copy
import io
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import Dataset, Subset

from .data import InMemoryDataset, split_for_validation
from .failures import UsageError, local_rank_from_env, warn
from .settings import setting
from .shards.read import shard_index, shard_parts

if TYPE_CHECKING:  # for the type hints only
    from .config import Config

IMAGE_SIZE = 16
CHANNELS = 3
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


def entries(folder: Path, root: str | Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError as exc:  # e.g. no permission: one line, not a traceback
        raise UsageError(f"--data {root}: cannot list {folder} ({exc.strerror}); fix its "
                         "permissions or remove it", everywhere=True) from None


def broken_link(root: str | Path, path: Path, hint: str = "") -> UsageError:
    """A link that leads nowhere (a loop such as `c -> c`, or a missing target), with why."""
    try:
        path.stat()
        why = "it changed while being read"
    except OSError as exc:
        why = exc.strerror
    return UsageError(f"--data {root}: {path} cannot be read (a link to {os.readlink(path)}: "
                      f"{why}); fix the link or remove it{hint}", everywhere=True)


def image_files(folder: Path, root: str | Path, keep_broken: bool = False) -> list[Path]:
    """The files of `folder` with an image suffix (others are skipped, as ImageFolder does). An
    image that is a broken link is an error, or with keep_broken kept (to fail decoding)."""
    suffixes = Image.registered_extensions()
    files = []
    for path in entries(folder, root):
        if path.suffix.lower() in suffixes and path.is_file():
            files.append(path)
        elif path.suffix.lower() in suffixes and path.is_symlink() and not path.exists():
            if not keep_broken:
                raise broken_link(root, path, ", or pass --skip-bad-images to leave such "
                                              "files out")
            files.append(path)
    return files


def read_image(path: Path | bytes) -> torch.Tensor:
    """An image file (or its bytes) as a CHANNELS x H x W uint8 tensor (grey and colour-mapped
    images become RGB; 16-bit grey, and 32-bit grey in 0..65535 or in 0..1 (floats), is scaled to
    8 bits). A file that cannot be decoded is one `error:` line naming it."""
    try:
        with Image.open(io.BytesIO(path) if isinstance(path, bytes) else path) as image:
            # convert() decodes the whole file: a truncated one fails here. 16-bit grey widens to
            # "I" losslessly, where "RGB" would clip every value above 255 to white.
            wide = image.mode in ("I", "F") or image.mode.startswith("I;16")
            image = image.convert("F" if image.mode == "F" else "I" if wide else "RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        path = "it" if isinstance(path, bytes) else path  # (a shard set names the sample)
        raise UsageError(f"--data: {path} cannot be decoded as an image ({exc}); remove or "
                         "replace it, or pass --skip-bad-images to leave such files out") from None
    if not wide:
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        return pixels.view(image.height, image.width, CHANNELS).permute(2, 0, 1)
    dtype, top = (torch.float32, 1.0) if image.mode == "F" else (torch.int32, 65535)
    values = torch.frombuffer(bytearray(image.tobytes()), dtype=dtype).float()
    if not ((values >= 0) & (values <= top)).all():  # NaN too: no known scale to 8 bits
        raise UsageError(f"--data: {path} is a 32-bit image with values outside 0..{top:g}; "
                         "convert it to 8 or 16 bits, or pass --skip-bad-images to leave such "
                         "files out")
    grey = values.mul(255 / top).round().to(torch.uint8)
    return grey.view(1, image.height, image.width).repeat(CHANNELS, 1, 1)


class ImageFolder(Dataset):
    """`root/<class>/<image>`: the classes are the sub-folders, in sorted order. Each image is read
    and decoded when asked for, resized to IMAGE_SIZE, and (for training) flipped at random."""

    def __init__(self, root: str | Path, augment: bool, skip_bad: bool = False) -> None:
        self.classes = class_names(root)
        self.files = []
        for label, name in enumerate(self.classes):
            folder = Path(root) / name
            files = image_files(folder, root, keep_broken=skip_bad)
            if not files:
                deeper = [p for p in entries(folder, root)
                          if p.is_dir() and image_files(p, root, keep_broken=True)]
                why = (f"its images are one folder too deep ({deeper[0]}): move them up"
                       if deeper else "put its images in it, or remove the folder")
                raise UsageError(f"--data {root}: class {name!r} has no images; {why}",
                                 everywhere=True)
            self.files += [(path, label) for path in files]
        self.skipped = 0
        if skip_bad:
            bad = {path for path, _ in self.files if not decodes(path)}
            self.skipped = len(bad)
            if bad and local_rank_from_env() == 0:
                warn(f"--skip-bad-images: left out {len(bad)} file(s) that cannot be decoded, "
                     f"e.g. {min(bad)}")
            self.files = [(path, label) for path, label in self.files if path not in bad]
        self.augment = augment

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return image_sample(*self.files[index], augment=self.augment)


def image_sample(image: Path | bytes, label: int, augment: bool) -> tuple[torch.Tensor, ...]:
    """An image file (or its bytes) and its label as the model sees them."""
    x = model_input(read_image(image))
    return x.flip(-1) if augment and torch.rand(()) < 0.5 else x, torch.tensor(label)


def model_input(image: torch.Tensor) -> torch.Tensor:
    """A decoded uint8 image as the model sees it: IMAGE_SIZE square, normalized."""
    image = F.interpolate(image.float().div(255).unsqueeze(0), size=IMAGE_SIZE, mode="bilinear",
                          antialias=True, align_corners=False)[0]
    return (image - 0.5) / 0.25


def decodes(path: Path) -> bool:
    try:
        return read_image(path) is not None
    except UsageError:
        return False


def class_names(root: str | Path) -> list[str]:
    """The class folders of `root`, sorted (or a shard set's classes). An entry that is a broken
    link is an error: leaving it out would train a model with one class too few."""
    if index := shard_index(root):
        return index["classes"]
    names = []
    for path in entries(Path(root), root) if Path(root).is_dir() else []:
        if path.is_dir():
            names.append(path.name)
        elif path.is_symlink() and not path.exists():  # a loop, or its target is gone
            raise broken_link(root, path)
    if len(names) < 2:
        raise UsageError(f"--data {root}: expected a folder with one sub-folder per class (at "
                         "least two)", everywhere=True)
    return names


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset | None]:
    """Training and validation data, identical on every rank. Synthetic: --dataset-size images
    plus --val-fraction of that as validation. A folder: --val-fraction of its images held out.
    A shard set: --val-fraction of each shard's images held out."""
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
        self.head = nn.Linear(width, num_classes)

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
