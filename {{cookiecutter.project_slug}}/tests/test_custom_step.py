"""A training step of your own (docs/custom-step.md): each worked example, as the doc writes it,
is the task.py of a copy of the project; it trains under torchrun with 2 processes, logs its
parts, and a run killed with SIGKILL resumes to an uninterrupted run's state bit for bit, with
--grad-accum 2 and --ema-decay, under data_parallel and fsdp. Each mistake is one error line."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import (
    PROJECT_ROOT,
    kill_a_worker_once_saved,
    load_state,
    needs_numpy,
    ok,
    one_error,
    project_copy,
    read_metrics,
    run_cmd,
    summary,
    torchrun_cmd,
)

from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints

pytestmark = pytest.mark.full  # the slow tier: pytest --full

DOC = (PROJECT_ROOT / "docs/custom-step.md").read_text()
# Each example: its section's heading, the values it logs, and short-run flags.
EXAMPLES = {
    "gan": ("## Example: a GAN", {"critic_loss", "generator_loss"},
            ["--dataset-size", "512", "--hidden-size", "16", "--lr", "2e-3"]),
    "teacher": ("## Example: a frozen teacher", {"loss", "labels", "teacher"},
                ["--dataset-size", "512", "--hidden-size", "8"]),
}
RUN = ["--no-progress", "--batch-size", "16", "--epochs", "3", "--grad-accum", "2",
       "--ema-decay", "0.99", "--save-every-steps", "5", "--log-every", "4"]


def example(name: str) -> str:
    """The example's task.py: the first python block of its section, as written."""
    section = DOC.split(EXAMPLES[name][0], 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def assert_same_state(expected: dict, got: dict) -> None:
    """Equal weights, EMA and optimizer states (every tensor), and the same schedule."""
    for part in ("model", "ema", "optimizer"):
        flat_a, flat_b = flatten(expected[part]), flatten(got[part])
        assert flat_a.keys() == flat_b.keys(), part
        for key, value in flat_a.items():
            same = torch.equal(value, flat_b[key]) if torch.is_tensor(value) else \
                value == flat_b[key]
            assert same, f"{part} {key} differs"
    assert expected["optim"]["scheduler"] == got["optim"]["scheduler"]


def flatten(tree, prefix: str = "") -> dict:
    """{path: leaf} of nested dicts and lists."""
    if isinstance(tree, dict | list | tuple):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        return {path: leaf for key, sub in items
                for path, leaf in flatten(sub, f"{prefix}/{key}").items()}
    return {prefix: tree}


@pytest.mark.parametrize("layout", ["data_parallel", pytest.param("fsdp", marks=needs_numpy)])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_an_example_step_logs_its_parts_and_resumes_bit_for_bit(tmp_path, name, layout):
    project = project_copy(tmp_path, example(name))
    _, parts, flags = EXAMPLES[name]
    args = [*RUN, *flags, "--model-layout", layout]

    def command(where: str) -> list[str]:
        return [*torchrun_cmd(2), "train.py", *args, "--checkpoint-dir", where, "--output-dir",
                f"runs-{where}"]

    ok(run_cmd(command("a"), project, PYTHONPATH=str(project)))
    logged = read_metrics(project / "runs-a", "step")
    assert parts == set().union(*(set(r) & parts for r in logged))
    kill_a_worker_once_saved(command("b"), project, project / "b", step=10)
    ok(run_cmd(command("b"), project, PYTHONPATH=str(project)))
    assert summary(project / "runs-b")["resumed_from"]
    assert_same_state(load_state(list_checkpoints(project / "a")[0]),
                      load_state(list_checkpoints(project / "b")[0]))


@pytest.mark.nccl
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gan_trains_in_fp16_with_one_loss_scale(tmp_path):
    project = project_copy(tmp_path, example("gan"))
    ok(run_cmd([sys.executable, "train.py", *RUN, *EXAMPLES["gan"][2], "--precision", "fp16",
                "--backend", "nccl"], project, gpus=True, PYTHONPATH=str(project)))
    state = load_state(list_checkpoints(project / "checkpoints")[0])
    assert state["optim"]["scaler"]["scale"] > 0  # one scaler, for both optimizers
    assert summary(project / "runs/latest")["steps"] > 0


MISTAKES = {  # (what the teacher example is changed into, what its error line says)
    "returns a tensor": (("return {\"loss\": loss.detach(), \"labels\": labels.detach(), "
                          "\"teacher\": teacher.detach()}", "return loss"),
                         "task.train_step must return a dict of scalar tensors"),
    "unknown optimizer": (("step.update()", "step.update(\"student\")"),
                          "task.train_step: no optimizer 'student'"),
    "no update": (("step.update()", "pass"), "task.train_step never called step.update"),
    "shared parameter": (("def train_step(", "def configure_optimizer(model, cfg):\n    return "
                          "{\"a\": torch.optim.SGD(model.parameters(), lr=0.1), \"b\": "
                          "torch.optim.SGD(model.student.parameters(), lr=0.1)}\n\n\n"
                          "def train_step("),
                         "parameter 'student.0.weight' is in optimizers 'a' and 'b'"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_mistaken_step_is_one_error_line_and_leaves_no_checkpoint(tmp_path, mistake):
    (old, new), says = MISTAKES[mistake]
    task = example("teacher")
    assert old in task
    project = project_copy(tmp_path, task.replace(old, new, 1))
    line = one_error(run_cmd([sys.executable, "train.py", *RUN, *EXAMPLES["teacher"][2]],
                             project, PYTHONPATH=str(project)))
    assert says in line
    assert not list_checkpoints(project / "checkpoints")
