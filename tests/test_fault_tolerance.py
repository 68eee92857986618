"""fault_tolerance=torchft as a user gets it: a fresh venv with `pip install -e ".[ft]"`, then
the project's own torchft tests, all of them real: a lighthouse, two replica groups of two
processes each, one group SIGKILLed and started again (it heals), every group killed (they
resume), a lighthouse that is unreachable, starts late or dies, lighthouse addresses written
carelessly, train.py refusing a replica group's variables, and the script the docs show. And
scripts/slurm/ft.sbatch on a real one-node SLURM cluster: a lighthouse step and a step per group;
one group's step killed, the script starts it again and it heals."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TORCH, Venv, check_ok
from cookiecutter.main import cookiecutter
from slurm import SlurmCluster, why_not

pytestmark = pytest.mark.torchft


@pytest.fixture(scope="module")
def ft_project(tmp_path_factory) -> tuple[Path, Venv]:
    folder = tmp_path_factory.mktemp("ft")
    project = Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(folder),
                                extra_context={"fault_tolerance": "torchft"}))
    env = Venv(folder / ".venv")
    env.pip(TORCH, cwd=project)  # first: nothing may pull another torch
    # The ft extra and pytest: the rest of the dev extra (ruff, matplotlib, S3's server) is the
    # default project's, installed in its venv by test_generated_runs.py (35 s less here).
    env.pip("-e", ".[ft]", "pytest>=7", cwd=project)
    return project, env


def test_the_projects_torchft_tests_pass_in_a_fresh_venv(ft_project, capsys):
    project, env = ft_project
    result = check_ok(env.run([env.python, "-m", "pytest", "-q", "--full", "-s", "-p",
                               "no:cacheprovider", "tests/test_fault_tolerance.py"], project,
                              timeout=900))
    assert re.search(r"\b16 passed\b", result.stdout), result.stdout
    healed = re.search(r"group 1 killed at step .*", result.stdout)
    assert healed, result.stdout
    with capsys.disabled():
        print(f"\n{healed.group(0)}")


@pytest.mark.slurm
@pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
def test_the_slurm_script_runs_a_step_per_group_and_a_killed_one_heals(ft_project, tmp_path):
    project, env = ft_project
    cluster = SlurmCluster(tmp_path / "slurm")
    try:
        cluster.start()
        # Only resource flags on the sbatch line; two groups on this one node of 2 CPUs.
        job = cluster.sbatch(["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0",
                              "--cpus-per-task=2", "scripts/slurm/ft.sbatch", "--max-steps", "2000",
                              "--dataset-size", "512", "--hidden-size", "16", "--batch-size", "16",
                              "--val-fraction", "0", "--epochs", "100000", "--log-every", "50",
                              "--save-every", "0", "--save-every-steps", "50", "--no-progress"],
                             project, NUM_REPLICA_GROUPS="2", GPUS_PER_NODE="2",
                             HEARTBEAT_TIMEOUT_MS="3000", **env.env())
        metrics = project / "runs/group1/metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and any(json.loads(line).get("step", 0) >= 100
                                            for line in metrics.read_text().splitlines())):
            assert time.monotonic() < deadline and cluster.job(job)["JobState"] in (
                "PENDING", "RUNNING"), cluster.job(job)
            time.sleep(0.2)
        steps = cluster._run("squeue", "-h", "-s", "-j", str(job), "-o", "%i %j").stdout
        step = next(line.split()[0] for line in steps.splitlines() if line.endswith(" group1"))
        cluster.scancel(step, "--signal=KILL")  # the group's processes, as if its node was lost
        info = cluster.wait(job, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", timeout=300)
        out = (project / f"slurm-{job}.out").read_text()
        group1 = (project / f"slurm-{job}-group1.out").read_text()
        assert info["JobState"] == "COMPLETED", f"{out}\n{group1}"
        assert "replica group 1 failed: starting it again" in out, out
        # What torchft and the project promise: the restarted group takes part again (healed
        # from the live one, or at the same step from its own checkpoint; had the two trained
        # apart meanwhile, the groups' state check makes them one model), and the job ends with
        # one model, both groups at the last step.
        restarted = group1.split("resumed from", 1)[-1] if "resumed from" in group1 else group1
        assert re.search(r"torchft: step \d+: 2 replica group\(s\) taking part", restarted), \
            group1
        assert "done: 2000 steps" in (project / f"slurm-{job}-group0.out").read_text()
        assert "Quorum" in (project / f"slurm-{job}-lighthouse.out").read_text()
        weights = [torch.load(max((project / f"checkpoints/group{g}").glob("ckpt_step*.pt")),
                              map_location="cpu", weights_only=True) for g in range(2)]
        assert weights[0]["step"] == weights[1]["step"] == 2000
        assert all(torch.equal(weights[0]["model"][k], weights[1]["model"][k])
                   for k in weights[0]["model"])
    finally:
        cluster.stop()
