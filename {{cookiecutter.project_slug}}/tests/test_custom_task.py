"""Your own task: a task.py written here (dict samples read one at a time, a custom collate, a
model that returns a dict, metrics with their own counts) replaces the example in a copy of the
project, and trains, evaluates and resumes exactly under torchrun with no other file touched."""

from __future__ import annotations

import shutil

import pytest
from conftest import (
    PROJECT_ROOT,
    assert_same_model,
    final_model,
    needs_numpy,
    ok,
    read_metrics,
    run_cmd,
    summary,
    torchrun_cmd,
)

PACKAGE = "{{ cookiecutter.package_name }}"

CUSTOM_TASK = '''
"""A user's task: which of two noisy 8-dim clusters a point is from, as dicts all the way."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Points(Dataset):  # per-sample, dict items, no __getitems__
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.label = torch.randint(2, (n,), generator=g)
        self.x = torch.randn(n, 8, generator=g) + 3.0 * self.label[:, None]

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return {"features": self.x[i], "label": int(self.label[i])}


def collate(samples):
    return {"features": torch.stack([s["features"] for s in samples]),
            "label": torch.tensor([s["label"] for s in samples]),
            "size": len(samples)}


def build_datasets(cfg):
    return Points(cfg.dataset_size, cfg.seed), Points(37, cfg.seed + 100)


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width))
        self.out = nn.Linear(width, 2)

    def forward(self, features):
        hidden = torch.relu(self.body(features))
        return {"logits": self.out(hidden), "hidden": hidden}


def build_model(cfg):
    return Net(cfg.hidden_size)


def blocks(model):
    return [model.body, model.out]


def loss_fn(model, batch):
    assert batch["size"] == batch["label"].shape[0]
    return F.cross_entropy(model(batch["features"])["logits"], batch["label"])


def eval_metrics(model, batch):
    logits = model(batch["features"])["logits"]
    right = (logits.argmax(1) == batch["label"]).sum()
    return {"accuracy": right, "accuracy_count": batch["label"].numel(),
            "errors": batch["label"].numel() - right, "count": batch["label"].numel()}
'''

ARGS = ["--no-progress", "--dataset-size", "400", "--batch-size", "16", "--hidden-size", "16",
        "--epochs", "2", "--num-workers", "1", "--lr", "0.01"]


@pytest.fixture
def custom_project(tmp_path):
    """A copy of the project whose task.py is the one above."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(PROJECT_ROOT / "train.py", root)
    shutil.copytree(PROJECT_ROOT / PACKAGE, root / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / PACKAGE / "task.py").write_text(CUSTOM_TASK)
    return root


@pytest.mark.parametrize("layout", ["data_parallel", "model_parallel_2",
                                    pytest.param("fsdp", marks=needs_numpy)])
def test_a_task_of_dicts_trains_evaluates_and_resumes(custom_project, layout):
    def train(*extra):
        return ok(run_cmd([*torchrun_cmd(2), "train.py", *ARGS, "--model-layout", layout, *extra],
                          custom_project, PYTHONPATH=str(custom_project)))

    train("--checkpoint-dir", "a", "--output-dir", "ra")
    evals = read_metrics(custom_project / "ra", "val_accuracy")
    assert evals[-1]["val_accuracy"] > 0.9 and 0 <= evals[-1]["val_errors"] < 0.1
    # 37 validation samples, each counted once on one of the two ranks: a count of 37 exactly.
    assert abs(evals[-1]["val_accuracy"] + evals[-1]["val_errors"] - 1) < 1e-9
    if layout != "data_parallel":
        return  # resuming exactly is checked for every layout in test_layouts and test_recovery
    train("--checkpoint-dir", "b", "--output-dir", "rb", "--max-steps", "17")
    train("--checkpoint-dir", "b", "--output-dir", "rb")
    assert summary(custom_project / "rb")["resumed_from"]
    assert_same_model(final_model(custom_project / "a"), final_model(custom_project / "b"))
