"""The task: what to learn, from which data, and how to score it. Edit this file, and only this
file, to train your own model on your own data (README.md, "Your model and data").

This example: a small CNN that sorts 3x16x16 images into classes, trained with cross-entropy and
scored by accuracy. Synthetic images by default; `--data FOLDER` reads an image folder, one
sub-folder per class (`FOLDER/cat/001.ppm`, ...), decoding one image at a time from disk, with a
random horizontal flip for training (use `--num-workers N` to decode in worker processes). The
folder reader understands binary PPM/PGM; for JPEG or PNG, swap `read_image` for Pillow or
torchvision (README.md shows how).

The rest of the project relies on:
    build_datasets(cfg) -> (train, val)    map-style Datasets, the same on every rank (val or None)
    build_model(cfg) -> nn.Module          built on the CPU; the project places it on devices
    loss_fn(model, batch) -> Tensor        the batch's mean loss; batch is already on the device
    eval_metrics(model, batch) -> dict     per-batch sums plus a 'count'; reported as val_<name>
Optional: collate(samples) -> batch, blocks(model) -> the model's repeated blocks (used by
--model-layout model_parallel_2 and fsdp), finalize_metrics(averages) -> what to report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset

from .config import Config, setting
from .data import InMemoryDataset, split_for_validation
from .failures import SetupError

IMAGE_SIZE = 16
CHANNELS = 3
SYNTHETIC_CLASSES = 10
IMAGE_SUFFIXES = (".ppm", ".pgm")


@dataclass
class Settings:
    """This task's own settings. Each field is a --flag (hidden_size: --hidden-size) and a key of
    --config files, is saved with the run and its checkpoints, and is read below as
    cfg.task.<name>. Add your own here: nothing else needs to change."""

    dataset_size: int = setting(2048, "images in the synthetic data set (without --data)", low=1)
    hidden_size: int = setting(64, "channels of the CNN's convolutions", low=1)
    num_layers: int = setting(2, "convolution blocks of the CNN", low=1)
    batch_norm: bool = setting(False, "BatchNorm after every convolution")


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


def read_image(path: Path) -> torch.Tensor:
    """A binary PPM (P6, colour) or PGM (P5, grey) file as a CHANNELS x H x W uint8 tensor."""
    data = path.read_bytes()
    fields, position = [], 0
    while len(fields) < 4:  # magic, width, height, maxval; '#' starts a comment
        while data[position:position + 1].isspace():
            position += 1
        if data[position:position + 1] == b"#":
            position = data.index(b"\n", position)
            continue
        end = position
        while not data[end:end + 1].isspace():
            end += 1
        fields.append(data[position:end])
        position = end
    magic, width, height, maxval = fields[0], int(fields[1]), int(fields[2]), int(fields[3])
    if magic not in (b"P5", b"P6") or maxval > 255:
        raise SetupError(f"{path}: not an 8-bit binary PPM/PGM image", everywhere=True)
    channels = 3 if magic == b"P6" else 1
    pixels = torch.frombuffer(bytearray(data[position + 1:position + 1 + width * height *
                                             channels]), dtype=torch.uint8)
    image = pixels.view(height, width, channels).permute(2, 0, 1)
    return image.expand(CHANNELS, -1, -1) if channels == 1 else image


class ImageFolder(Dataset):
    """`root/<class>/<image>`: the classes are the sub-folders, in sorted order. Each image is read
    and decoded when asked for, resized to IMAGE_SIZE, and (for training) flipped at random."""

    def __init__(self, root: str | Path, augment: bool) -> None:
        self.classes = class_names(root)
        self.files = [(path, label) for label, name in enumerate(self.classes)
                      for path in sorted((Path(root) / name).iterdir())
                      if path.suffix.lower() in IMAGE_SUFFIXES]
        if not self.files:
            raise SetupError(f"--data {root}: no {'/'.join(IMAGE_SUFFIXES)} images in its class "
                             "folders", everywhere=True)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        path, label = self.files[index]
        image = read_image(path).float().div(255).unsqueeze(0)
        image = F.interpolate(image, size=IMAGE_SIZE, mode="bilinear", antialias=True,
                              align_corners=False)[0]
        if self.augment and torch.rand(()) < 0.5:
            image = image.flip(-1)
        return (image - 0.5) / 0.25, torch.tensor(label)


def class_names(root: str | Path) -> list[str]:
    names = sorted(p.name for p in Path(root).iterdir() if p.is_dir()) if Path(root).is_dir() \
        else []
    if len(names) < 2:
        raise SetupError(f"--data {root}: expected a folder with one sub-folder per class (at "
                         "least two)", everywhere=True)
    return names


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset | None]:
    """Training and validation data, identical on every rank. Synthetic: --dataset-size images
    plus --val-fraction of that as validation. A folder: --val-fraction of its images held out."""
    if cfg.data:
        train_files, val_files = ImageFolder(cfg.data, augment=True), ImageFolder(cfg.data, False)
        n_val = int(len(train_files) * cfg.val_fraction)
        train, val = split_for_validation(len(train_files), n_val, cfg.seed)
        return Subset(train_files, train.tolist()), Subset(val_files, val.tolist()) if n_val \
            else None
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
