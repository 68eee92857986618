"""Bad answers are refused before anything is written, with one ERROR line that says what works,
and nothing is left behind when cookiecutter returns."""

from __future__ import annotations

import pytest
from conftest import PYTHON, ROOT, run

BAD = [
    ({"package_name": "class"}, "package_name", "keyword"),
    ({"package_name": "match"}, "package_name", "keyword"),
    ({"package_name": "1model"}, "package_name", "identifier"),
    ({"package_name": "my-model"}, "package_name", "identifier"),
    ({"package_name": "json"}, "package_name", "shadow"),
    ({"package_name": "torch"}, "package_name", "shadow"),
    ({"package_name": "wandb"}, "package_name", "shadow"),
    ({"package_name": "train"}, "package_name", "shadow"),
    ({"project_slug": "a/b", "package_name": "ab"}, "project_slug", "path separator"),
    ({"project_slug": "a/b/c", "package_name": "deep"}, "project_slug", "path separator"),
    ({"project_slug": "../escape", "package_name": "escape"}, "project_slug", "path separator"),
    ({"project_slug": "My Project", "package_name": "my_project"}, "project_slug", "lower-case"),
    ({"project_name": "It's \"quoted\"", "package_name": "ok_name"}, "project_slug", "lower-case"),
    ({"windows_support": "yes", "backend": "nccl"}, "backend", "Windows"),
    ({"fault_tolerance": "torchft", "model_layout": "fsdp"}, "fault_tolerance", "data_parallel"),
    ({"launcher": "ray", "fault_tolerance": "torchft"}, "launcher", "torchft"),
    ({"launcher": "ray", "windows_support": "yes"}, "launcher", "Linux"),
]


def _id(case: tuple) -> str:
    return "-".join(f"{k}={v}" for k, v in case[0].items())


@pytest.mark.parametrize("answers, variable, reason", BAD, ids=[_id(c) for c in BAD])
def test_bad_answer_is_refused_and_leaves_nothing(tmp_path, answers, variable, reason):
    out = tmp_path / "out"
    out.mkdir()
    args = [f"{k}={v}" for k, v in answers.items()]
    result = run([PYTHON, "-m", "cookiecutter", "--no-input", "-o", str(out), str(ROOT), *args],
                 tmp_path, 120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")
              and "Stopping generation" not in line]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"ERROR: {variable} ") and reason in errors[0]
    # Checked the moment cookiecutter returns: nothing may be cleaned up later in the background.
    assert list(out.iterdir()) == [], "a refused bake left files behind"
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "a refused bake wrote outside"


def test_good_names_pass(tmp_path):
    result = run([PYTHON, "-m", "cookiecutter", "--no-input", "-o", str(tmp_path), str(ROOT),
                  "project_name=Match Maker", "windows_support=yes", "backend=gloo"], tmp_path, 120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "match-maker/match_maker/main.py").is_file()
    assert (tmp_path / "match-maker/scripts/train_windows.ps1").is_file()
