"""Image files as the classification example reads them: an image folder (one sub-folder per
class, what torchvision's ImageFolder reads), each image decoded by Pillow when asked for, resized
to IMAGE_SIZE and normalized; the checks that turn a bad folder, a broken link or an image that
cannot be decoded into one error line. task.py builds its data sets from these (in its bake
only: model_layout aside, task=classification)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from .failures import UsageError, local_rank_from_env, warn
from .shards.read import shard_index

IMAGE_SIZE = 16
CHANNELS = 3


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
    8 bits). A file that cannot be decoded is one `error:` line naming it (a shard set's sample:
    its caller names the shard and the sample)."""
    if isinstance(path, bytes):  # a shard set's sample: its caller names the set, shard, sample
        what, replace = "it", ""
        fix = "prepare the shard set again (prepare leaves out such images)"
    else:
        what, replace = f"--data: {path}", "remove or replace it, or "
        fix = "pass --skip-bad-images to leave such files out"
    try:
        with Image.open(io.BytesIO(path) if isinstance(path, bytes) else path) as image:
            # convert() decodes the whole file: a truncated one fails here. 16-bit grey widens to
            # "I" losslessly, where "RGB" would clip every value above 255 to white.
            wide = image.mode in ("I", "F") or image.mode.startswith("I;16")
            image = image.convert("F" if image.mode == "F" else "I" if wide else "RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise UsageError(f"{what} cannot be decoded as an image ({exc}); {replace}{fix}"
                         ) from None
    if not wide:
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        return pixels.view(image.height, image.width, CHANNELS).permute(2, 0, 1)
    dtype, top = (torch.float32, 1.0) if image.mode == "F" else (torch.int32, 65535)
    values = torch.frombuffer(bytearray(image.tobytes()), dtype=dtype).float()
    if not ((values >= 0) & (values <= top)).all():  # NaN too: no known scale to 8 bits
        raise UsageError(f"{what} is a 32-bit image with values outside 0..{top:g}; "
                         f"convert it to 8 or 16 bits, or {fix}")
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
