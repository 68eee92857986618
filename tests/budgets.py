"""What each part of the template's suite may take on CI's machine (2 cores), in seconds. The
parts add up to the 35 minutes `.ci/run` keeps to (with its install), so that a slow day (up to
2.5x) still ends within CI's 90. A feature's tests pay for their time inside its part's budget: a
part over it is named in the table every run ends with, for the next change to see what it costs.

A part is a test file, or a test (a node id, parameters left off) that runs a generated project's
own suite. Each test counts in the most specific part that names it."""

from __future__ import annotations

INSTALL_S = 100  # .ci/run's apt and pip installs on a fresh machine
BUDGET_S = {  # with INSTALL_S: 2,097 s, within the 2,100 s of 35 minutes
    "tests/test_generated_runs.py::test_the_projects_whole_suite_passes_in_the_venv": 850,
    "tests/test_generated_runs.py::test_other_tasks_and_answers_pass_their_tests": 200,
    "tests/test_generated_runs.py::test_the_ray_bake_trains_restarts_and_refuses_mistakes_on_a_real_ray_cluster": 140,
    "tests/test_generated_runs.py": 185,  # the venv, the README's commands, trackers, a minimal task
    "tests/test_fault_tolerance.py": 260,
    "tests/test_container.py": 105,
    "tests/test_kubernetes.py": 70,
    "tests/test_docs_pointers.py": 42,
    "tests/test_bench.py": 55,
    "tests/test_slurm_cluster.py": 55,
    "tests/test_bake.py": 20,
    "tests/test_hooks.py": 6,
    "tests/test_cruft.py": 6,
    "tests/test_workflow.py": 2,
    "tests/test_repository.py": 1,
}


def part_of(nodeid: str) -> str:
    """The budget's part a test counts in: the test (less its parameters), else its file."""
    test = nodeid.split("[")[0]
    return test if test in BUDGET_S else nodeid.split("::")[0]


def table(seconds: dict[str, float]) -> list[str]:
    """One line a part, slowest first: seconds, budget, and a note where it is over."""
    lines = []
    for part, spent in sorted(seconds.items(), key=lambda item: -item[1]):
        budget = BUDGET_S.get(part)
        over = ("" if budget is None or spent <= budget
                else f"   over its budget by {spent - budget:.0f} s")
        lines.append(f"{spent:8.1f} s  {'' if budget is None else f'{budget:5d} s':>7}  "
                     f"{part}{'   (no budget: add it to tests/budgets.py)' if budget is None else over}")
    total, budget = sum(seconds.values()), sum(BUDGET_S.get(part, 0) for part in seconds)
    lines.append(f"{total:8.1f} s  {budget:5d} s  in all"
                 + (f"   over by {total - budget:.0f} s" if total > budget else ""))
    return lines
