"""Every pointer of a baked project's docs and comments (files, sections, flags) exists in that
bake: its own tests/test_docs.py passes for every answer set of the pairwise set."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from conftest import PYTHON, answers_id, pairwise_combinations, run


def test_docs_point_at_what_the_bake_has(bake):
    """Two bakes' suites at a time: each is mostly the start of a Python that imports torch."""
    projects = {answers_id(answers): bake(**answers) for answers in pairwise_combinations()}

    def docs_test(project):
        return run([PYTHON, "-m", "pytest", "-q", "tests/test_docs.py", "-p", "no:cacheprovider"],
                   project, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(projects, pool.map(docs_test, projects.values()), strict=True))
    failed = {name: r.stdout[-3000:] + r.stderr[-1000:] for name, r in results.items()
              if r.returncode != 0}
    assert not failed, "\n\n".join(f"{name}:\n{out}" for name, out in failed.items())
