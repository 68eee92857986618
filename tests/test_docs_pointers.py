"""Every pointer of a baked project's docs and comments (files, sections, flags) exists in that
bake: its own tests/test_docs.py passes for every answer set of the pairwise set."""

from __future__ import annotations

import pytest
from conftest import PYTHON, answers_id, check_ok, pairwise_combinations, run


@pytest.mark.parametrize("answers", pairwise_combinations(), ids=answers_id)
def test_docs_point_at_what_the_bake_has(bake, answers):
    project = bake(**answers)
    check_ok(run([PYTHON, "-m", "pytest", "-q", "tests/test_docs.py", "-p", "no:cacheprovider"],
                 project, timeout=300))
