"""The baked project's SLURM scripts on a real one-node SLURM cluster (slurmctld, slurmd, munged),
submitted as the docs show them: `sbatch scripts/slurm/<pattern>.sbatch [training flags]`, with only
resource flags added on the sbatch command line (this machine has 2 CPUs and no GPU).

Both patterns train; a preemption (`scancel -b -s USR1`, what `#SBATCH --signal=B:USR1@120` sends)
requeues the job and the requeued run resumes to the uninterrupted run's weights bit for bit; a plain
`scancel` leaves a checkpoint; a rank that fails ends the job; a signal during start-up says why
nothing was saved. Elsewhere (no SLURM, not root) the tests skip with the reason.
"""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, ROOT
from cookiecutter.main import cookiecutter
from slurm import SUBNET, SlurmCluster, TwoNodeCluster, why_not, why_not_two_nodes

WHY_NOT = why_not()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

# This machine has no GPU: a node of 2 CPUs runs the two training processes.
RESOURCES = {
    "srun.sbatch": ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"],
    "torchrun.sbatch": ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=2"],
}
# Where SLURM allocates no GPU, the torchrun pattern takes the processes per node from here.
TORCHRUN_ENV = {"GPUS_PER_NODE": "2"}
TRAIN = ["--epochs", "2", "--dataset-size", "4096", "--batch-size", "16", "--hidden-size", "16",
         "--log-every", "10", "--no-progress", "--timeout-s", "10"]

# Test hooks, loaded by every Python process of a job through PYTHONPATH (the scripts stay as they
# are): a step that fails on rank 1, or a start-up that takes a while.
SITECUSTOMIZE = """
import os
hook = os.environ.get("TEST_HOOK")
if hook == "fail-on-rank-1" and os.environ.get("SLURM_PROCID") == "1":
    import ddp_project.loop as loop
    run_batch = loop.Trainer._run_batch
    def failing(self, *args, **kwargs):
        if self.step == 5:
            raise RuntimeError("a step failed on rank 1 (a test)")
        return run_batch(self, *args, **kwargs)
    loop.Trainer._run_batch = failing
elif hook == "slow-start":
    import time
    import ddp_project.checkpoint.resume as resume
    pick = resume.pick_checkpoint
    def slow(*args, **kwargs):
        print("starting slowly", flush=True)
        time.sleep(15)
        return pick(*args, **kwargs)
    resume.pick_checkpoint = slow
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def bake(folder: Path) -> Path:
    return Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(folder)))


def submit(cluster: SlurmCluster, project: Path, script: str, *train: str, **env: str) -> int:
    if script == "torchrun.sbatch":
        env = {**TORCHRUN_ENV, **env}
    return cluster.sbatch([*RESOURCES[script], f"scripts/slurm/{script}", *train], project, **env)


def output(project: Path, job: int) -> str:
    path = project / f"slurm-{job}.out"
    return path.read_text() if path.exists() else ""


def wait_for_output(cluster: SlurmCluster, project: Path, job: int, text: str,
                    timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in output(project, job):
        info = cluster.job(job)
        assert time.monotonic() < deadline and info.get("JobState") in ("PENDING", "RUNNING"), \
            f"{info}\n{output(project, job)}"
        time.sleep(0.2)


def newest_checkpoint(project: Path) -> Path:
    return max((project / "checkpoints").glob("ckpt_step*.pt"))


def final_weights(project: Path) -> dict[str, torch.Tensor]:
    return torch.load(newest_checkpoint(project), map_location="cpu", weights_only=True)["model"]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a), "weights differ"


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory) -> Path:
    """The srun pattern, trained to the end once: the reference the other runs must match."""
    project = bake(tmp_path_factory.mktemp("uninterrupted"))
    job = submit(cluster, project, "srun.sbatch", *TRAIN)
    info = cluster.wait(job, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    assert info["JobState"] == "COMPLETED", output(project, job)
    return project


def test_srun_pattern_trains_and_leaves_the_specs_artefacts(uninterrupted):
    summary = (uninterrupted / "runs/latest/summary.json").read_text()
    assert '"launcher": "slurm"' in summary and '"world_size": 2' in summary
    assert '"epochs_completed": 2' in summary
    assert (uninterrupted / "runs/latest/metrics.jsonl").read_text().count("\n") > 10
    checkpoint = torch.load(newest_checkpoint(uninterrupted), map_location="cpu",
                            weights_only=True)
    assert {"model", "optimizer", "epoch", "step", "world_size", "config"} <= checkpoint.keys()
    assert checkpoint["step"] == 2 * 4096 // (16 * 2)


def test_torchrun_pattern_trains_to_the_same_weights(cluster, uninterrupted, tmp_path):
    project = bake(tmp_path)
    job = submit(cluster, project, "torchrun.sbatch", *TRAIN)
    info = cluster.wait(job, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    out = output(project, job)
    assert info["JobState"] == "COMPLETED", out
    assert '"launcher": "torchrun"' in (project / "runs/latest/summary.json").read_text()
    assert_same(final_weights(project), final_weights(uninterrupted))


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    why = why_not_two_nodes()
    if why:
        pytest.skip(why)
    cluster = TwoNodeCluster(tmp_path_factory.mktemp("slurm-two-nodes"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_torchrun_pattern_on_two_nodes_trains_to_the_same_weights(two_nodes, uninterrupted,
                                                                   tmp_path):
    """One torchrun per node; the two processes talk over the nodes' own LAN (no network
    variables set), and end with the one-node run's weights."""
    project = bake(tmp_path)
    resources = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=2"]
    job = two_nodes.sbatch([*resources, "scripts/slurm/torchrun.sbatch", *TRAIN], project,
                           GPUS_PER_NODE="1")
    info = two_nodes.wait(job, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    out = output(project, job)
    assert info["JobState"] == "COMPLETED", f"{out}\n{two_nodes.logs()}"
    assert info["NodeList"] == "nodea,nodeb" and f"{SUBNET}." in out, out
    summary = (project / "runs/latest/summary.json").read_text()
    assert '"launcher": "torchrun"' in summary and '"world_size": 2' in summary
    assert_same(final_weights(project), final_weights(uninterrupted))


def test_preemption_requeues_and_the_requeued_run_resumes_bit_for_bit(cluster, uninterrupted,
                                                                       tmp_path):
    project = bake(tmp_path)
    job = submit(cluster, project, "torchrun.sbatch", *TRAIN)
    wait_for_output(cluster, project, job, "step 20 ")
    cluster.scancel(job, "--batch", "--signal=USR1")  # the script's trap requeues the job
    cluster.wait(job, "PENDING")
    cluster.start_now(job)
    info = cluster.wait(job, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    out = output(project, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out
    assert f"time limit near: requeueing job {job}" in out
    stopped_at = int(re.search(r"stopped by SIGTERM at step (\d+): checkpoint saved", out)[1])
    assert f"resumed from checkpoints/ckpt_step{stopped_at:08d}.pt" in out, out
    assert "torchrun: stopped by SIGTERM" in out and "Traceback" not in out, out
    assert_same(final_weights(project), final_weights(uninterrupted))


def test_a_plain_scancel_stops_the_job_with_a_saved_checkpoint(cluster, tmp_path):
    project = bake(tmp_path)
    job = submit(cluster, project, "srun.sbatch", *TRAIN)
    wait_for_output(cluster, project, job, "step 20 ")
    cluster.scancel(job)
    info = cluster.wait(job, "CANCELLED", "COMPLETED", "FAILED")
    out = output(project, job)
    assert info["JobState"] == "CANCELLED", out
    stopped_at = int(re.search(r"stopped by SIGTERM at step (\d+): checkpoint saved", out)[1])
    assert newest_checkpoint(project).name == f"ckpt_step{stopped_at:08d}.pt"
    assert "Traceback" not in out, out


def test_a_step_that_fails_on_one_rank_ends_the_job_within_the_timeout(cluster, tmp_path):
    project = bake(tmp_path)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    job = submit(cluster, project, "srun.sbatch", *TRAIN, TEST_HOOK="fail-on-rank-1",
                 PYTHONPATH=f"{hooks}:{project}")
    wait_for_output(cluster, project, job, "a step failed on rank 1")
    failed_at = time.monotonic()
    info = cluster.wait(job, "FAILED", "COMPLETED", "CANCELLED", timeout=60)
    ended_after = time.monotonic() - failed_at
    out = output(project, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", out
    assert ended_after < 10 + 5, f"ended {ended_after:.1f} s after the failure (--timeout-s 10)"
    # A bug in a step is the user's to read: rank 1's traceback, then srun stops the others.
    assert "RuntimeError: a step failed on rank 1 (a test)" in out, out


def test_a_signal_during_start_up_says_why_nothing_was_saved(cluster, tmp_path):
    project = bake(tmp_path)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    job = submit(cluster, project, "srun.sbatch", *TRAIN, "--timeout-s", "60",
                 TEST_HOOK="slow-start", PYTHONPATH=f"{hooks}:{project}")
    wait_for_output(cluster, project, job, "starting slowly")
    cluster.scancel(job, "--batch", "--signal=USR1")  # the time-limit signal, far too early
    cluster.wait(job, "PENDING")
    cluster.scancel(job)
    out = output(project, job)
    assert "before the first training step: nothing to save" in out, out
    assert "lengthen --time or shorten the lead of #SBATCH --signal" in out, out
    assert not list(project.glob("checkpoints/ckpt_step*"))


WORLD = ("from ddp_project.runtime.environments import resolve_world; import os; w = resolve_world(os.environ);"
         "print(w.launcher, w.rank, w.local_rank, w.world_size, w.local_world_size, w.master_addr)")


def test_the_resolver_reads_what_a_real_srun_sets(cluster, uninterrupted):
    """Every rank of a real `srun -n2` resolves its place; and the variables the generated tests
    take as SLURM's (recorded from a real srun) are still all set by this one."""
    result = cluster.srun("-N1", "-n2", PYTHON, "-c", WORLD, cwd=uninterrupted)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:2]) == [
        f"slurm 0 0 2 2 {cluster.host}", f"slurm 1 1 2 2 {cluster.host}"], result.stdout
    job = cluster.sbatch(["-N1", "--ntasks-per-node=2", "--cpus-per-task=1", "--output=env.out",
                          "--wrap", "srun env"], uninterrupted)
    cluster.wait(job, "COMPLETED", "FAILED")
    real = {line.split("=", 1)[0] for line in (uninterrupted / "env.out").read_text().splitlines()}
    source = (uninterrupted / "tests/test_distributed.py").read_text()
    recorded = set(ast.literal_eval(source.split("SLURM_STEP = ", 1)[1].split("\n}\n", 1)[0] + "}"))
    assert recorded <= real, recorded - real
