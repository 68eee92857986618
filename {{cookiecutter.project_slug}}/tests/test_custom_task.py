"""Your own task: a task.py written here (dict samples read one at a time, a custom collate, a
model that returns a dict, metrics with their own counts) replaces the example in a copy of the
project, and trains, evaluates and resumes exactly under torchrun with no other file touched."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import (
    assert_same_model,
    final_model,
    import_file,
    load_state,
    needs_numpy,
    ok,
    project_copy,
    read_metrics,
    run_cmd,
    summary,
    torchrun_cmd,
)

from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints
from {{ cookiecutter.package_name }}.config import DEFAULT_MODEL_LAYOUT, parse_args

pytestmark = pytest.mark.full  # the slow tier: pytest --full

CUSTOM_TASK = '''
"""A user's task: which of two noisy 8-dim clusters a point is from, as dicts all the way."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from {{ cookiecutter.package_name }}.config import setting


@dataclass
class Settings:  # the task's own flags: --dataset-size, --hidden-size, --dropout
    dataset_size: int = setting(400, "points to train on")
    hidden_size: int = setting(32, "width of the net", low=1)
    dropout: float = setting(0.1, "dropout after the first layer", low=0)


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
    return Points(cfg.task.dataset_size, cfg.seed), Points(37, cfg.seed + 100)


class Net(nn.Module):
    def __init__(self, width, dropout):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(dropout),
                                  nn.Linear(width, width))
        self.out = nn.Linear(width, 2)

    def forward(self, features):
        hidden = torch.relu(self.body(features))
        return {"logits": self.out(hidden), "hidden": hidden}


def build_model(cfg):
    return Net(cfg.task.hidden_size, cfg.task.dropout)


def blocks(model):
    return [model.body, model.out]


def configure_optimizer(model, cfg):  # two parameter groups and a scheduler of its own
    decay = [p for name, p in model.named_parameters() if name.endswith("weight")]
    rest = [p for name, p in model.named_parameters() if not name.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                   {"params": rest, "weight_decay": 0.0}], lr=cfg.lr)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)


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
    return project_copy(tmp_path, CUSTOM_TASK)


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
    if layout == "model_parallel_2":  # its checkpoints are data_parallel's (test_layouts)
        return
    # Resumed mid-run, both layouts end with the same weights, optimizer groups and schedule.
    train("--checkpoint-dir", "b", "--output-dir", "rb", "--max-steps", "17")
    # --max-steps inside an epoch evaluates the last weights (without touching the RNG: below).
    assert read_metrics(custom_project / "rb", "val_accuracy")[-1]["step"] == 17
    train("--checkpoint-dir", "b", "--output-dir", "rb")
    assert summary(custom_project / "rb")["resumed_from"]
    assert_same_model(final_model(custom_project / "a"), final_model(custom_project / "b"))
    # task.configure_optimizer's groups and scheduler, in the checkpoint and in the metrics.
    state = load_state(list_checkpoints(custom_project / "b")[0])
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.05, 0.0]
    assert state["optim"]["scheduler"]["step_size"] == 10
    lrs = [m["lr"] for m in read_metrics(custom_project / "rb") if "lr" in m]
    steps = summary(custom_project / "rb")["steps"]
    assert lrs[-1] == pytest.approx(0.01 * 0.9 ** (steps // 10))  # StepLR, once a step


def dropout_of_the_run(project, output_dir: str, checkpoint_dir: str) -> float:
    config = json.loads((project / output_dir / "config.json").read_text())
    saved = load_state(list_checkpoints(project / checkpoint_dir)[0])["config"]["task"]["dropout"]
    assert saved == config["task"]["dropout"]
    return saved


def test_a_setting_declared_in_task_py_alone_is_a_flag_everywhere(custom_project, monkeypatch,
                                                                 capsys):
    """`dropout` exists only in the task's Settings: a flag under torchrun, a key of --config
    files under spawn, saved in config.json and in every checkpoint, and checked like any flag."""
    small = ["--no-progress", "--epochs", "1", "--batch-size", "16"]
    if DEFAULT_MODEL_LAYOUT == "tensor_parallel":  # this task.py names no layers to split
        small += ["--model-layout", "fsdp"]
    run = {"PYTHONPATH": str(custom_project)}
    ok(run_cmd([*torchrun_cmd(2), "train.py", *small, "--dropout", "0.3", "--output-dir", "a",
                "--checkpoint-dir", "ca"], custom_project, **run))
    assert dropout_of_the_run(custom_project, "a", "ca") == 0.3
    (custom_project / "run.toml").write_text("dropout = 0.5\nhidden-size = 8\n")
    ok(run_cmd([sys.executable, "train.py", "--nprocs", "2", *small, "--config", "run.toml",
                "--output-dir", "b", "--checkpoint-dir", "cb"], custom_project, **run))
    assert dropout_of_the_run(custom_project, "b", "cb") == 0.5
    # A resumed run with another value says so.
    resumed = ok(run_cmd([*torchrun_cmd(2), "train.py", *small, "--epochs", "2", "--dropout",
                          "0.2", "--output-dir", "a", "--checkpoint-dir", "ca"], custom_project,
                         **run))
    assert "dropout: 0.3 -> 0.2" in resumed.stdout
    # Wrong types get the same one-line errors as the project's flags (argument parsing, here:
    # what train.py does with them before anything starts).
    # (the copy's task.py under a name of its own: the package's task stays as it is)
    settings = import_file(custom_project / "{{ cookiecutter.package_name }}/task.py",
                           "custom_task").Settings
    (custom_project / "bad.toml").write_text('dropout = "high"\n')
    monkeypatch.chdir(custom_project)

    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            parse_args(list(argv), settings)
        assert exit_.value.code == 2
        return capsys.readouterr().err.strip()

    assert refused("--dropout", "lots") == ("error: argument --dropout: invalid number value: "
                                             "'lots' (python train.py --help lists the flags)")
    assert "--dropout: must be a finite number at least 0, got -1" in refused("--dropout", "-1")
    assert "key 'dropout' must be a number" in refused("--config", "bad.toml")
