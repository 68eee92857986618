"""The `launcher=ray` bake on a real local Ray cluster, in a venv of its own (Ray stays out of the
shared one). A file of its own so that `make test` runs it in its first pass, beside the parts that
wait: it keeps one core busy (58 % of both, measured per test from /proc/stat, 2026-12-05), and
its bounded waits allow for a neighbour."""

from __future__ import annotations

import re

from conftest import TORCH, Venv, check_ok


def test_the_ray_bake_trains_restarts_and_refuses_mistakes_on_a_real_ray_cluster(tmp_path, bake):
    """Torch first, then the project with its `ray` extra; its tests/test_ray.py starts a local Ray
    cluster and runs scripts/train_ray.py on it (a run, a SIGKILLed worker restarted, the one-line
    mistakes, a variable only the driver has named, Ctrl-C and SIGTERM on the driver with workers
    that save, Ctrl-C with frozen ones, the cluster killed)."""
    project = bake(launcher="ray")
    env = Venv(tmp_path / ".venv")
    env.pip(TORCH, cwd=project)
    env.pip("-e", ".[ray]", "pytest>=7", cwd=project)
    result = check_ok(env.run([env.python, "-m", "pytest", "-q", "--full", "-p", "no:cacheprovider",
                               "tests/test_ray.py"], project, timeout=900))
    assert re.search(r"\b12 passed", result.stdout) and "skipped" not in result.stdout, result.stdout
