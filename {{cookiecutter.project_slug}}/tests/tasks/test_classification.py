"""Tests of the example task in task.py: a small CNN classifying 3x16x16 images.

They check this example learns and that its image-folder format works. When you replace task.py
with your own task, replace these with tests of yours; every other test keeps working.
"""

from __future__ import annotations

import os
import shlex
import struct
import sys
import zlib
from pathlib import Path

import pytest
import torch
from conftest import (
    PROJECT_ROOT,
    ok,
    one_error,
    python_train,
    read_metrics,
    run_cmd,
    summary,
    torchrun,
)
from PIL import Image

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.doctor import preflight
from {{ cookiecutter.package_name }}.failures import UsageError


def test_learns_far_better_than_chance(workdir):
    ok(torchrun(["--dataset-size", "2048", "--hidden-size", "32", "--epochs", "3"], workdir))
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert losses[-1] < 0.5 * losses[0], "the training loss did not fall"
    final = read_metrics(workdir / "runs/latest", "val_loss")[-1]
    assert final["val_accuracy"] > 5 / task.SYNTHETIC_CLASSES  # chance is 1 / classes


def write_image_folder(root, per_class: int = 40, classes=("class0", "class1")) -> None:
    """Two classes told apart by colour, at a size the model resizes (24 x 20), in the formats
    image folders hold: JPEG, PNG, and a PNG in grey."""
    g = torch.Generator().manual_seed(0)
    for name, colour in zip(classes, [(200, 40, 40), (40, 40, 200)], strict=True):
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            noise = torch.randint(-40, 40, (3, 20, 24), generator=g)
            pixels = (torch.tensor(colour)[:, None, None] + noise).clamp(0, 255).to(torch.uint8)
            image = Image.frombytes("RGB", (24, 20),
                                    bytes(pixels.permute(1, 2, 0).flatten().tolist()))
            if i == 0:
                image.convert("L").save(folder / f"{i:03d}.png")
            else:
                image.save(folder / f"{i:03d}.{'jpg' if i % 2 else 'png'}")
        (folder / "notes.txt").write_text("not an image: skipped, as ImageFolder does")


def doc_inputs(root: Path) -> list[str]:
    """What the docs' commands read (tests/test_doc_commands.py): the README's data/train, and
    images for scripts/predict.py's INPUT."""
    write_image_folder(root / "data/train", 8, ("cat", "dog"))
    return ["data/train/cat/001.jpg", "data/train/dog/002.png"]


def test_image_folder_is_decoded_one_image_at_a_time_by_worker_processes(workdir):
    write_image_folder(workdir / "images")
    ok(torchrun(["--data", "images", "--num-workers", "2", "--epochs", "4", "--batch-size", "8",
                 "--hidden-size", "16", "--val-fraction", "0.25"], workdir))
    final = read_metrics(workdir / "runs/latest", "val_loss")[-1]
    assert final["val_accuracy"] > 0.9
    folder = task.ImageFolder(workdir / "images", augment=False)
    image, label = folder[len(folder) - 1]
    assert folder.classes == ["class0", "class1"] and label.item() == 1
    assert image.shape == (task.CHANNELS, task.IMAGE_SIZE, task.IMAGE_SIZE)
    assert image[2].mean() > image[0].mean()  # the blue class is blue after decoding
    # scripts/predict.py on the trained model: one line per image, the class by its folder name.
    newest = max((workdir / "checkpoints").glob("ckpt_step*"))  # a file, or a folder (fsdp)
    result = ok(run_cmd([sys.executable, str(PROJECT_ROOT / "scripts/predict.py"), str(newest),
                         "images/class0/001.jpg", "images/class1/002.png"], workdir))
    lines = result.stdout.splitlines()
    assert lines[0].startswith("images/class0/001.jpg: class0 (") and len(lines) == 2
    assert lines[1].startswith("images/class1/002.png: class1 (")


def test_the_local_scripts_check_reads_the_images_from_where_it_was_run(workdir, monkeypatch):
    """scripts/train_local.sh runs in the project's folder; its check before launching
    (doctor.preflight) reads `--data images` from the folder it was run in, which has them (the
    project has not), and hands the processes that folder's absolute path. (test_train runs the
    script itself from another folder.)"""
    write_image_folder(workdir / "images", 8)
    monkeypatch.chdir(PROJECT_ROOT)
    given = ["--data", "images", "--epochs", "1", "--output-dir", "runs", "--checkpoint-dir", "ck"]
    launch = shlex.split(preflight(given, caller=str(workdir)))
    assert os.getcwd() == str(PROJECT_ROOT)
    flags = dict(zip(launch[1::2], launch[2::2], strict=False))
    for flag, where in (("--data", "images"), ("--output-dir", "runs"), ("--checkpoint-dir", "ck")):
        assert Path(flags[flag]) == (workdir / where).resolve()


def test_a_folder_without_class_folders_is_one_error_line(workdir):
    (workdir / "flat").mkdir()
    result = torchrun(["--data", "flat", "--epochs", "1"], workdir)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert "expected a folder with one sub-folder per class" in errors[0]


BAD_FILES = {
    "empty": b"",
    "text": b"these are notes, saved with the wrong name\n",
    "truncated": None,  # the first half of a real PNG
}


def write_bad_file(path, kind: str) -> None:
    if BAD_FILES[kind] is None:
        Image.new("RGB", (64, 64), (10, 200, 30)).save(path.with_suffix(".tmp.png"))
        data = path.with_suffix(".tmp.png").read_bytes()
        path.with_suffix(".tmp.png").unlink()
        path.write_bytes(data[:len(data) // 2])
    else:
        path.write_bytes(BAD_FILES[kind])


@pytest.mark.parametrize("kind", BAD_FILES)
def test_a_file_that_cannot_be_decoded_is_named(tmp_path, kind):
    write_bad_file(tmp_path / "bad.png", kind)
    with pytest.raises(UsageError, match=f"--data: {tmp_path / 'bad.png'} cannot be decoded"):
        task.read_image(tmp_path / "bad.png")


def test_a_class_folder_without_images_says_which_and_why(tmp_path):
    write_image_folder(tmp_path / "images", per_class=2)
    (tmp_path / "images/class2").mkdir()
    with pytest.raises(UsageError, match="class 'class2' has no images; put its images in it"):
        task.ImageFolder(tmp_path / "images", augment=False)
    (tmp_path / "images/class2/more").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images/class2/more/0.png")
    with pytest.raises(UsageError, match="its images are one folder too deep"):
        task.ImageFolder(tmp_path / "images", augment=False)


@pytest.mark.full
@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_bad_image_ends_the_run_with_its_name_or_is_skipped_on_request(workdir, workers):
    write_image_folder(workdir / "images", per_class=8)
    bad = {"empty": "class0/empty.ppm", "text": "class1/notes.png",
           "truncated": "class1/broken.jpg"}
    for kind, name in bad.items():
        write_bad_file(workdir / "images" / name, kind)
    names = [Path(name).name for name in bad.values()]
    flags = ["--data", "images", "--num-workers", workers, "--epochs", "1", "--batch-size", "4",
             "--hidden-size", "8", "--timeout-s", "10"]
    result = torchrun(flags, workdir)
    assert result.returncode != 0
    # Our own lines, no traceback of ours (torchrun's agent adds its own report of a failed job).
    assert "cannot be decoded" in result.stderr
    # (Traceback lines only: torchrun's report names train.py's path, which may hold the name.)
    ours = [line for line in result.stderr.splitlines()
            if line.strip().startswith("File ") and "/{{ cookiecutter.package_name }}/" in line]
    assert not ours, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors and all(any(name in line for name in names) for line in errors), result.stderr
    if workers == "0":  # the folder is listed and checked before any worker starts
        return
    result = ok(torchrun([*flags, "--skip-bad-images", "--resume", "never"], workdir))
    assert "--skip-bad-images: left out 3 file(s) that cannot be decoded" in result.stderr
    assert summary(workdir / "runs/latest")["skipped_images"] == 3


def grey16(values: torch.Tensor) -> Image.Image:
    """A 16-bit greyscale image (Pillow's mode "I;16") of an H x W tensor of 0..65535."""
    data = b"".join(v.to_bytes(2, "little") for v in values.flatten().tolist())
    return Image.frombytes("I;16", (values.shape[1], values.shape[0]), data)


def write_png16(path: Path, samples: torch.Tensor) -> None:
    """A 16-bit RGB or RGBA PNG (Pillow cannot write one) of an H x W x C tensor of 0..65535."""
    height, width, channels = samples.shape
    rows = b"".join(b"\0" + b"".join(v.to_bytes(2, "big") for v in row.flatten().tolist())
                    for row in samples)

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 16, {3: 2, 4: 6}[channels], 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("suffix", [".png", ".pgm"])
def test_16_bit_grey_is_scaled_to_8_bits_not_clipped_to_white(tmp_path, suffix):
    # Each column k holds k * 257: exactly k once scaled to 8 bits. Converting to "RGB" directly
    # would clip every value above 255, training on white images.
    gradient = (torch.arange(256) * 257).expand(3, 256)
    grey16(gradient).save(tmp_path / f"gradient{suffix}")
    image = task.read_image(tmp_path / f"gradient{suffix}")
    assert image.dtype == torch.uint8 and image.shape == (task.CHANNELS, 3, 256)
    assert torch.equal(image, torch.arange(256, dtype=torch.uint8).expand(task.CHANNELS, 3, 256))
    grey16(torch.full((4, 5), 32768)).save(tmp_path / f"half{suffix}")
    assert task.read_image(tmp_path / f"half{suffix}").unique().tolist() == [128]


def test_16_bit_colour_and_32_bit_grey_in_range_are_read(tmp_path):
    # Pillow reads 16-bit RGB(A) PNGs as 8-bit RGB(A), already scaled: they stay as they were.
    for channels in (3, 4):
        write_png16(tmp_path / f"rgb{channels}.png",
                    torch.tensor([65535, 32768, 0, 65535][:channels]).expand(2, 3, channels))
        image = task.read_image(tmp_path / f"rgb{channels}.png")
        assert image[:, 0, 0].tolist() == [255, 128, 0] and image.shape == (3, 2, 3)
    Image.new("F", (5, 4), 0.25).save(tmp_path / "float.tiff")  # floats in 0..1
    Image.new("I", (5, 4), 65535).save(tmp_path / "int.tiff")  # 32-bit ints in 0..65535
    assert task.read_image(tmp_path / "float.tiff").unique().tolist() == [64]
    assert task.read_image(tmp_path / "int.tiff").unique().tolist() == [255]


@pytest.mark.parametrize("mode, value", [("I", 100000), ("I", -1), ("F", 2.0), ("F", float("nan"))])
def test_a_32_bit_image_with_no_8_bit_scale_is_named(tmp_path, mode, value):
    Image.new(mode, (5, 4), value).save(tmp_path / "wide.tiff")
    with pytest.raises(UsageError, match=f"--data: {tmp_path / 'wide.tiff'} is a 32-bit image "
                                         "with values outside .*; convert it to 8 or 16 bits"):
        task.read_image(tmp_path / "wide.tiff")


def test_a_folder_of_16_bit_images_trains(workdir):
    # Dark and bright classes, every value above 255: clipped to 8 bits, both would be white.
    g = torch.Generator().manual_seed(0)
    for label, level in enumerate([8000, 40000]):
        folder = workdir / f"images/class{label}"
        folder.mkdir(parents=True)
        for i in range(24):
            values = level + torch.randint(-4000, 4000, (20, 24), generator=g)
            grey16(values).save(folder / f"{i:03d}.{'png' if i % 2 else 'pgm'}")
    ok(python_train(["--data", "images", "--epochs", "4", "--batch-size", "8", "--hidden-size",
                     "16", "--val-fraction", "0.25"], workdir))
    assert read_metrics(workdir / "runs/latest", "val_loss")[-1]["val_accuracy"] > 0.9


@pytest.mark.parametrize("target, why", [("c", "Too many levels of symbolic links"),
                                         ("gone", "No such file or directory")])
def test_a_class_folder_that_is_a_broken_link_is_one_error_line(workdir, target, why):
    # Leaving it out, as is_dir() would, trains a model with one class fewer than the folders.
    write_image_folder(workdir / "images", per_class=2)
    os.symlink(target, workdir / "images/c")  # c -> c: a loop; c -> gone: a missing target
    error = one_error(python_train(["--data", "images", "--epochs", "1"], workdir))
    assert f"--data images: images/c cannot be read (a link to {target}: {why}); fix the link " \
           "or remove it" in error


def test_an_image_that_is_a_broken_link_is_named_or_skipped_on_request(workdir):
    write_image_folder(workdir / "images", per_class=4)
    os.symlink("loop.png", workdir / "images/class1/loop.png")
    flags = ["--data", "images", "--epochs", "1", "--batch-size", "4", "--hidden-size", "8"]
    error = one_error(python_train(flags, workdir))
    assert "images/class1/loop.png cannot be read (a link to loop.png: Too many levels" in error
    assert "or pass --skip-bad-images" in error
    ok(python_train([*flags, "--skip-bad-images"], workdir))
    assert summary(workdir / "runs/latest")["skipped_images"] == 1


def test_a_class_folder_that_cannot_be_listed_is_one_error_line(tmp_path, monkeypatch):
    # Tests often run as root, which lists a folder of mode 000 all the same: fail it by hand.
    write_image_folder(tmp_path / "images", per_class=2)
    iterdir = Path.iterdir

    def listing(self: Path):
        if self.name == "class1":
            raise PermissionError(13, "Permission denied", str(self))
        return iterdir(self)

    monkeypatch.setattr(Path, "iterdir", listing)
    with pytest.raises(UsageError, match=f"cannot list {tmp_path / 'images/class1'} "
                                         r"\(Permission denied\); fix its permissions"):
        task.ImageFolder(tmp_path / "images", augment=False)
