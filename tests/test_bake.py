"""Every answer bakes: exact file set, nothing left unrendered, code that compiles, lints and
parses, and defaults that match the answers."""

from __future__ import annotations

import shutil
import tomllib

import pytest
from conftest import (
    CHOICES,
    PYTHON,
    answers_id,
    check_ok,
    expected_files,
    pairwise_combinations,
    project_files,
    run,
)

COMBINATIONS = pairwise_combinations()


def test_pairwise_covers_every_choice_of_every_answer():
    for name, values in CHOICES.items():
        assert {c[name] for c in COMBINATIONS} == set(values), name
    assert "task" in CHOICES and len(CHOICES["tracker"]) == 4 and "fsdp" in CHOICES["model_layout"]
    assert len(COMBINATIONS) < 30


@pytest.mark.parametrize("answers", COMBINATIONS, ids=answers_id)
def test_bake_gives_exactly_the_files_of_the_answers(bake, answers):
    project = bake(**answers)
    assert project.name == "ddp-project"
    assert project_files(project) == expected_files("ddp_project", answers)
    # No empty folders left behind by the post-generation clean-up.
    assert all(any(d.iterdir()) for d in project.rglob("*") if d.is_dir())


@pytest.mark.parametrize("answers", COMBINATIONS, ids=answers_id)
def test_baked_code_renders_compiles_and_lints(bake, answers):
    project = bake(**answers)
    for rel in project_files(project):
        text = (project / rel).read_text(encoding="utf-8")
        for marker in ("{{", "{%", "cookiecutter"):
            if rel != ".github/workflows/ci.yml" or marker == "{%":  # GitHub's own ${{ }}
                assert marker not in text, f"{rel} contains {marker!r}"
        if rel.endswith(".py"):
            compile(text, rel, "exec")
        if rel.endswith((".sh", ".sbatch")):
            check_ok(run(["bash", "-n", rel], project))
            assert (project / rel).stat().st_mode & 0o111, f"{rel} is not executable"
    check_ok(run([shutil.which("ruff") or "ruff", "check", "--no-cache", "."], project))


@pytest.mark.parametrize("answers", COMBINATIONS, ids=answers_id)
def test_the_answers_are_the_projects_defaults(bake, answers):
    project = bake(**answers)
    readme = (project / "README.md").read_text()
    local = (project / "scripts/train_local.sh").read_text()
    lead = {"torchrun": "torchrun --standalone", "spawn": "python train.py --nprocs",
            "launch": "-m torch.distributed.launch"}[answers["launcher"]]
    assert lead in readme.split("## Your model")[0] and lead.split()[-1] in local
    config = (project / "ddp_project/config.py").read_text()
    for name in ("backend", "init_method", "model_layout", "tracker"):
        assert f'DEFAULT_{name.upper()} = "{answers[name]}"' in config
    task = (project / "ddp_project/task.py").read_text()
    assert {"classification": "class SmallCNN", "regression": "class MLP",
            "language_model": "class TinyGPT"}[answers["task"]] in task
    dependencies = " ".join(tomllib.loads((project / "pyproject.toml").read_text())["project"]
                            ["dependencies"])
    for tracker, package in (("tensorboard", "tensorboard"), ("wandb", "wandb"),
                             ("mlflow", "mlflow-skinny")):
        assert (package in dependencies) == (answers["tracker"] == tracker), tracker
    assert ("numpy" in dependencies) == (answers["model_layout"] == "fsdp")
    extras = tomllib.loads((project / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    if answers["fault_tolerance"] == "torchft":
        assert extras["ft"] == ["torchft>=0.2.0,<0.3"]
    else:  # `none` bakes no trace of torchft: no extra, no file, no word of it
        assert "ft" not in extras
        mentions = [rel for rel in project_files(project)
                    if "torchft" in (project / rel).read_text(encoding="utf-8").lower()]
        assert not mentions, mentions
    # requirements.txt (what the Dockerfile installs before the project itself) lists the same.
    requirements = [line.strip() for line in (project / "requirements.txt").read_text().splitlines()
                    if line.strip() and not line.startswith("#")]
    assert requirements == tomllib.loads((project / "pyproject.toml").read_text())["project"][
        "dependencies"]


def test_names_are_derived_and_free_text_is_quoted_safely(bake):
    project = bake(project_name="Vision Net 2", description='Says "hi" and \\ it\'s fine',
                   author_name="O'Brien \"Bob\"")
    assert project.name == "vision-net-2"
    assert expected_files("vision_net_2", {}) == project_files(project)
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["description"] == 'Says "hi" and \\ it\'s fine'
    assert meta["authors"] == [{"name": "O'Brien \"Bob\""}]
    check_ok(run([PYTHON, "-c", "import vision_net_2.main"], project))


def test_help_runs_in_a_baked_project(bake):
    project = bake()
    result = check_ok(run([PYTHON, "train.py", "--help"], project))
    assert "--stage-devices" in result.stdout and "--local_rank" in result.stdout
    assert "--async-save" in result.stdout and "--config" in result.stdout
