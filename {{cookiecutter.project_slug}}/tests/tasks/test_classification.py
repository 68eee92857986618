"""Tests of the example task in task.py: a small CNN classifying 3x16x16 images.

They check this example learns and that its image-folder format works. When you replace task.py
with your own task, replace these with tests of yours; every other test keeps working.
"""

from __future__ import annotations

import torch
from conftest import ok, read_metrics, torchrun

from {{ cookiecutter.package_name }} import task


def test_learns_far_better_than_chance(workdir):
    ok(torchrun(["--dataset-size", "2048", "--hidden-size", "32", "--epochs", "3"], workdir))
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert losses[-1] < 0.5 * losses[0], "the training loss did not fall"
    final = read_metrics(workdir / "runs/latest", "val_loss")[-1]
    assert final["val_accuracy"] > 5 / task.SYNTHETIC_CLASSES  # chance is 1 / classes


def write_ppm(path, image: torch.Tensor) -> None:
    """A binary PPM (P6) of a 3 x H x W uint8 tensor."""
    c, h, w = image.shape
    path.write_bytes(f"P6\n# test image\n{w} {h}\n255\n".encode()
                     + bytes(image.permute(1, 2, 0).flatten().tolist()))


def write_image_folder(root, per_class: int = 40) -> None:
    """Two classes told apart by colour, at a size the model resizes (24 x 20)."""
    g = torch.Generator().manual_seed(0)
    for label, colour in enumerate([(200, 40, 40), (40, 40, 200)]):
        folder = root / f"class{label}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            noise = torch.randint(-40, 40, (3, 20, 24), generator=g)
            image = (torch.tensor(colour)[:, None, None] + noise).clamp(0, 255).to(torch.uint8)
            write_ppm(folder / f"{i:03d}.ppm", image)


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


def test_a_folder_without_class_folders_is_one_error_line(workdir):
    (workdir / "flat").mkdir()
    result = torchrun(["--data", "flat", "--epochs", "1"], workdir)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert "expected a folder with one sub-folder per class" in errors[0]
