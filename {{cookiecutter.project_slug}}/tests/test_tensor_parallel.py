"""--model-layout tensor_parallel on 4 gloo processes (2 x 2): the same losses as one process with
the same global batch, a SIGKILLed worker that resumes bit for bit, checkpoints that resume under
fsdp, a frozen peer and a host that drops off ending every rank within --timeout-s, and the plan's
mistakes as one error line. (Generated with model_layout=tensor_parallel.)"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    PROJECT_ROOT,
    TRAIN,
    assert_same_model,
    child_env,
    descendants,
    final_model,
    kill_a_worker_once_saved,
    made_once,
    ok,
    one_error,
    project_copy,
    python_train,
    read_metrics,
    run_cmd,
    summary,
    torchrun,
    torchrun_cmd,
    why_not_the_example_task,
    workers,
)
from torch import nn

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.config import parse_args
from {{ cookiecutter.package_name }}.failures import UsageError
from {{ cookiecutter.package_name }}.tensor_parallel import task_plan

pytestmark = [pytest.mark.full, pytest.mark.skipif(
    not hasattr(task, "tensor_parallel_plan"), reason="task.py has no tensor_parallel_plan")]
# The tests marked so run the example task (its --dataset-size and --hidden-size); a task of your
# own tests its tensor-parallel run in tests/test_task.py (hf_causal_lm's shows how).
NOT_THE_EXAMPLE = why_not_the_example_task()
EXAMPLE = pytest.mark.skipif(NOT_THE_EXAMPLE is not None,
                             reason=f"uses the example task; {NOT_THE_EXAMPLE}")
# Before torch 2.9 a CPU run is one error line (test_a_task_without_a_plan_is_one_error_line).
TRAINS = pytest.mark.skipif(torch.__version__ < "2.9", reason="FSDP2 over gloo needs torch 2.9")

# 4 steps an epoch at 4 x 16 samples; 12 steps, a checkpoint every 2, all kept. --clip-grad so
# small that AdamW's eps outweighs the clipped gradients: the updates follow the clipped norm (at
# 2e-6 the losses differ from 1e-6's in the third digit), so a wrong norm changes the losses.
SMALL = ["--dataset-size", "256", "--hidden-size", "16", "--epochs", "3", "--clip-grad", "1e-6",
         "--ema-decay", "0.9", "--log-every", "1", "--save-every-steps", "2", "--keep-last", "10"]
TP = [*SMALL, "--model-layout", "tensor_parallel", "--tp-size", "2", "--batch-size", "16"]


def losses(output_dir: Path, key: str = "loss") -> list[float]:
    return [r[key] for r in read_metrics(output_dir, key)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """a: 2 x 2 never interrupted; b: the same, its last worker SIGKILLed once the checkpoint of
    step 6 is written, and restarted by torchrun; one: one process, data_parallel, the same
    global batch (64)."""
    def make(folder: Path) -> None:
        ok(torchrun([*TP, "--checkpoint-dir", "a", "--output-dir", "runs/a"], folder, nproc=4))
        kill_a_worker_once_saved([*torchrun_cmd(4, "--max-restarts=1"), TRAIN, "--no-progress",
                                  *TP, "--checkpoint-dir", "b", "--output-dir", "runs/b"],
                                 folder, folder / "b", step=6, worker=3)
        ok(python_train([*SMALL, "--model-layout", "data_parallel", "--batch-size", "64",
                         "--checkpoint-dir", "one", "--output-dir", "runs/one"], folder))
    return made_once(tmp_path_factory, "tensor-parallel", make)


@EXAMPLE
@TRAINS
def test_two_by_two_learns_as_one_process_with_the_same_global_batch(runs):
    a, one = runs / "runs/a", runs / "runs/one"
    assert summary(a)["model_layout"] == "tensor_parallel" and summary(a)["steps"] == 12
    assert losses(a) == pytest.approx(losses(one), rel=1e-5)  # the norm over both meshes
    for key in ("val_loss", "val_raw_loss"):  # the moving average's weights, and the weights
        assert losses(a, key) == pytest.approx(losses(one, key), rel=1e-5), key


@EXAMPLE
@TRAINS
def test_each_rank_holds_its_part_of_each_split_weight(runs):
    """In the checkpoint's metadata: the plan's first colwise weight in 4 pieces (tp x dp: 1/4 of
    its rows each), a weight the plan leaves whole within a tensor-parallel group in 2 (dp)."""
    from torch.distributed.checkpoint import FileSystemReader

    model = task.build_model(parse_args(TP, task.Settings))
    layers = task_plan(model, task, 2)
    split = next(name for name, style in layers.items() if style == "colwise")
    whole = next(name for name, _ in model.named_parameters()
                 if name.rsplit(".", 1)[0] not in layers)
    rows, columns = model.get_submodule(split).weight.shape
    meta = FileSystemReader(str(runs / "a/ckpt_step00000012")).read_metadata()
    pieces = {key: [list(c.sizes) for c in meta.state_dict_metadata[f"model.{key}"].chunks]
              for key in (f"{split}.weight", whole)}
    assert pieces[f"{split}.weight"] == [[rows // 4, columns]] * 4, pieces
    rows, *rest = model.get_parameter(whole).shape
    assert pieces[whole] == [[math.ceil(rows / 2), *rest], [rows // 2, *rest]], pieces


@EXAMPLE
@TRAINS
def test_a_killed_worker_restarts_and_ends_bit_for_bit(runs):
    resumed = summary(runs / "runs/b")["resumed_from"]  # step 6, or a later one saved meanwhile
    assert resumed[-8:] in ("00000006", "00000008", "00000010"), resumed
    assert_same_model(final_model(runs / "a"), final_model(runs / "b"))


@EXAMPLE
@TRAINS
def test_its_checkpoints_resume_under_the_other_layouts_and_back(runs, tmp_path):
    """Step 6 of a, resumed on 2 ranks under fsdp and on one under data_parallel (global batch 64
    still): a's losses of steps 7 to 12, so the weights and the optimizer state came back whole;
    fsdp's step 8 resumed as 2 x 2: a's steps 9 to 12. The export is the plain model."""
    a = losses(runs / "runs/a")
    for layout, flags, nproc in (("fsdp", ["--batch-size", "32"], 2),
                                 ("data_parallel", ["--batch-size", "64"], 1)):
        shutil.copytree(runs / "a/ckpt_step00000006", tmp_path / layout / "ckpt_step00000006")
        args = [*SMALL, "--model-layout", layout, *flags, "--checkpoint-dir", layout,
                "--output-dir", f"runs/{layout}"]
        ok(torchrun(args, tmp_path) if nproc == 2 else python_train(args, tmp_path))
        assert summary(tmp_path / "runs" / layout)["resumed_from"].endswith("ckpt_step00000006")
        assert losses(tmp_path / "runs" / layout) == pytest.approx(a[6:], rel=1e-5), layout
    shutil.copytree(tmp_path / "fsdp/ckpt_step00000008", tmp_path / "back/ckpt_step00000008")
    ok(torchrun([*TP, "--checkpoint-dir", "back", "--output-dir", "runs/back"], tmp_path, nproc=4))
    assert losses(tmp_path / "runs/back") == pytest.approx(a[8:], rel=1e-5)
    out = tmp_path / "model.pt"
    ok(run_cmd([sys.executable, "-m", "{{ cookiecutter.package_name }}.checkpoint", "export",
                str(runs / "a/ckpt_step00000012"), str(out)], PROJECT_ROOT))
    exported = torch.load(out, map_location="cpu", weights_only=True)
    task.build_model(parse_args(SMALL, task.Settings)).load_state_dict(exported["model"])


@EXAMPLE
@TRAINS
def test_a_frozen_peer_of_a_tensor_parallel_group_is_named_within_the_timeout(tmp_path):
    """Rank 3 frozen (SIGSTOP: a hung GPU, a stuck host) in a 2 x 2 run: a rank names it within
    --timeout-s and a margin. (The log step's all_reduce over every rank notices it first: the
    mesh groups' own timeout is what the host cut off below checks.)"""
    job = subprocess.Popen([*torchrun_cmd(4), TRAIN, "--no-progress", *TP, "--epochs", "1000",
                            "--timeout-s", "5", "--output-dir", "out"], cwd=tmp_path,
                           env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        metrics = tmp_path / "out/metrics.jsonl"
        while not metrics.is_file() or len(metrics.read_text().splitlines()) < 2:
            assert job.poll() is None, job.communicate()
            time.sleep(0.05)
        os.kill(workers(job.pid)[3], signal.SIGSTOP)
        stopped = time.monotonic()
        error = next((line for line in job.stderr if line.startswith("error:")), "")
        took = time.monotonic() - stopped
    finally:
        for pid in [job.pid, *descendants(job.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.communicate(timeout=60)
    assert "rank(s) that stopped answering: 3 on " in error, error
    assert took < 5 + 15, f"took {took:.1f} s to notice"


@EXAMPLE
@TRAINS
@pytest.mark.network
def test_a_host_that_drops_off_ends_every_process_of_both_hosts(hosts, tmp_path, bin_dir):
    """2 hosts x 2 processes: tp within a host, dp across them (a mesh's own groups). Host 1's
    link goes down after the first checkpoint: every process of both hosts ends within
    --timeout-s and a margin; each node prints at least one error line, and each line names the
    ranks of the host it lost or says it lost contact."""
    from test_network import TIMEOUT_S, errors, finish, start_node, wait_for_checkpoint

    args = [*TP, "--epochs", "1000"]
    nodes = [start_node(host, rank, hosts[0], 29400, args, tmp_path, bin_dir, NPROC="2")
             for rank, host in enumerate(hosts)]
    wait_for_checkpoint(tmp_path / "ck", nodes)
    hosts[1].link("down")
    cut = time.monotonic()
    while any(host.pids() for host in hosts):
        assert time.monotonic() - cut < TIMEOUT_S + 15, [host.pids() for host in hosts]
        time.sleep(0.2)
    took = time.monotonic() - cut
    (code0, out0), (code1, out1) = finish(nodes, 30)
    assert code0 and code1
    # Each node says why it stopped: a line that names the other host's ranks or the lost
    # contact. Which rank says what is a race: a rank that ends first takes its node's store with
    # it (rank 0's), and torchrun's agent ends the node's other rank, which may then also say that
    # its launcher is gone (seen in 1 run of some). No other line.
    for out, other in ((out0, hosts[1]), (out1, hosts[0])):
        lines = errors(out)
        why = [line for line in lines if "stopped answering: " in line and
               f"on vm ({other.address})" in line or "lost contact with the other ranks" in line]
        assert why and all(line in why or re.search(r"its launcher \(pid \d+\) is gone", line)
                           for line in lines), out
    print(f"host 1 cut off: every process of both hosts ended {took:.1f} s later")


@EXAMPLE
def test_a_task_without_a_plan_is_one_error_line(tmp_path):
    """Before torch's own check: on a torch before 2.9, a run with the plan is that torch's line
    (FSDP2 on a CPU, runtime/torch_private.py), and the plan's checks, in-process, pass."""
    source = (PROJECT_ROOT / "{{ cookiecutter.package_name }}/task.py").read_text()
    project = project_copy(tmp_path, source.replace("def tensor_parallel_plan", "def _no_plan"))
    result = run_cmd([sys.executable, str(project / "train.py"), "--no-progress", *TP,
                      "--tp-size", "1"], tmp_path, PYTHONPATH=str(project))
    assert "define tensor_parallel_plan(model, tp_size) in task.py" in one_error(result)
    if torch.__version__ < "2.9":
        line = one_error(python_train([*TP, "--tp-size", "1"], tmp_path))
        assert "--model-layout tensor_parallel on a CPU needs FSDP2's gradients averaged over " \
               f"gloo, which torch {torch.__version__} lacks; install torch 2.9" in line, line


@EXAMPLE
def test_the_examples_plan_names_each_layer_in_the_models_order():
    model = task.build_model(parse_args(TP, task.Settings))
    layers = task_plan(model, task, 2)
    assert list(layers) == [name for name, _ in model.named_modules() if name in layers]
    assert "colwise" in layers.values() and "rowwise" in layers.values()
    if hasattr(model, "blocks") and hasattr(model.blocks[0], "heads"):  # the language model's
        assert layers["blocks.1.q"] == "colwise"
        model = task.build_model(parse_args([*TP, "--num-heads", "2"], task.Settings))
        with pytest.raises(UsageError, match="--tp-size 4 must divide --num-heads 2"):
            task_plan(model, task, 4)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 4)


class Own:  # a task.py whose plan is wrong
    plan: object = {}

    @classmethod
    def tensor_parallel_plan(cls, model, tp_size):
        return cls.plan


@pytest.mark.parametrize(("plan", "words"), [
    ({"head": "colwise"}, "'head' is colwise and no rowwise layer after it takes its outputs"),
    ({"mlp.0": "colwise"}, "'mlp.0' is colwise and no rowwise layer after it"),
    ({"mlp.0": "rowwise", "mlp.2": "colwise"}, "'mlp.0' is rowwise with no colwise layer before"),
    ({"mlp.0": "colwise", "head": "rowwise"}, "'head' is rowwise with 8 inputs, but the colwise "
     "layers before it (mlp.0) give 16 outputs"),
    (None, "tensor_parallel_plan returned None: return a dict {module path:"),
    ({}, "tensor_parallel_plan returned {}: return a dict"),
    ({"mlp.9": "colwise"}, "'mlp.9' names no module of the model; write paths as "
     "model.named_modules() gives them (e.g. 'mlp.0')"),
    ({"norm": "colwise"}, "'norm' is a LayerNorm, and only nn.Linear layers split"),
    ({"mlp": "colwise"}, "'mlp' is a Sequential, and only nn.Linear layers split; name the linear "
     "layers themselves (e.g. 'mlp.0')"),
    ({"mlp.0": "columns"}, "'mlp.0': 'columns' is not a style; write 'colwise' or 'rowwise'"),
    ({"mlp.0": None}, "'mlp.0': None is not a style"),
], ids=lambda value: "" if isinstance(value, str) else repr(value))
def test_a_plan_that_would_train_a_wrong_model_is_one_error_line(plan, words):
    Own.plan = plan
    with pytest.raises(UsageError) as error:
        task_plan(Toy(), Own, 2)
    assert words in str(error.value)


def test_a_right_plan_is_the_models_order_and_the_sizes_tp_divides():
    Own.plan = {"mlp.2": "rowwise", "mlp.0": "colwise"}
    assert list(task_plan(Toy(), Own, 2).items()) == [("mlp.0", "colwise"), ("mlp.2", "rowwise")]
    with pytest.raises(UsageError, match="'mlp.0' has 16 outputs, which --tp-size 3 does not "
                       "divide"):
        task_plan(Toy(), Own, 3)


@EXAMPLE
def test_the_plan_counts_each_ranks_share_and_refuses_what_the_run_refuses():
    """doctor --plan's figures for 2 x 2: the pieces the checkpoint's metadata shows above; and
    the refusals of the run (a bad plan, --compile, a step of one's own), in the same words."""
    from {{ cookiecutter.package_name }}.parallel import rows_on_rank
    from {{ cookiecutter.package_name }}.plan import static_memory
    from {{ cookiecutter.package_name }}.tensor_parallel import shapes_on_rank

    cfg = parse_args(TP, task.Settings)
    model = task.build_model(cfg)
    shapes, dp = shapes_on_rank(model, task, cfg, 4)
    layers = task_plan(model, task, 2)
    split = next(name for name, style in layers.items() if style == "colwise")
    whole = next(p for name, p in model.named_parameters() if name.rsplit(".", 1)[0] not in layers)
    rows, columns = model.get_submodule(split).weight.shape
    assert (dp, shapes[id(model.get_submodule(split).weight)]) == (2, [rows // 2, columns])
    assert shapes[id(whole)] == list(whole.shape)
    sizes = [rows_on_rank(torch.empty(shape), dp) for shape in shapes.values()]
    assert static_memory(cfg, "tensor_parallel", 4)[0][0]["parameters"] == 4 * sum(sizes)
    with pytest.raises(UsageError, match="--compile is not yet supported with --model-layout "
                       "tensor_parallel"):
        static_memory(parse_args([*TP, "--compile"], task.Settings), "tensor_parallel", 4)


@EXAMPLE
@TRAINS
@pytest.mark.parametrize("mistake", ["--compile", "train_step", "head colwise"])
def test_the_run_refuses_what_it_does_not_do_yet_in_one_line(tmp_path, mistake):
    """The run's own refusals on 2 processes, before any step: --compile, a train_step of one's
    own, and a plan whose last colwise layer no rowwise one follows."""
    source = (PROJECT_ROOT / "{{ cookiecutter.package_name }}/task.py").read_text()
    if mistake == "train_step":
        source += "\n\ndef train_step(step, batch):\n    return {}\n"
    if mistake == "head colwise":
        source += ("\n\ndef tensor_parallel_plan(model, tp_size):\n"
                   "    return dict([(name, 'colwise') for name, m in model.named_modules()\n"
                   "                 if isinstance(m, nn.Linear)][-1:])\n")
    project = project_copy(tmp_path, source)
    flags = ["--compile"] if mistake == "--compile" else []
    result = run_cmd([*torchrun_cmd(2), str(project / "train.py"), "--no-progress", *TP, *flags],
                     tmp_path, PYTHONPATH=str(project))
    line = one_error(result)
    words = {"--compile": "--compile is not yet supported with --model-layout tensor_parallel",
             "train_step": "a train_step of one's own is not yet supported",
             "head colwise": "is colwise and no rowwise layer after it takes its outputs"}
    assert words[mistake] in line, line
    assert not (tmp_path / "checkpoints").exists()
