"""A training step of your own (docs/custom-step.md): each worked example, as the doc writes it,
is the task.py of a copy of the project and trains under torchrun with 2 processes; the GAN logs
its parts, and a run of it killed with SIGKILL resumes to an uninterrupted run's state bit for
bit, with --grad-accum 2 and --ema-decay, under data_parallel and fsdp. Each mistake is one error
line: the checks themselves are tested here in this process (the default tier), a few as real
runs."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import (
    PROJECT_ROOT,
    ckpt_name,
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
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints
from {{ cookiecutter.package_name }}.config import DEFAULT_MODEL_LAYOUT, parse_args
from {{ cookiecutter.package_name }}.failures import UsageError
from {{ cookiecutter.package_name }}.metrics import OWN_FIELDS, fingerprint
from {{ cookiecutter.package_name }}.optim import Optimization
from {{ cookiecutter.package_name }}.runtime.torch_private import compile_supported
from {{ cookiecutter.package_name }}.step import Step, check_values, plain_step

pytestmark = [pytest.mark.full, pytest.mark.skipif(  # the slow tier: pytest --full
    DEFAULT_MODEL_LAYOUT == "tensor_parallel", reason="a train_step of one's own is not yet "
    "supported with --model-layout tensor_parallel (one error line)")]

DOC = (PROJECT_ROOT / "docs/custom-step.md").read_text()
# Each example: its section's heading, the values it logs, and short-run flags.
EXAMPLES = {
    "gan": ("## Example: a GAN", {"critic_loss", "penalty", "generator_loss", "lr_generator"},
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


# The GAN: two optimizers, two backward passes a step. (The teacher trains for real under both
# layouts in the tests below; its kill and resume is the same machinery, run here for the GAN.)
@pytest.mark.parametrize("layout", ["data_parallel", pytest.param("fsdp", marks=needs_numpy)])
@pytest.mark.parametrize("name", ["gan"])
def test_an_example_step_logs_its_parts_and_resumes_bit_for_bit(tmp_path, name, layout):
    project = project_copy(tmp_path, example(name))
    _, parts, flags = EXAMPLES[name]
    args = [*RUN, *flags, "--model-layout", layout]

    def command(where: str) -> list[str]:
        return [*torchrun_cmd(2), "train.py", *args, "--checkpoint-dir", where, "--output-dir",
                f"runs-{where}"]

    said = ok(run_cmd(command("a"), project, PYTHONPATH=str(project))).stdout
    if layout == "fsdp":  # what fsdp does with a step of one's own, said at the start
        assert ("note: with --grad-accum 2 under fsdp, p.grad is None in train_step before a "
                "group's last batch") in said, said
        assert name != "gan" or "note: fsdp shards GAN as one unit per child (generator, " \
            "critic)" in said, said
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


OPTIMIZERS = "def configure_optimizer(model, cfg):\n    return {}\n\n\ndef {}("
# (what the teacher example is changed into, what its error line says). Each is a real run, each
# at another place where the checks are made. The default step given two optimizers, a
# ReduceLROnPlateau, an update twice, none at a group's last batch and a value named lr are
# checked at those same places by the tests at the end of this file, in this process.
MISTAKES = {
    "returns a tensor": (("return {\"loss\": loss.detach(), \"labels\": labels.detach(), "
                          "\"teacher\": teacher.detach()}", "return loss"),
                         "task.train_step must return a dict of scalar tensors"),
    "unknown optimizer": (("step.update()", "step.update(\"student\")"),
                          "task.train_step: no optimizer 'student'"),
    "no update": (("step.update()", "pass"), "task.train_step never called step.update"),
    "shared parameter": (("def train_step(", OPTIMIZERS.format(
                             "{\"a\": torch.optim.SGD(model.parameters(), lr=0.1), \"b\": "
                             "torch.optim.SGD(model.student.parameters(), lr=0.1)}", "train_step")),
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


@needs_numpy
def test_a_module_inside_an_fsdp_unit_called_directly_is_one_line(tmp_path):
    """Not a DTensor traceback: the teacher's first layer, called alone, holds a shard (with
    --compile too, where torch.compile runs: the check was left out under it)."""
    task = example("teacher").replace('step.model(x, "teacher")', "step.module.teacher[0](x)")
    project = project_copy(tmp_path, task)
    compiled = ["--compile"] if compile_supported() else []
    line = one_error(run_cmd([sys.executable, "train.py", *RUN, *EXAMPLES["teacher"][2],
                              "--model-layout", "fsdp", *compiled], project,
                             PYTHONPATH=str(project)))
    assert ("step.module.teacher.0 was called outside its unit (by train_step or the model's "
            "forward): fsdp gathers its weights only inside that unit") in line
    assert not list_checkpoints(project / "checkpoints")


# The same names in another order on each rank, then a value rank 1 alone logs. And an optimizer
# that leaves out the student's last layers.
RANKS_DIFFER = [("    return {\"loss\": loss.detach(), \"labels\": labels.detach(), \"teacher\": "
                 "teacher.detach()}", """\
    values = {"loss": loss.detach(), "one": torch.ones(()), "two": torch.full((), 2.0)}
    if torch.distributed.get_rank() == 1:
        values = dict(reversed(values.items()))
        if step.number >= 2:
            values["extra"] = torch.zeros(())
    return values"""), ("def train_step(", OPTIMIZERS.format(
                    "torch.optim.AdamW(model.student[0].parameters(), lr=cfg.lr)", "train_step"))]


def test_values_are_averaged_by_name_and_names_that_differ_between_ranks_are_one_line(tmp_path):
    task = example("teacher")
    for old, new in RANKS_DIFFER:
        task = task.replace(old, new, 1)
    project = project_copy(tmp_path, task)
    result = run_cmd([*torchrun_cmd(2), "train.py", *RUN, "--grad-accum", "1", "--log-every",
                      "1", *EXAMPLES["teacher"][2]], project, PYTHONPATH=str(project))
    assert ("warning: no optimizer of task.configure_optimizer holds 4 trainable parameters "
            "(student.2.weight, student.2.bias, student.4.weight, ...): they never change") in \
        result.stderr
    line = one_error(result)  # not a wait for --timeout-s
    assert ("the values logged by step 3 differ in name between ranks: rank 0 logs loss, one, "
            "two, rank(s) 1 others") in line
    logged = read_metrics(project / "runs/latest")
    assert [(r["step"], r["one"], r["two"]) for r in logged] == [(1, 1.0, 2.0), (2, 1.0, 2.0)]
    assert set(logged[0]) - {"loss", "one", "two"} <= OWN_FIELDS


@pytest.mark.parametrize("layout", ["data_parallel", pytest.param("fsdp", marks=needs_numpy)])
def test_a_resume_with_other_optimizers_is_one_line_and_weights_only_goes_on(tmp_path, layout):
    project = project_copy(tmp_path, example("teacher"))
    command = [sys.executable, "train.py", *RUN, *EXAMPLES["teacher"][2], "--model-layout", layout]
    ok(run_cmd([*command, "--max-steps", "2"], project, PYTHONPATH=str(project)))
    before = list_checkpoints(project / "checkpoints")
    (project / "{{ cookiecutter.package_name }}/task.py").write_text(example("teacher").replace(
        "def train_step(", OPTIMIZERS.format("(o := torch.optim.AdamW(model.student.parameters()),"
                                             " torch.optim.lr_scheduler.StepLR(o, "
                                             "cfg.total_steps))", "train_step"), 1))
    line = one_error(run_cmd(command, project, PYTHONPATH=str(project)))
    assert (f"checkpoint {before[0].relative_to(project)} holds the optimizers (type, "
            "schedule) 'default' (AdamW, --lr-schedule); task.py gives 'default' (AdamW, "
            "StepLR); use --resume "
            "weights-only to go on from its weights with fresh optimizers, --resume never") in line
    assert list_checkpoints(project / "checkpoints") == before
    out = ok(run_cmd([*command, "--resume", "weights-only", "--max-steps", "1"], project,
                     PYTHONPATH=str(project))).stdout
    assert (f"--resume weights-only: the weights of {before[0].relative_to(project)}; the "
            "optimizers, their schedules and the position start afresh") in out
    assert "median step n/a, first step" in out  # one step: none timed after the first
    old, new = (load_state(path)["model"] for path in (
        next(project.glob(f"checkpoints/earlier-*/{before[0].name}")),  # moved aside, as it was
        list_checkpoints(project / "checkpoints")[0]))
    assert max((old[k] - new[k]).abs().max() for k in old) < 3e-3  # one step of AdamW's lr 1e-3


# The teacher example with a branch that leaves the student's last layer out on one rank at a
# time (DDP still exchanges every gradient), then a change to one weight on rank 1 only.
DRIFT = [("    x, y = batch", """\
    x, y = batch
    if step.number == 6 and torch.distributed.get_rank() == 1:
        with torch.no_grad():
            step.module.student[2].weight[0, 0] += 1e-3"""), ("    step.backward(loss)", """\
    if step.number % 3 == torch.distributed.get_rank() + 1:  # this rank's branch
        loss = labels = teacher = F.mse_loss(step.module.student[:4](x).mean(1, keepdim=True), y)
    step.backward(loss)""")]


def test_ranks_that_drift_apart_stop_the_run_in_one_line_before_a_save(tmp_path):
    task = example("teacher")
    for old, new in DRIFT:
        task = task.replace(old, new, 1)
    project = project_copy(tmp_path, task)
    result = run_cmd([*torchrun_cmd(2), "train.py", *RUN, *EXAMPLES["teacher"][2], "--grad-accum",
                      "1", "--save-every-steps", "2", "--check-replicas-every", "7"], project,
                     PYTHONPATH=str(project))
    line = one_error(result)
    assert "the ranks' weights differ at step 7: 'student.2.weight' has fingerprint " in line, line
    assert " (1 of 12 parameters differ): a step changed weights on some ranks only" in line
    assert [p.name for p in list_checkpoints(project / "checkpoints")] == [
        ckpt_name(6), ckpt_name(4), ckpt_name(2)]


def test_the_fingerprint_sees_changes_that_keep_every_sum():
    """Two weights swapped (across rows, or within one), one raised and one lowered, or four
    changed so that every row and every column keeps its sum: the sum is the same, the replica
    check's fingerprint is not; a 0-dim parameter and an empty fsdp shard have one too."""
    w = torch.randn(5, 3, dtype=torch.float64)
    swapped, in_a_row, moved, kept = w.clone(), w.clone(), w.clone(), w.clone()
    swapped[1, 2], swapped[3, 0] = w[3, 0], w[1, 2]
    in_a_row[2, 0], in_a_row[2, 1] = w[2, 1], w[2, 0]
    moved[0, 0], moved[4, 2] = w[0, 0] + 0.5, w[4, 2] - 0.5
    kept[1:3, 0:2] += torch.tensor([[0.5, -0.5], [-0.5, 0.5]], dtype=torch.float64)
    assert torch.allclose(kept.sum(0), w.sum(0)) and torch.allclose(kept.sum(1), w.sum(1))
    for other in (swapped, in_a_row, moved, kept):
        assert torch.isclose(other.sum(), w.sum()) and fingerprint(other) != fingerprint(w)
    assert fingerprint(w.clone()) == fingerprint(w)
    assert fingerprint(torch.tensor(2.0)) == 2.0 and fingerprint(torch.empty(0, 4)) == 0


# ---------------------------------------------------------------- the checks, in this process
def optimization(configure=None, model: nn.Module | None = None, *flags: str) -> Optimization:
    """The Optimization a run on the CPU builds over `model` (two small layers by default)."""
    model = model or nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    return Optimization(model, parse_args(list(flags), None, warn=False), torch.device("cpu"),
                        10, configure=configure)


def sgd(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.1)


@pytest.mark.quick
@pytest.mark.parametrize("made, says", [
    (lambda model, cfg: {}, "not an empty dict"),
    (lambda model, cfg: (sgd(model), "not a scheduler"), "not (SGD, str)"),
    (lambda model, cfg: (sgd(model), None, None), "not (SGD, NoneType, NoneType)"),
    (lambda model, cfg: (o := sgd(model), ReduceLROnPlateau(o)), "not (SGD, ReduceLROnPlateau): "
     "a schedule steps with its optimizer, so one by a metric is not supported; use one by "
     "step (e.g. LambdaLR) or --lr-schedule")])
def test_what_configure_optimizer_returns_is_checked_before_training(made, says):
    with pytest.raises(UsageError) as error:
        optimization(made)
    assert str(error.value).startswith("task.configure_optimizer must return a torch.optim.")
    assert str(error.value).endswith(says)


@pytest.mark.quick
def test_the_default_step_refuses_two_optimizers_and_parts_named_as_the_runs_own():
    two = optimization(lambda model, cfg: {"a": sgd(model[0]), "b": sgd(model[1])})
    with pytest.raises(UsageError, match=r"gives 2 optimizers; the default step updates one: "
                       r"define train_step\(step, batch\) in task.py, calling "
                       r"step.update\(name\) for each \(docs/custom-step.md\)"):
        plain_step(lambda model, batch: None, two.optimizers)
    model = nn.Linear(2, 1)
    optim = optimization(None, model)
    step = Step(model, model, optim, optim.cfg)
    for part in ("loss", "lr", "step"):
        train_step = plain_step(lambda model, batch, part=part: (
            (loss := model(batch).mean()), {part: loss.detach()}), optim.optimizers)
        with pytest.raises(UsageError, match=f"task.loss_fn's parts: '{part}' is a name the run "
                           "logs itself"):
            train_step(step, torch.ones(4, 2))
        optim.updated.clear()
    for name in ("epoch", "lr"):  # as the loop checks what train_step returns
        with pytest.raises(UsageError, match=f"task.train_step: '{name}' is a name the run logs"):
            check_values({"loss": torch.ones(()), name: torch.ones(())}, "task.train_step")
    assert list(check_values({"loss": torch.ones(())}, "task.train_step")) == ["loss"]


@pytest.mark.quick
def test_an_update_twice_or_none_at_the_groups_last_batch_is_one_line():
    optim = optimization()
    optim.update()
    with pytest.raises(UsageError, match="updated optimizer 'default' twice in one step"):
        optim.update()
    with pytest.raises(UsageError, match=r"never called step.update\(...\) at the last batch of "
                       "a --grad-accum 3 group, where the optimizers step"):
        optimization(None, None, "--grad-accum", "3").finish_step()
    with pytest.raises(UsageError, match=r"never called step.update\(...\): no optimizer"):
        optimization().finish_step()


@pytest.mark.quick
def test_trainable_parameters_no_optimizer_holds_are_named():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    assert optimization(lambda model, cfg: sgd(model[0]), model).unheld == ["1.weight", "1.bias"]
    assert optimization(None, model).unheld == []
    model[1].requires_grad_(False)  # frozen on purpose: nothing to say
    assert optimization(lambda model, cfg: sgd(model[0]), model).unheld == []


@pytest.mark.quick
def test_each_optimizers_learning_rate_is_logged_by_its_name():
    assert optimization(lambda model, cfg: {"a": sgd(model[0]), "b": sgd(model[1])}).lr() == {
        "lr": 0.1, "lr_b": 0.1}
    assert optimization().lr() == {"lr": 3e-3}


@pytest.mark.quick
def test_a_checkpoint_of_other_optimizers_or_schedules_is_refused_in_one_line():
    optim = optimization(lambda model, cfg: {"a": sgd(model[0]),
                                             "b": (o := sgd(model[1]), StepLR(o, 2))})
    optim.check_saved({"optim": optim.state_dict()}, "mine.pt")
    optim.check_saved({"optim": {"scheduler": {}}}, "older.pt")  # from before it was saved
    optim.check_saved({"optim": {"kinds": {"a": "--lr-schedule", "b": "StepLR"}}}, "old.pt")
    for saved in ({"a": "SGD, --lr-schedule"}, {"a": "--lr-schedule", "b": "--lr-schedule"},
                  {"a": "SGD, --lr-schedule", "body": "SGD, StepLR"},
                  {"a": "AdamW, --lr-schedule", "b": "SGD, StepLR"}):  # a type under its name
        with pytest.raises(UsageError) as error:
            optim.check_saved({"optim": {"kinds": saved}}, "ckpt.pt")
        there = ", ".join(f"'{name}' ({kind})" for name, kind in saved.items())
        assert str(error.value) == (
            f"checkpoint ckpt.pt holds the optimizers (type, schedule) {there}; task.py gives "
            "'a' (SGD, --lr-schedule), 'b' (SGD, StepLR); use --resume weights-only to go on from "
            "its weights with fresh optimizers, --resume never to start over, or another "
            "--checkpoint-dir")
