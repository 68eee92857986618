"""Model layouts, precision and BatchNorm options, run with 2 gloo processes on CPU."""

from __future__ import annotations

import json
import os
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
    final_model,
    load_state,
    made_once,
    needs_numpy,
    ok,
    one_error,
    python_train,
    read_metrics,
    run_cmd,
    skip_unless_example_task,
    summary,
    torchrun,
    torchrun_cmd,
)

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.checkpoint.files import checkpoint_path
from {{ cookiecutter.package_name }}.config import DEFAULT_MODEL_LAYOUT, parse_args
from {{ cookiecutter.package_name }}.data import BatchFetcher
from {{ cookiecutter.package_name }}.failures import UsageError
from {{ cookiecutter.package_name }}.parallel import (
    checkpoint_blocks,
    model_blocks,
    split_over_two,
    usable_blocks,
)

pytestmark = pytest.mark.full  # the slow tier: pytest --full

QUICK = ["--dataset-size", "256", "--batch-size", "16", "--hidden-size", "16"]  # 8 steps an epoch
needs_blocks = pytest.mark.skipif(not hasattr(task, "blocks"), reason="model_parallel_2 splits "
                                  "the model at task.blocks(model), which task.py does not define")


def first_batch(size: int):
    """A batch of the task's training data, made the way the project makes them."""
    cfg = parse_args(["--dataset-size", "16", "--val-fraction", "0"], task.Settings)
    train_set, _ = task.build_datasets(cfg)
    return BatchFetcher(train_set, getattr(task, "collate", None)).__getitems__(
        (0, torch.arange(size)))


@needs_blocks
def test_split_model_computes_what_the_single_device_model_computes(example_task):
    torch.manual_seed(0)
    cfg = parse_args(["--hidden-size", "16", "--num-layers", "3"], task.Settings)
    single = task.build_model(cfg).eval()
    split = task.build_model(cfg)
    split.load_state_dict(single.state_dict())
    split_over_two(split, model_blocks(split, task), [torch.device("cpu")] * 2)
    assert list(split.state_dict()) == list(single.state_dict()), "same parameter names"
    batch = first_batch(4)
    with torch.no_grad():
        assert torch.equal(task.loss_fn(split.eval(), batch), task.loss_fn(single, batch))


@needs_blocks
def test_model_parallel_layout_trains_and_resumes_as_data_parallel(workdir):
    ok(torchrun([*QUICK, "--epochs", "1", "--model-layout", "model_parallel_2"], workdir))
    assert summary(workdir / "runs/latest")["steps"] == 8
    # The split model's checkpoint continues in the single-device layout, and back again.
    ok(torchrun([*QUICK, "--epochs", "2", "--model-layout", "data_parallel"], workdir))
    resumed = summary(workdir / "runs/latest")
    assert resumed["resumed_from"].endswith("ckpt_step00000008.pt") and resumed["steps"] == 16
    ok(torchrun([*QUICK, "--epochs", "3", "--model-layout", "model_parallel_2"], workdir))
    assert summary(workdir / "runs/latest")["steps"] == 24


@needs_blocks
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_activation_checkpointing_computes_the_same_gradients_and_statistics(example_task,
                                                                             compiled):
    """The blocks' second forward gives the gradients (eager: bit for bit), and a BatchNorm's
    running statistics count the batch once, also after the model moved (new buffer tensors)
    and with each block compiled as fsdp compiles them (the runs' resumes: test_train and the
    fsdp tests)."""
    torch.manual_seed(0)
    norm = ["--batch-norm"] if "batch_norm" in task.Settings.__dataclass_fields__ else []
    cfg = parse_args(["--hidden-size", "16", "--num-layers", "2", *norm], task.Settings)
    plain, checkpointed = task.build_model(cfg), task.build_model(cfg)
    checkpointed.load_state_dict(plain.state_dict())
    blocks = model_blocks(checkpointed, task)
    if compiled and torch.__version__ < "2.9":  # counts each batch twice there: one line
        with pytest.raises(UsageError, match="with --compile and BatchNorm needs"):
            checkpoint_blocks(blocks, compiled=compiled)
        return
    checkpoint_blocks(blocks, compiled=compiled)
    checkpointed._apply(lambda t: t.clone())  # as .to(a GPU) does to every tensor
    torch._dynamo.reset()
    for block in blocks if compiled else []:
        block.compile(backend="aot_eager")  # dynamo's graphs, no code generation
    for model in (plain, checkpointed):
        task.loss_fn(model, first_batch(4)).backward()
    if compiled:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "nothing compiled"
    same = torch.testing.assert_close if compiled else assert_same_model
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        same({name: p.grad}, {name: q.grad})
    same(plain.state_dict(), checkpointed.state_dict())  # the same names, too
    flagged = parse_args(["--activation-checkpointing"], task.Settings)
    with pytest.raises(UsageError, match="checkpoints Linear block by block: define blocks"):
        usable_blocks(torch.nn.Linear(2, 2), object(), flagged)  # a task without blocks(model)


UNSPLITTABLE = """
import sys
import torch
import {{ cookiecutter.package_name }}.task as task
from {{ cookiecutter.package_name }}.main import main

original = task.build_model

class OneLayer(torch.nn.Module):  # no blocks(), not an nn.Sequential
    def __init__(self):
        super().__init__()
        self.inner = original(task_cfg)

    def forward(self, x):
        return self.inner(x)

task_cfg = None
def build_model(cfg):
    global task_cfg
    task_cfg = cfg
    return OneLayer()

task.build_model = build_model
del task.blocks
sys.exit(main(sys.argv[1:]))
"""


def test_a_model_model_parallel_2_cannot_split_is_one_error_line(workdir):
    script = workdir / "unsplittable.py"
    script.write_text(UNSPLITTABLE)
    result = run_cmd([*torchrun_cmd(2), str(script), "--no-progress", *QUICK,
                      "--model-layout", "model_parallel_2"], workdir)
    line = one_error(result)
    assert "model_parallel_2 needs to know where to split OneLayer: define blocks(model)" in line


def test_bf16_autocast_learns_and_sync_bn_is_skipped_with_a_warning_on_cpu(workdir):
    """bf16 autocast learns, in the project's layout; --sync-bn (data_parallel's) warns once and
    keeps the BatchNorm's running statistics. One run for both where the project's layout is
    data_parallel (they touch different things), else one each."""
    norm = "batch_norm" in task.Settings.__dataclass_fields__
    sync_bn = ["--batch-norm", "--sync-bn", "--model-layout", "data_parallel"] if norm else []
    together = DEFAULT_MODEL_LAYOUT == "data_parallel"
    result = ok(torchrun([*QUICK, "--epochs", "2", "--precision", "bf16",
                          *(sync_bn if together else [])], workdir))
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert losses[-1] < losses[0]
    if not norm:
        pytest.skip("task.py has no --batch-norm setting (bf16 checked)")
    if not together:
        result = ok(torchrun([*QUICK, "--epochs", "2", *sync_bn, "--resume", "never"], workdir))
    assert result.stderr.count("warning: --sync-bn needs CUDA") == 1
    state = torch.load(workdir / "checkpoints/ckpt_step00000016.pt", weights_only=True)
    assert any(key.endswith("running_mean") for key in state["model"])


def test_fp16_on_cpu_is_one_error_line(workdir):
    # One process: the line is the point (test_mistakes shows 2 ranks print a mistake once).
    line = one_error(python_train([*QUICK, "--precision", "fp16"], workdir))
    assert line == ("error: --precision fp16 needs CUDA (it relies on a GradScaler); use "
                    "--precision bf16 on CPU")


MEMORY = """
import torch, torch.distributed as dist
import {{ cookiecutter.package_name }}.task as task
from {{ cookiecutter.package_name }}.config import DEFAULT_MODEL_LAYOUT, parse_args
from {{ cookiecutter.package_name }}.data import BatchFetcher
from {{ cookiecutter.package_name }}.parallel import parallelize
from {{ cookiecutter.package_name }}.runtime.workarounds import exit_process

def local(t):
    return t.to_local() if hasattr(t, "to_local") else t

def state_bytes(layout):
    # This rank's parameters, gradients and AdamW state (local shards) after a step, in bytes.
    cfg = parse_args(["--hidden-size", "64", "--model-layout", layout], task.Settings)
    torch.manual_seed(0)
    model = parallelize(task.build_model(cfg), cfg, [torch.device("cpu")], task, True)
    optimizer = torch.optim.AdamW(model.parameters())
    task.loss_fn(model, batch).backward()
    optimizer.step()
    total = sum(local(p).numel() * p.element_size() for p in model.parameters())
    total += sum(local(p.grad).numel() * p.element_size() for p in model.parameters())
    return total + sum(local(v).numel() * v.element_size() for s in optimizer.state.values()
                       for v in s.values() if torch.is_tensor(v) and v.dim() > 0)

dist.init_process_group("gloo")
train_set, _ = task.build_datasets(parse_args(["--dataset-size", "16", "--val-fraction", "0"],
                                              task.Settings))
batch = BatchFetcher(train_set, getattr(task, "collate", None)).__getitems__((0, torch.arange(8)))
# Both layouts in the same two processes: one launch instead of two.
for layout in ("data_parallel", "fsdp"):
    total = state_bytes(layout)
    if dist.get_rank() == 0:
        print(layout, "bytes", total, flush=True)
dist.destroy_process_group()
exit_process(0)  # not the interpreter's own exit, which can abort (see workarounds.py)
"""


@needs_numpy
def test_fsdp_keeps_about_half_the_state_per_rank_at_two_ranks(workdir):
    script = workdir / "memory.py"
    script.write_text(MEMORY)
    out = ok(run_cmd([*torchrun_cmd(2), str(script)], workdir)).stdout
    sizes = {layout: int(out.split(f"{layout} bytes")[1].split()[0])
             for layout in ("data_parallel", "fsdp")}
    ratio = sizes["fsdp"] / sizes["data_parallel"]
    print(f"parameters + gradients + AdamW state per rank: DDP {sizes['data_parallel']} B, "
          f"FSDP {sizes['fsdp']} B, ratio {ratio:.3f}")
    assert 0.45 < ratio < 0.6


# 24 steps, a checkpoint every 2 (the async-save test's cadence), --keep-last 3: 20, 22, 24.
FSDP = [*QUICK, "--model-layout", "fsdp", "--save-every-steps", "2", "--epochs", "3",
        "--log-every", "1000"]
KILLABLE = sys.platform.startswith("linux")  # finds the workers through /proc


# The fsdp tests' two runs, each made once for both xdist workers.
@pytest.fixture(scope="module")
def fsdp_a(tmp_path_factory) -> Path:
    """The folder of a: an fsdp run never interrupted."""
    skip_unless_example_task()
    a = [*FSDP, "--checkpoint-dir", "a", "--output-dir", "runs/a"]
    return made_once(tmp_path_factory, "fsdp-a", lambda folder: ok(torchrun(a, folder)))


@pytest.fixture(scope="module")
def fsdp_b(tmp_path_factory) -> Path:
    """The folder of b: the same run with --activation-checkpointing whose worker is SIGKILLed
    mid-run, mid-epoch (step 10 or later) and restarted by torchrun (where /proc is missing:
    stopped at step 6 and resumed); the last torchrun's exit code and output in b.json."""
    skip_unless_example_task()
    return made_once(tmp_path_factory, "fsdp-b", killed_and_restarted)


def killed_and_restarted(folder: Path) -> None:
    b = [*FSDP, "--checkpoint-dir", "b", "--output-dir", "runs/b", "--activation-checkpointing"]
    if not KILLABLE:
        ok(torchrun([*b, "--max-steps", "6"], folder))
        result = ok(torchrun(b, folder))
    else:
        job = subprocess.Popen([*torchrun_cmd(2, "--max-restarts=1"), TRAIN, "--no-progress", *b],
                               cwd=folder, env=child_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        while not list((folder / "b").glob("ckpt_step0000001*")):
            assert job.poll() is None, job.communicate()[1]
            time.sleep(0.01)
        agent = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()
        os.kill(int(agent[1]), signal.SIGKILL)
        out, err = job.communicate(timeout=240)
        result = subprocess.CompletedProcess(job.args, job.returncode, out, err)
    (folder / "b.json").write_text(json.dumps([result.returncode, result.stdout, result.stderr]))


@needs_numpy
def test_fsdp_trains_saves_sharded_and_resumes_on_one_and_two_ranks(fsdp_a, fsdp_b, tmp_path):
    folder = fsdp_a
    done = summary(folder / "runs/a")
    assert done["model_layout"] == "fsdp" and done["steps"] == 24
    newest = folder / "a/ckpt_step00000024"
    assert newest.is_dir() and (newest / ".metadata").is_file() and (newest / "meta.json").is_file()
    assert len(list(newest.glob("*.distcp"))) == 2, "each rank wrote its own shards"

    # b checkpoints activations, and resumes: the uninterrupted run's weights, bit for bit.
    assert_same_model(final_model(folder / "a"), final_model(fsdp_b / "b"))

    # On one process the shards are re-cut, and training goes on (in a copy: a stays as it is).
    shutil.copytree(newest, tmp_path / "c" / newest.name)
    ok(python_train([*FSDP, "--epochs", "4", "--checkpoint-dir", "c"], tmp_path))
    assert summary(tmp_path / "runs/latest")["resumed_from"].endswith("ckpt_step00000024")

    # A shard cut short (a copy that stopped half-way): one line that names the checkpoint.
    newest = max((tmp_path / "c").glob("ckpt_step*"))
    shard = max(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    line = one_error(python_train([*FSDP, "--epochs", "5", "--checkpoint-dir", "c", "--resume",
                                   str(newest)], tmp_path))
    assert f"cannot load checkpoint {newest}" in line and "--resume never" in line, line


@needs_numpy
@pytest.mark.skipif(not KILLABLE, reason="finds the workers through /proc")
def test_fsdp_worker_killed_mid_run_restarts_and_ends_bit_for_bit(fsdp_a, fsdp_b):
    returncode, stdout, stderr = json.loads((fsdp_b / "b.json").read_text())
    assert returncode == 0 and "resumed from" in stdout, stderr
    assert_same_model(final_model(fsdp_a / "a"), final_model(fsdp_b / "b"))


@needs_numpy
def test_fsdp_checkpoint_exports_to_the_plain_model(fsdp_a, tmp_path):
    folder = fsdp_a
    out = tmp_path / "model.pt"
    ok(run_cmd([sys.executable, "-m", "{{ cookiecutter.package_name }}.checkpoint",
                "export", str(folder / "a/ckpt_step00000024"), str(out)], PROJECT_ROOT))
    exported = torch.load(out, map_location="cpu", weights_only=True)
    model = task.build_model(parse_args(QUICK, task.Settings))
    model.load_state_dict(exported["model"])  # every key, every shape
    assert exported["step"] == 24 and exported["world_size"] == 2


@pytest.mark.parametrize("layout", ["data_parallel",
                                    pytest.param("fsdp", marks=needs_numpy)])
def test_a_background_save_that_fails_on_a_local_disk_is_one_line(workdir, layout):
    """The checkpoint folder turns into a file once the first save is there: a background save
    fails, and the run stops with one line naming the newest complete one, no thread traceback."""
    flags = [*QUICK, "--epochs", "1000", "--save-every-steps", "4", "--model-layout", layout,
             "--async-save", "--no-progress"]
    job = subprocess.Popen([*torchrun_cmd(2), TRAIN, *flags], cwd=workdir, env=child_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    folder = workdir / "checkpoints"
    first = checkpoint_path(folder, 4, sharded=layout == "fsdp")
    deadline = time.monotonic() + 120
    while not (first.is_file() or (first / ".metadata").is_file()):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)
    folder.rename(workdir / "moved")
    folder.write_text("not a folder any more")
    out, err = job.communicate(timeout=120)
    result = subprocess.CompletedProcess(job.args, job.returncode, out, err)
    line = one_error(result)
    assert "Exception in thread" not in err, err
    newest = Path(line.split("the newest complete checkpoint is ")[1].split(";")[0].strip())
    assert newest.parent.name == "checkpoints", line  # the run went on meanwhile: 4 or later
    assert (workdir / "moved" / newest.name).exists(), line


@pytest.mark.parametrize("layout", ["data_parallel",
                                    pytest.param("fsdp", marks=needs_numpy)])
def test_async_save_trains_on_while_writing_and_reports_the_stall(workdir, layout, request):
    flags = [*FSDP, "--model-layout", layout]  # fsdp: the fsdp tests' run a, with --async-save
    ok(torchrun([*flags, "--async-save"], workdir))
    done = summary(workdir / "runs/latest")
    assert done["async_save"] and done["checkpoint_saves"] == 12
    assert done["checkpoint_stall_ms"] > 0
    kept = sorted((workdir / "checkpoints").glob("ckpt_step*"))
    assert [p.name for p in kept] == [checkpoint_path("", s, sharded=layout == "fsdp").name
                                      for s in (20, 22, 24)]  # --keep-last 3
    # Each background save wrote the state of its own step (the staging copy is reused): the
    # same as the synchronous run's checkpoints (fsdp's is run a of the fsdp tests).
    if layout == "fsdp":
        sync = request.getfixturevalue("fsdp_a") / "a"
    else:
        sync = workdir / "sync"
        ok(torchrun([*flags, "--checkpoint-dir", "sync", "--output-dir", "sync-runs"], workdir))
    for path in kept:
        assert_same_model(load_state(sync / path.name)["model"], load_state(path)["model"])
