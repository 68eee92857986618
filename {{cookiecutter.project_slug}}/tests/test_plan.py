"""doctor --plan: its memory figures are what a real run holds, a plan for 64 processes runs on this
CPU, and a setting that is wrong only at 64 processes is named."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import TRAIN, needs_numpy, ok, run_cmd, torchrun_cmd
from torch import nn

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.config import parse_args
from {{ cookiecutter.package_name }}.doctor import main as doctor
from {{ cookiecutter.package_name }}.failures import UsageError
from {{ cookiecutter.package_name }}.parallel import parallelize
from {{ cookiecutter.package_name }}.plan import EXACT, human_size, saved_bytes, static_memory

# Counts what each rank holds after its first optimizer step: its own parameters (fsdp: the local
# shards), the gradients the step used and the optimizer's state, as numel x element size.
COUNT = """
import json, sys
import torch
import torch.distributed as dist
import {{ cookiecutter.package_name }}.main as entry
from {{ cookiecutter.package_name }}.optim import Optimization
from {{ cookiecutter.package_name }}.runtime.workarounds import exit_process


def nbytes(tensors):
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


class Counting(Optimization):
    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.model = model

    def update(self, name=None):
        params = self.params["default"]
        grads = nbytes(p.grad for p in params if p.grad is not None)
        super().update(name)
        state = nbytes(t for s in self.optimizers["default"].state.values() for t in s.values()
                       if torch.is_tensor(t))
        with open(f"count{dist.get_rank()}.json", "w") as f:
            json.dump({"parameters": nbytes(self.model.parameters()), "gradients": grads,
                       "optimizer state": state}, f)


entry.Optimization = Counting  # what build_trainer builds the run's optimizer with
exit_process(entry.main(sys.argv[1:]))
"""


@pytest.mark.full
@pytest.mark.parametrize("layout", ["data_parallel", pytest.param("fsdp", marks=needs_numpy)])
def test_the_plans_figures_are_what_a_two_process_run_holds(workdir, layout):
    # An odd width: fsdp splits 15 rows 8 + 7, and the plan gives the fullest rank.
    flags = ["--dataset-size", "256", "--hidden-size", "15", "--batch-size", "8",
             "--model-layout", layout, "--max-steps", "1", "--val-fraction", "0"]
    if hasattr(task.Settings, "num_heads"):  # the language model: heads split the width
        flags += ["--num-heads", "5"]
    (workdir / "count.py").write_text(COUNT)
    ok(run_cmd([*torchrun_cmd(2), str(workdir / "count.py"), "--no-progress", *flags], workdir))
    ranks = [json.loads((workdir / f"count{rank}.json").read_text()) for rank in (0, 1)]
    planned = static_memory(parse_args(flags, task.Settings), layout, 2)[0][0]
    assert {part: max(r[part] for r in ranks) for part in EXACT} == {
        part: planned[part] for part in EXACT}
    assert (ranks[0] != ranks[1]) == (layout == "fsdp"), ranks


def test_a_plan_for_64_processes_runs_on_this_cpu(workdir, capsys):
    # (In this process: the README's own `doctor --plan --world-size 64` line runs as a command in
    # test_doc_commands.py.)
    assert doctor(["--plan", "--world-size", "64", "--gpu-memory-gb", "80"]) == 0
    stdout = capsys.readouterr().out
    assert "plan: 64 processes, 80 GB per GPU" in stdout
    whole = static_memory(parse_args([], task.Settings), "data_parallel", 64)[0][0]
    # fsdp on 8 nodes of 8: --shard-group-size 0 shards over a node (HSDP); 64 over every rank.
    hsdp = static_memory(parse_args([], task.Settings), "fsdp", 64, 8)[0][0]
    every_rank = parse_args(["--shard-group-size", "64"], task.Settings)
    fsdp = static_memory(every_rank, "fsdp", 64, 8)[0][0]
    assert fsdp["parameters"] < hsdp["parameters"] / 4 < whole["parameters"] / 4 / 4
    rows = {line.split("  ")[0]: line for line in stdout.splitlines()}
    for part in EXACT:
        assert f"{human_size(whole[part]):>18}{human_size(hsdp[part]):>18}" in rows[part]
    assert "settings at 64 processes:" in stdout
    assert "OK: --model-layout" in stdout
    assert not re.search(r"--[\w-]*-\n", stdout)  # no flag broken at its hyphen


def test_a_setting_wrong_only_at_64_processes_is_named(workdir, capsys):
    # 1024 samples in batches of 32: 16 steps an epoch at 2 processes, 1 at 64 (and 3 in the run,
    # shorter than the warm-up).
    flags = ["--plan", "--dataset-size", "1024", "--batch-size", "32", "--warmup-steps", "20",
             "--hidden-size", "8"]
    assert doctor([*flags, "--world-size", "2"]) == 0
    assert "warning:" not in capsys.readouterr().out
    assert doctor([*flags, "--world-size", "64"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # lines wrapped for the terminal, joined
    assert "warning: a global batch of 2,048 samples (--batch-size 32 x 64 processes x " \
           "--grad-accum 1) is more than the 1,024 training samples" in out
    assert "warning: --warmup-steps 20 is longer than the run (3 steps): the learning rate " \
           "never reaches --lr" in out
    assert "FAIL: 2 problem(s) at 64 processes" in out
    assert not torch.distributed.is_initialized()  # no process group, of 64 or any other size


@pytest.mark.full
@pytest.mark.parametrize("case", ["powersgd", pytest.param("fsdp", marks=needs_numpy)])
def test_the_run_says_what_the_plan_says_of_powersgd_and_of_fsdps_padding(workdir, capsys, case):
    """One function for both, so one set of words: PowerSGD at a rank that compresses nothing
    (the plan fails on it, the run warns of it and trains) and its note; fsdp's padded shards at
    3 ranks (a note in both)."""
    flags = ["--dataset-size", "256", "--epochs", "1", "--hidden-size", "16"]
    flags += (["--comm-hook", "powersgd", "--powersgd-rank", "64", "--powersgd-warmup-steps", "2",
               "--model-layout", "data_parallel"] if case == "powersgd"
              else ["--model-layout", "fsdp"])
    world = 2 if case == "powersgd" else 3
    code = doctor(["--plan", "--world-size", str(world), *flags])
    plan = " ".join(capsys.readouterr().out.split())  # lines wrapped for the terminal, joined
    run = ok(run_cmd([*torchrun_cmd(world), TRAIN, "--no-progress", *flags], workdir))
    said = [line.split(": ", 1)[1] for line in (run.stdout + run.stderr).splitlines()
            if line.startswith(("note: --powersgd-rank", "warning: --powersgd", "note: fsdp:"))]
    expected = 2 if case == "powersgd" else 1  # its note and its problem; the padding's note
    assert len(said) == expected and all(line in plan for line in said), (said, plan)
    assert code == (1 if case == "powersgd" else 0)
    if case == "powersgd":
        assert "PowerSGD compresses none of the" in said[1]


def test_a_flag_that_needs_a_validation_set_fails_the_plan_as_the_run_refuses_it(workdir, capsys):
    """The plan builds the data sets as the run does, and says what the run would refuse."""
    flags = ["--plan", "--world-size", "2", "--hidden-size", "8", "--keep-best", "val_loss:min"]
    assert doctor(flags) == 0
    capsys.readouterr()
    assert doctor([*flags, "--val-fraction", "0"]) == 1
    assert ("warning: --keep-best needs a validation set, and task.build_datasets returned none "
            "(raise --val-fraction?)") in " ".join(capsys.readouterr().out.split())


def test_a_run_that_does_not_fit_fails_the_plan(workdir, capsys):
    assert doctor(["--plan", "--world-size", "2", "--gpu-memory-gb", "2", "--hidden-size", "8"]) \
        == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "does not fit in 2 GB per GPU" in out


def test_activation_checkpointing_without_blocks_fails_the_plan_as_it_fails_the_run(
        workdir, capsys, monkeypatch):
    """A task without blocks(model): the plan says the run's error line, not "fits", also where
    it measures no activations (task.build_datasets fails on this machine)."""
    monkeypatch.delattr(task, "blocks", raising=False)
    flags = ["--activation-checkpointing", "--hidden-size", "8"]
    cfg = parse_args(flags, task.Settings)
    with pytest.raises(UsageError, match="--activation-checkpointing checkpoints") as run:
        parallelize(task.build_model(cfg), cfg, [torch.device("cpu")], task, True)
    for _ in range(2):
        assert doctor(["--plan", "--world-size", "2", *flags]) == 1
        assert capsys.readouterr().err == f"FAIL: {run.value}\n"
        monkeypatch.setattr(task, "build_datasets", lambda cfg: 1 / 0)


def test_the_plans_refusals_name_the_doctors_help(workdir, capsys):
    """A bad --plan flag is one line that sends the user to the doctor's --help, not train.py's."""
    with pytest.raises(SystemExit) as exit_:
        doctor(["--plan", "--world-size", "0"])
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and stderr.strip().endswith(
        "(python -m {{ cookiecutter.package_name }}.doctor --help lists the flags)"), stderr


def test_activations_are_the_tensors_autograd_keeps():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    # The first Linear keeps its input, ReLU its output, the second Linear that same output (one
    # storage, counted once); the weights are parameters, counted elsewhere.
    whole = 5 * 8 * 4 + 5 * 16 * 4  # [first stage, second stage, one device]
    assert saved_bytes(model, lambda: model(x).sum(), set()) == [whole, 0, whole]
    second = set(model[1:].modules())
    assert saved_bytes(model, lambda: model(x).sum(), second) == [5 * 8 * 4, 5 * 16 * 4, whole]
    # Three blocks of Linear, ReLU, Linear: each keeps its input (5 x 8), its ReLU output (5 x 16).
    # Checkpointed, a block keeps its input, and its ReLU output only while it is recomputed: on
    # one device one block's at a time, on two stages one on each.
    blocks = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(3)]
    model = nn.Sequential(*blocks, nn.Linear(8, 4))
    whole = (4 * 5 * 8 + 3 * 5 * 16) * 4
    assert saved_bytes(model, lambda: model(x).sum(), set()) == [whole, 0, whole]
    kept = (4 * 5 * 8 + 5 * 16) * 4
    assert saved_bytes(model, lambda: model(x).sum(), set(), set(blocks)) == [kept, 0, kept]
    second = set(model[2:].modules())  # the last block and the head
    assert saved_bytes(model, lambda: model(x).sum(), second, set(blocks)) == [
        (2 * 5 * 8 + 5 * 16) * 4, (2 * 5 * 8 + 5 * 16) * 4, kept]
