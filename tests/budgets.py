"""What each part of the template's suite may take on CI's machine (2 cores), in seconds. The
parts add up to less than the 45 minutes `.ci/run` keeps to (with its install), so that a slow day
(up to 2x) still ends within CI's 90. A feature's tests pay for their time inside its part's budget: a
part over it is named in the table every run ends with, for the next change to see what it costs.

A part is a test file, or a test (a node id, parameters left off) that runs a generated project's
own suite. Each test counts in the most specific part that names it.

The seconds hold on a machine as fast as the one they were measured on: `.ci/run` first reads
this machine's speed with ../shared/tools/calibrate.py (CALIBRATION_S, seconds of a fixed workload
of Pythons importing torch and a 2-process gloo loop) and the table gives each part in those
units too, beside the budget's units at CALIBRATION_S (the machine tests/README.md's run read)."""

from __future__ import annotations

import os

# calibrate.py's reading of the machine the budgets hold on: 12.8 s is issue 73's fresh machine
# (2026-12-01); this kind read 16.0 and 17.9 s on 2026-12-04 (a larger reading: slower).
CALIBRATION_S = 12.8
INSTALL_S = 100  # .ci/run's apt and pip installs on a fresh machine
BUDGET_S = {  # with INSTALL_S: 2,870 s, 170 s over the 2,700 s of 45 minutes (hf_causal_lm)
    "tests/test_generated_runs.py::test_the_projects_whole_suite_passes_in_the_venv": 850,
    "tests/test_generated_runs.py::test_other_tasks_and_answers_pass_their_tests": 200,
    # Ray: +47 s for Ctrl-C on the driver and the cluster killed mid-run (two runs to a save), 14
    # of it paid by checking the malformed addresses in the test's process; +35 s for Ctrl-C
    # with frozen workers (a run to a save, then the driver's 25 s bound).
    "tests/test_ray_bake.py": 210,
    # tensor_parallel: its bake's 2 x 2 runs (a, a killed worker's, one process, fsdp resumed);
    # +50 s for a frozen peer and a host cut off (2 hosts x 2: the mesh's groups' timeouts).
    # +30 s for the run's refusals (--compile, a step of one's own, a colwise output layer).
    "tests/test_generated_runs.py::test_the_tensor_parallel_bake_passes_its_tests": 170,
    # Every task x model_layout's quickstart, one short epoch each (16 bakes, 2 processes); +85 s
    # for hf_causal_lm's 4 (a tiny Llama: each process imports transformers, 84 s measured).
    "tests/test_every_layout_trains.py": 245,
    # hf_causal_lm: its task tests (2-process runs, each process importing transformers); +30 s
    # for LoRA (a run, a killed worker's, fsdp's two; 109 s measured alone on 2026-12-07); +15 s
    # for LoRA compiled and checkpointed layer by layer, +15 s for tied embeddings (a run and
    # its export); -n 2 (128 s measured alone).
    "tests/test_generated_runs.py::test_the_hf_causal_lm_bake_passes_its_tests": 130,
    # hf_causal_lm x tensor_parallel: its task tests under tensor_parallel, and 2 x 2 on 4
    # processes with a killed worker's restart against one process (-n 2: 112 s measured alone).
    "tests/test_generated_runs.py::test_the_hf_causal_lm_tensor_parallel_bake_passes_its_tests":
        115,
    "tests/test_generated_runs.py": 185,  # the venv, the README's commands, trackers, a minimal task
    "tests/test_fault_tolerance.py": 260,
    "tests/test_container.py": 105,
    "tests/test_kubernetes.py": 70,
    "tests/test_docs_pointers.py": 50,  # +8 s: 25 pairwise bakes, not 21 (hf_causal_lm's 4)
    "tests/test_bench.py": 55,
    "tests/test_slurm_cluster.py": 55,
    # +25 s: the size rules read six bakes, not the default alone; +10 s: hf_causal_lm's 4 more
    # pairwise bakes (25) and a seventh sized one (54.5 s measured beside another suite's run).
    "tests/test_bake.py": 55,
    "tests/test_hooks.py": 6,
    "tests/test_cruft.py": 6,
    "tests/test_workflow.py": 2,
    "tests/test_repository.py": 1,
}


def part_of(nodeid: str) -> str:
    """The budget's part a test counts in: the test (less its parameters), else its file."""
    test = nodeid.split("[")[0]
    return test if test in BUDGET_S else nodeid.split("::")[0]


def table(seconds: dict[str, float], overlapped: tuple[int, float] | None = None) -> list[str]:
    """One line a part, slowest first: seconds, budget, and a note where it is over; with
    CALIBRATION_S in the environment (.ci/run's reading), the same in calibration units. With
    `overlapped` (files run at a time, wall seconds), a last line for a pass whose parts ran side
    by side: their sum is not its wall time."""
    here = float(os.environ.get("CALIBRATION_S") or 0)

    def units(spent: float, budget: float | None) -> str:
        if not here:
            return ""
        allowed = "" if budget is None else f"{budget / CALIBRATION_S:5.1f} u"
        return f"{spent / here:6.1f} u {allowed:>7}  "

    # Over or not: against the budget scaled to this machine's speed, where it was read.
    scale, scaled = (here / CALIBRATION_S, " (scaled to this machine)") if here else (1.0, "")
    lines = []
    for part, spent in sorted(seconds.items(), key=lambda item: -item[1]):
        budget = BUDGET_S.get(part)
        over = ("" if budget is None or spent <= budget * scale
                else f"   over its budget by {spent - budget * scale:.0f} s{scaled}")
        lines.append(f"{spent:8.1f} s  {'' if budget is None else f'{budget:5d} s':>7}  "
                     f"{units(spent, budget)}"
                     f"{part}{'   (no budget: add it to tests/budgets.py)' if budget is None else over}")
    total, budget = sum(seconds.values()), sum(BUDGET_S.get(part, 0) for part in seconds)
    lines.append(f"{total:8.1f} s  {budget:5d} s  {units(total, budget)}in all"
                 + (f"   over by {total - budget * scale:.0f} s{scaled}"
                    if total > budget * scale else ""))
    if here:
        lines.append(f"(u: calibration units, this machine's {here:.2f} s; the budgets' machine "
                     f"read {CALIBRATION_S:.2f} s)")
    if overlapped:
        lines.append(f"({overlapped[0]} files at a time: these parts took {overlapped[1]:.0f} s of "
                     f"wall time; their tests' own times sum to {total:.0f} s, their budgets to "
                     f"{budget} s)")
    return lines
