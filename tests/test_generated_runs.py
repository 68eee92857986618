"""Baked projects run for real, the way users install and run them: in a fresh virtual environment
(no system packages) with torch pinned, a minimal install with no extras, the README's commands as
written, each tracker working through its own dependency, and the projects' own test suites.

The tests of this file share one venv and run in order: minimal install first, then the
development extras and the full suite, then one project per tracker installed over it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import PYTHON, ROOT, answers_id, check_ok, run
from cookiecutter.main import cookiecutter
from slurm import why_not_two_nodes as why_no_slurm

# The minimal-install runs keep their files apart from the README quickstart's.
SMALL = ("--no-progress --dataset-size 256 --hidden-size 16 --output-dir minimal/runs "
         "--checkpoint-dir minimal/ck")


def bake_to(folder: Path, **answers) -> Path:
    return Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(folder),
                             extra_context=answers))


def one_error(result) -> str:
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert result.returncode != 0 and len(errors) == 1, f"{errors}\n{result.stderr[-3000:]}"
    return errors[0]


@pytest.fixture(scope="module")
def default_project(tmp_path_factory, torch_venv):
    """The default bake, installed into the fresh venv with `pip install -e .` and no extras."""
    project = bake_to(tmp_path_factory.mktemp("default"))
    torch_venv.pip("-e", str(project), cwd=project)
    return project


def test_minimal_install_is_only_the_declared_dependencies(default_project, torch_venv):
    listed = check_ok(torch_venv.run([torch_venv.python, "-m", "pip", "list", "--format",
                                      "freeze"], default_project)).stdout
    names = {line.split("==")[0].lower() for line in listed.split() if "==" in line}
    assert {"torch", "tqdm", "pillow", "ddp-project"} <= names  # pillow: the image folders
    assert not names & {"numpy", "tensorboard", "wandb", "mlflow-skinny", "matplotlib"}, names
    assert not torch_venv.has("numpy", default_project)


def test_minimal_install_trains_saves_and_resumes_with_torchrun(default_project, torch_venv):
    train = f"torchrun --standalone --nproc-per-node=2 train.py {SMALL}"
    check_ok(torch_venv.run(f"{train} --epochs 1", default_project))
    resumed = check_ok(torch_venv.run(f"{train} --epochs 2", default_project))
    assert "resumed from minimal/ck/ckpt_step00000004.pt" in resumed.stdout
    assert len(list((default_project / "minimal/ck").glob("ckpt_step*.pt"))) == 2


def test_minimal_install_spawns_and_the_doctor_passes(default_project, torch_venv):
    check_ok(torch_venv.run(f"python train.py --nprocs 2 {SMALL} --epochs 1 --resume never",
                            default_project))
    doctor = check_ok(torch_venv.run("python -m ddp_project.doctor", default_project))
    assert "OK: all_reduce and barrier across 1 process(es)" in doctor.stdout


@pytest.mark.parametrize("tracker, package", [("tensorboard", "tensorboard"), ("wandb", "wandb"),
                                              ("mlflow", "mlflow-skinny")])
def test_minimal_install_names_the_package_a_tracker_needs(default_project, torch_venv, tracker,
                                                           package):
    # Said once by 2 processes under torchrun (tensorboard), the others by one process: the same
    # check, a torchrun fewer each.
    launch = "torchrun --standalone --nproc-per-node=2" if tracker == "tensorboard" else "python"
    line = one_error(torch_venv.run(f"{launch} train.py {SMALL} --tracker {tracker} "
                                    "--resume never", default_project))
    assert f"--tracker {tracker} needs the {package} package: pip install {package}" in line


def test_minimal_install_names_numpy_for_fsdp(default_project, torch_venv):
    line = one_error(torch_venv.run(f"python train.py {SMALL} --model-layout fsdp --resume never",
                                    default_project))
    assert "--model-layout fsdp needs numpy for its checkpoints (torch.distributed.checkpoint): " \
           "pip install numpy" in line


def test_minimal_install_names_s3fs_for_a_bucket(default_project, torch_venv):
    line = one_error(torch_venv.run(f"python train.py {SMALL} --checkpoint-dir s3://bkt/run",
                                    default_project))
    assert "--checkpoint-dir s3://bkt/run: s3:// needs s3fs: pip install s3fs (the project's " \
           'extra: pip install -e ".[s3]")' in line


def quickstart(readme: str) -> list[str]:
    block = readme.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#")[0].strip() for line in block.strip().splitlines()]


@pytest.fixture(scope="module")
def quickstart_done(default_project, torch_venv):
    """The README's quickstart, as written (its `pytest -q` line: the full suite, below)."""
    lines = quickstart((default_project / "README.md").read_text())
    assert lines[0] == 'pip install -e ".[dev]"' and lines[-1] == "pytest -q"
    for line in lines[:-1]:
        check_ok(torch_venv.run(line, default_project, timeout=600))
    return lines


def test_readme_quickstart_trains_as_written(default_project, torch_venv, quickstart_done):
    assert quickstart_done[1] == "scripts/train_local.sh --epochs 3"  # 2 CPU processes here
    check_ok(torch_venv.run([torch_venv.python, "-c", "import ddp_project.loop"],
                            default_project.parent))  # installed, not only importable from cwd
    summary = (default_project / "runs/latest/summary.json").read_text()
    assert '"epochs_completed": 3' in summary and '"world_size": 2' in summary


# Skips a CPU machine may show, and why: no GPU for the NCCL tests, no tracker chosen.
ALLOWED_SKIPS = ("needs CUDA GPUs and a PyTorch build with NCCL", "needs a CUDA GPU",
                 "this project has no tracker", "this machine has GPUs", "fsdp does not use DDP",
                 "fsdp has no DDP comm hooks")


def test_the_readme_pytest_runs_the_default_tier(default_project, torch_venv, quickstart_done):
    """`pytest -q` (the quickstart's last line) selects the fast tier: every module's unit tests,
    the task's tests and one real kill-and-resume, of whatever task.py holds; `--full` adds the
    rest."""
    def collected(*extra: str) -> list[str]:
        result = check_ok(torch_venv.run([torch_venv.python, "-m", "pytest", "--collect-only",
                                          "-q", "-p", "no:cacheprovider", *extra],
                                         default_project))
        return [line for line in result.stdout.splitlines() if "::" in line]

    default, full = collected(), collected("--full")
    assert set(default) < set(full)
    files = {line.split("::")[0] for line in default}
    assert {"tests/test_task.py", "tests/test_config.py", "tests/test_checkpoint.py",
            "tests/test_data.py", "tests/test_distributed.py"} <= files, files
    assert [line for line in default if "test_recovery.py" in line] == [
        "tests/test_recovery.py::test_your_task_resumes_bit_for_bit_after_a_sigkill"]
    assert not files & {"tests/test_network.py", "tests/test_backstop.py",
                        "tests/test_launchers.py", "tests/test_mistakes.py"}


# Generated tests whose runs this suite makes for real elsewhere, left to those: the SLURM tests
# that train fake the cluster (srun and scontrol stubs) for machines without one, and
# test_slurm_cluster.py runs the same scripts on a real SLURM where it can; a missing tracker
# package is test_minimal_install_names_the_package_a_tracker_needs, in this venv.
FAKE_SLURM_RUNS = ["test_torchrun_pattern_two_nodes", "test_srun_pattern_one_task_per_device",
                   "test_time_limit_signal_requeues_and_the_requeued_job_resumes"]


def run_elsewhere() -> list[str]:
    tests = ["tests/test_tracker.py::test_a_tracker_whose_package_is_missing_is_one_error_line"]
    if why_no_slurm() is None:
        tests += [f"tests/test_slurm.py::{test}" for test in FAKE_SLURM_RUNS]
    return [arg for test in tests for arg in ("--deselect", test)]


def test_the_projects_whole_suite_passes_in_the_venv(default_project, torch_venv,
                                                     quickstart_done):
    # worksteal: a worker that runs out of tests takes some of the other's (its slow tail).
    result = torch_venv.run([torch_venv.python, "-m", "pytest", "-q", "--full", "-n", "2",
                             "--dist", "worksteal", "-p", "no:cacheprovider", "-rfEs",
                             *run_elsewhere()], default_project,
                            timeout=3600)
    check_ok(result)
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary and "error" not in summary
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all(any(reason in line for reason in ALLOWED_SKIPS) for line in skips), skips


WORKED_EXAMPLE_IMAGES = """
import random, sys
from pathlib import Path
from PIL import Image
random.seed(0)
for label, colour in enumerate([(210, 60, 40), (40, 80, 200), (60, 190, 60)]):
    folder = Path(sys.argv[1]) / f"class{label}"
    folder.mkdir(parents=True)
    for i in range(16):
        pixel = tuple(max(0, min(255, c + random.randint(-40, 40))) for c in colour)
        Image.new("RGB", (40 + i, 30), pixel).save(folder / f"{i}.{'png' if i % 2 else 'jpg'}")
"""


def test_readme_worked_example_as_written(tmp_path, torch_venv, quickstart_done):
    """The docs' own classifier on an image folder: its task.py and its commands, verbatim."""
    project = bake_to(tmp_path)
    section = (project / "docs/worked-example.md").read_text()
    code = section.split("```python", 1)[1].split("```", 1)[0]
    commands = section.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    (project / "ddp_project/task.py").write_text(code)
    torch_venv.pip("-e", str(project), cwd=project)
    *setup, train = commands  # setup: `pip install pillow`, where Pillow is not a dependency
    for command in setup:
        check_ok(torch_venv.run(command, project))
    check_ok(torch_venv.run([torch_venv.python, "-c", WORKED_EXAMPLE_IMAGES, "data/train"],
                            project))
    check_ok(torch_venv.run(train, project))
    summary = (project / "runs/latest/summary.json").read_text()
    assert '"epochs_completed": 10' in summary and '"val_accuracy"' in summary


# The smallest task.py within the contract: no settings, no blocks(), no validation set, and no
# data without --data. Its own test (what a user writes in tests/test_task.py) trains it.
MINIMAL_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

from .failures import UsageError


def build_datasets(cfg):
    if cfg.data is None:
        raise UsageError("this task reads a CSV file of x1,x2,x3,x4,y rows: pass --data FILE")
    rows = [[float(v) for v in line.split(",")] for line in open(cfg.data) if line.strip()]
    table = torch.tensor(rows)
    return TensorDataset(table[:, :4], table[:, 4:]), None


def build_model(cfg):
    return nn.Linear(4, 1)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def eval_metrics(model, batch):
    x, y = batch
    return {"mse": nn.functional.mse_loss(model(x), y, reduction="sum"),
            "count": torch.tensor(len(y))}
"""

MINIMAL_TASK_TEST = """
from conftest import ok, summary, torchrun


def test_the_task_trains_on_a_csv_file(tmp_path):
    rows = [f"{i % 7},{i % 5},{i % 3},{i % 2},{i % 7 + 2 * (i % 2)}" for i in range(96)]
    (tmp_path / "rows.csv").write_text("\\n".join(rows))
    ok(torchrun(["--data", "rows.csv", "--epochs", "2", "--batch-size", "8"], tmp_path))
    assert summary(tmp_path / "runs/latest")["epochs_completed"] == 2
"""


def test_the_generated_suite_holds_for_a_minimal_task(tmp_path, torch_venv, quickstart_done):
    """A user's task without the example's settings, data or blocks(): the suite a user runs
    after editing task.py (`pytest -q`) passes, the tests that train the example skip and say
    why, the user's own task test runs, and so does the kill and resume, of this task with the
    flags its TEST_FLAGS names. (The `--full` tier's tests of the example task skip
    the same way: its machinery is the default project's, run in full above.)"""
    project = bake_to(tmp_path)
    sample = tmp_path / "sample.csv"  # what its TEST_FLAGS name for the default tier's kill test
    sample.write_text("\n".join(f"{i % 7},{i % 5},{i % 3},{i % 2},{i % 7 + 2 * (i % 2)}"
                                for i in range(96)))
    test_flags = f"\nTEST_FLAGS = ['--data', {str(sample)!r}, '--batch-size', '8']\n"
    (project / "ddp_project/task.py").write_text(MINIMAL_TASK + test_flags)
    (project / "tests/test_task.py").write_text(MINIMAL_TASK_TEST)
    torch_venv.pip("-e", str(project), cwd=project)
    result = torch_venv.run([torch_venv.python, "-m", "pytest", "-q", "-p",
                             "no:cacheprovider", "-rsp"], project, timeout=1200)
    check_ok(result)
    assert "PASSED tests/test_task.py::test_the_task_trains_on_a_csv_file" in result.stdout
    # The default tier's real kill and resume trained this task, with its TEST_FLAGS.
    assert ("PASSED tests/test_recovery.py::test_your_task_resumes_bit_for_bit_after_a_sigkill"
            in result.stdout), result.stdout[-3000:]
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    because = ("uses the example task; task.py declares no --dataset-size or --hidden-size",
               "at task.blocks(model), which task.py does not define")
    assert any(because[0] in line for line in skips), skips
    assert all(any(reason in line for reason in (*because, *ALLOWED_SKIPS)) for line in skips), skips


TRACKERS = [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")]


@pytest.mark.parametrize("tracker, module", TRACKERS, ids=[t for t, _ in TRACKERS])
def test_each_tracker_works_through_its_own_dependency(tmp_path, torch_venv, quickstart_done,
                                                       tracker, module):
    project = bake_to(tmp_path, tracker=tracker)
    torch_venv.pip("-e", str(project), cwd=project)  # no extras: the tracker is a dependency
    assert torch_venv.has(module, project)
    test = "tests/test_tracker.py::test_the_tracker_logs_every_metric_and_a_resumed_run_continues_its_run"
    result = torch_venv.run([torch_venv.python, "-m", "pytest", "-q", "--full", "-p",
                             "no:cacheprovider", test], project, timeout=600)
    check_ok(result)
    assert "1 passed" in result.stdout.splitlines()[-1]


# Other answers, in the template's own Python: each other example task, baked with other answers,
# runs its own tests, its docs' commands, the end-to-end tests (whose outcome depends on the
# answers) and its default layout's end-to-end test with that task (the default project's suite
# runs every layout).
LAYOUT_TESTS = {"fsdp": "split_model or fsdp_trains",
                "model_parallel_2": "split_model or model_parallel_layout"}
SUITES = [
    {"task": "regression", "model_layout": "fsdp", "launcher": "spawn", "init_method": "file",
     "slurm": False, "github_actions": False},
    {"task": "language_model", "model_layout": "model_parallel_2", "launcher": "launch",
     "backend": "gloo", "init_method": "tcp", "windows_support": True},
]


def bash_blocks(page: Path) -> list[str]:
    return [block.split("```", 1)[0] for block in page.read_text().split("```bash")[1:]]


@pytest.mark.parametrize("answers", SUITES, ids=answers_id)
def test_other_tasks_and_answers_pass_their_tests(tmp_path, answers, baked_once):
    project = bake_to(tmp_path, **answers)
    pytest_ = [PYTHON, "-m", "pytest", "-q", "--full", "-p", "no:cacheprovider"]
    # test_train's resume tests are left to the default project's suite: resuming with these
    # layouts is checked by the layout tests. One run on 2 workers (133 s -> 89 s here).
    layout = f"test_layouts and ({LAYOUT_TESTS[answers['model_layout']]})"
    # docs/recovery.md's commands are the default bake's words, which the default project's suite
    # runs; the chosen launcher's fine-tuning is test_train's here (28 CPU-s a bake).
    page = "docs/recovery.md"
    assert bash_blocks(project / page) == bash_blocks(baked_once() / page)
    same = f"tests/test_doc_commands.py::test_the_commands_of_a_page_run_as_written[{page}]"
    check_ok(run([*pytest_, "-n", "2", "--dist", "worksteal", "tests/test_task.py",
                  "tests/test_train.py", "tests/test_config.py", "tests/test_doc_commands.py",
                  "tests/test_layouts.py", "-k", f"not test_layouts and not resume or {layout}",
                  "--deselect", same], project, timeout=900))


def test_the_tensor_parallel_bake_passes_its_tests(tmp_path):
    """model_layout=tensor_parallel (its module and tests only in this bake): 2 x 2 on 4 gloo
    processes against one process, a SIGKILLed worker, a resume under fsdp, a frozen peer, a host
    cut off (2 test hosts x 2), the plan's and the run's refusals; its docs' tables and its flags
    as its config declares them. Every test of its file runs: none may skip unseen."""
    project = bake_to(tmp_path, task="language_model", model_layout="tensor_parallel")
    result = check_ok(run([PYTHON, "-m", "pytest", "-q", "-rs", "--full", "-p", "no:cacheprovider",
                           "tests/test_tensor_parallel.py", "tests/test_docs.py",
                           "tests/test_config.py"], project, timeout=600))
    skipped = [line for line in result.stdout.splitlines()
               if line.startswith("SKIPPED") and "test_tensor_parallel.py" in line]
    assert skipped == [], skipped
    collected = check_ok(run([PYTHON, "-m", "pytest", "-q", "--co", "--full", "-p",
                              "no:cacheprovider", "tests/test_tensor_parallel.py"], project))
    tests = int(re.search(r"(\d+) tests? collected", collected.stdout).group(1))
    passed = int(re.search(r"(\d+) passed", result.stdout).group(1))
    assert tests >= 20 and passed >= tests, (tests, passed, result.stdout[-2000:])


def test_the_hf_causal_lm_bake_passes_its_tests(tmp_path):
    """task=hf_causal_lm, offline (HF_HUB_OFFLINE=1): a tiny Llama and a BPE tokenizer made into
    a folder, fine-tuned by 2 processes (the loss falls), a worker SIGKILLed and the run resumed
    bit for bit, the export a folder transformers loads with the checkpoint's logits, fsdp, the
    plan from the model's own description, a missing folder one line; its docs and flags. None
    of its task tests may skip unseen."""
    project = bake_to(tmp_path, task="hf_causal_lm")
    result = check_ok(run([PYTHON, "-m", "pytest", "-q", "-rs", "--full", "-p", "no:cacheprovider",
                           "-n", "2", "--dist", "worksteal", "tests/test_task.py",
                           "tests/test_docs.py", "tests/test_config.py"],
                          project, timeout=600, HF_HUB_OFFLINE="1"))
    # Its tensor-parallel run needs the layout's module: the next test's bake has it.
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")
               and "test_task.py" in line and "no tensor_parallel layout" not in line]
    assert skipped == [], skipped


def test_the_hf_causal_lm_tensor_parallel_bake_passes_its_tests(tmp_path):
    """task=hf_causal_lm x model_layout=tensor_parallel: its task tests train under its default
    layout, tensor_parallel (1 x 2; LoRA's under data_parallel, which they name), and the tiny
    Llama split 2 x 2 by the plan in its config, on 4 gloo processes, a worker SIGKILLed and the
    group resumed, learns as one process does. (fsdp's and --compile's runs are the same as in
    the bake above.) The layout's own tests (tests/test_tensor_parallel.py) that train use the
    example task of the language_model bake; here they skip and say so."""
    project = bake_to(tmp_path, task="hf_causal_lm", model_layout="tensor_parallel")
    result = check_ok(run([PYTHON, "-m", "pytest", "-q", "-rs", "--full", "-p", "no:cacheprovider",
                           "-n", "2", "--dist", "worksteal", "-m", "not fsdp and not compile",
                           "tests/test_task.py", "tests/test_tensor_parallel.py"],
                          project, timeout=600, HF_HUB_OFFLINE="1"))
    # None of its task tests skipped; the layout's tests of the example task skip and say so,
    # its checks of plans on a model of their own pass.
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all("test_tensor_parallel.py" in line and "uses the example task" in line
                           for line in skipped), skipped
    ran = int(re.search(r"(\d+) passed", result.stdout).group(1))
    assert ran >= 17 + 12, result.stdout[-2000:]  # the task's tests, the plans'
