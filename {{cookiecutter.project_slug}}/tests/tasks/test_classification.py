"""Tests of the example task in task.py: a small CNN classifying 3x16x16 images.

They check this example learns and that its image-folder format works. When you replace task.py
with your own task, replace these with tests of yours; every other test keeps working.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import PROJECT_ROOT, ok, read_metrics, run_cmd, summary, torchrun
from PIL import Image

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.failures import SetupError


def test_learns_far_better_than_chance(workdir):
    ok(torchrun(["--dataset-size", "2048", "--hidden-size", "32", "--epochs", "3"], workdir))
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert losses[-1] < 0.5 * losses[0], "the training loss did not fall"
    final = read_metrics(workdir / "runs/latest", "val_loss")[-1]
    assert final["val_accuracy"] > 5 / task.SYNTHETIC_CLASSES  # chance is 1 / classes


def write_image_folder(root, per_class: int = 40) -> None:
    """Two classes told apart by colour, at a size the model resizes (24 x 20), in the formats
    image folders hold: JPEG, PNG, and a PNG in grey."""
    g = torch.Generator().manual_seed(0)
    for label, colour in enumerate([(200, 40, 40), (40, 40, 200)]):
        folder = root / f"class{label}"
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
    with pytest.raises(SetupError, match=f"--data: {tmp_path / 'bad.png'} cannot be decoded"):
        task.read_image(tmp_path / "bad.png")


def test_a_class_folder_without_images_says_which_and_why(tmp_path):
    write_image_folder(tmp_path / "images", per_class=2)
    (tmp_path / "images/class2").mkdir()
    with pytest.raises(SetupError, match="class 'class2' has no images; put its images in it"):
        task.ImageFolder(tmp_path / "images", augment=False)
    (tmp_path / "images/class2/more").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images/class2/more/0.png")
    with pytest.raises(SetupError, match="its images are one folder too deep"):
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
    assert "{{ cookiecutter.package_name }}/" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors and all(any(name in line for name in names) for line in errors), result.stderr
    result = ok(torchrun([*flags, "--skip-bad-images", "--resume", "never"], workdir))
    assert "--skip-bad-images: left out 3 file(s) that cannot be decoded" in result.stderr
    assert summary(workdir / "runs/latest")["skipped_images"] == 3
