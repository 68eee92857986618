"""A baked project takes later template changes: made with `cruft create`, it remembers its
answers and the template commit, `cruft check` sees a newer template, and `cruft update` applies
the change while keeping the user's own edits."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, check_ok, run

GIT = ["git", "-c", "user.email=test@example.com", "-c", "user.name=test"]
CHANGE = "A line added by a later version of the template."


def git_copy_of_the_template(folder: Path) -> Path:
    """The template's tracked files in a git repository of their own (cruft clones templates)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / name.decode()
        if source.is_file():  # a file deleted in the work tree is not part of this version
            target = folder / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    check_ok(run(["git", "init", "-q"], folder))
    check_ok(run(["git", "add", "-A"], folder))
    check_ok(run([*GIT, "commit", "-qm", "template v1"], folder))
    return folder


@pytest.fixture
def cruft_project(tmp_path):
    if shutil.which("cruft") is None:
        pytest.skip("cruft is not installed (pip install cruft)")
    template = git_copy_of_the_template(tmp_path / "template")
    check_ok(run(["cruft", "create", str(template), "--no-input", "--output-dir",
                  str(tmp_path / "out"), "--extra-context", '{"task": "regression"}'], tmp_path))
    project = tmp_path / "out" / "ddp-project"
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], [*GIT, "commit", "-qm", "baked"]):
        check_ok(run(cmd, project))
    return template, project


def test_the_baked_project_remembers_its_answers_and_template(cruft_project):
    template, project = cruft_project
    import json
    recorded = json.loads((project / ".cruft.json").read_text())
    assert recorded["template"] == str(template) and len(recorded["commit"]) == 40
    assert recorded["context"]["cookiecutter"]["task"] == "regression"
    assert check_ok(run(["cruft", "check"], project)).returncode == 0


def test_cruft_update_applies_a_template_change_and_keeps_the_users_edits(cruft_project):
    template, project = cruft_project
    readme = template / "{{cookiecutter.project_slug}}" / "README.md"
    readme.write_text(readme.read_text() + f"\n{CHANGE}\n")
    check_ok(run([*GIT, "commit", "-qam", "template v2"], template))
    assert run(["cruft", "check"], project).returncode == 1, "cruft check sees the newer template"

    task = project / "ddp_project" / "task.py"
    task.write_text(task.read_text() + "\n# the user's own edit\n")
    check_ok(run([*GIT, "commit", "-qam", "my task"], project))
    check_ok(run(["cruft", "update", "-y"], project))
    assert CHANGE in (project / "README.md").read_text()
    assert "# the user's own edit" in task.read_text()
    assert not list(project.rglob("*.rej")), "no conflicts left"
    assert check_ok(run(["cruft", "check"], project)).returncode == 0
