"""The sbatch scripts run for real, with stand-ins for srun and scontrol on PATH and SLURM's
variables set."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PROJECT_ROOT, TRAIN, child_env, path_with, run_cmd, write_script

pytestmark = pytest.mark.launchers

# srun starts SLURM_NTASKS copies of the command, each with the variables the real srun sets.
SRUN = """
echo $$ > "${STUB_STATE:-/tmp}/srun.pid"
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done   # srun's own options
n=${SLURM_NTASKS:?}; per=${SLURM_NTASKS_PER_NODE:-$n}
pids=()
for ((i = 0; i < n; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$((i % per)) SLURM_NODEID=$((i / per)) SLURM_STEP_ID=0 "$@" &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
# Every node of the stub allocation is this machine; a requeue stops the job step's tasks with
# SIGTERM, as SLURM does before it puts the job back in the queue.
SCONTROL = """
if [[ "$1" == requeue ]]; then
  echo "requeue $2" > "$STUB_STATE/requeued"
  srun=$(cat "$STUB_STATE/srun.pid")
  for pid in $(cat /proc/"$srun"/task/*/children); do kill -TERM "$pid"; done
  exit 0
fi
[[ "$1 $2" == "show hostnames" ]] || { echo "stub scontrol: unsupported: $*" >&2; exit 1; }
for _ in $(seq "${SLURM_JOB_NUM_NODES:-1}"); do echo 127.0.0.1; done
"""


@pytest.fixture
def slurm_bin(bin_dir: Path) -> Path:
    write_script(bin_dir / "srun", SRUN)
    write_script(bin_dir / "scontrol", SCONTROL)
    return bin_dir


def free_job_id() -> int:
    """A job id whose derived port (15000 + id % 20000, as in the sbatch scripts) is free now."""
    for job_id in random.sample(range(20000), 500):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + job_id))
                return job_id
            except OSError:
                continue
    raise RuntimeError("no free port in 15000-34999")


def job_env(bin_dir: Path, nodes: int, tasks_per_node: int, **extra: str) -> dict[str, str]:
    return {"PATH": path_with(bin_dir), "SLURM_JOB_ID": str(free_job_id()),
            "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes), "SLURM_NTASKS": str(nodes * tasks_per_node),
            "SLURM_NTASKS_PER_NODE": str(tasks_per_node), "SLURM_SUBMIT_DIR": str(PROJECT_ROOT),
            **extra}


def sbatch_args(workdir: Path, *training: str) -> list[str]:
    return ["--no-progress", *training, "--output-dir", str(workdir / "runs"), "--checkpoint-dir",
            str(workdir / "ck")]


def run_sbatch(script: str, workdir: Path, env: dict[str, str]):
    args = sbatch_args(workdir, "--epochs", "1", "--dataset-size", "256")
    result = run_cmd(["bash", str(PROJECT_ROOT / "scripts/slurm" / script), *args], workdir, **env)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return json.loads((workdir / "runs/summary.json").read_text())


def test_torchrun_pattern_two_nodes(workdir, slurm_bin):
    """One task per node (2 'nodes'), torchrun on each with one process: a world of 2."""
    summary = run_sbatch("torchrun.sbatch", workdir, job_env(slurm_bin, nodes=2, tasks_per_node=1,
                                                             SLURM_GPUS_ON_NODE="1"))
    assert summary["world_size"] == 2 and summary["launcher"] == "torchrun"
    assert summary["steps"] == 4


def test_srun_pattern_one_task_per_device(workdir, slurm_bin):
    summary = run_sbatch("srun.sbatch", workdir, job_env(slurm_bin, nodes=1, tasks_per_node=2))
    assert summary["world_size"] == 2 and summary["launcher"] == "slurm" and summary["steps"] == 4


def test_sbatch_task_counts_match_their_pattern():
    torchrun = (PROJECT_ROOT / "scripts/slurm/torchrun.sbatch").read_text()
    srun = (PROJECT_ROOT / "scripts/slurm/srun.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1\n" in torchrun and "--rdzv-id=\"$SLURM_JOB_ID\"" in torchrun
    assert "scontrol show hostnames" in torchrun and "scontrol show hostnames" in srun
    per_node = int(srun.split("#SBATCH --ntasks-per-node=")[1].split()[0])
    gpus = int(srun.split("#SBATCH --gpus-per-node=")[1].split()[0])
    assert per_node == gpus, "srun pattern: one task per GPU"


def test_python_without_srun_inside_an_allocation_is_explained(workdir):
    result = run_cmd([sys.executable, TRAIN, "--epochs", "1"], workdir,
                     SLURM_JOB_ID="7", SLURM_NTASKS="2", SLURM_PROCID="0")
    assert result.returncode == 1
    assert "error: SLURM_NTASKS=2 but this process was not started by srun" in result.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stub uses /proc")
def test_time_limit_signal_requeues_and_the_requeued_job_resumes(workdir, slurm_bin):
    env = job_env(slurm_bin, nodes=1, tasks_per_node=2, STUB_STATE=str(workdir))
    script = str(PROJECT_ROOT / "scripts/slurm/srun.sbatch")
    args = sbatch_args(workdir, "--dataset-size", "1024", "--batch-size", "16", "--epochs", "4",
                       "--hidden-size",
                       "256", "--num-layers", "3", "--save-every-steps", "8", "--log-every", "1000")
    job = subprocess.Popen(["bash", script, *args], cwd=workdir, env=child_env(**env), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list((workdir / "ck").glob("ckpt_step*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(job.pid, signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@120` sends near the limit
    out, err = job.communicate(timeout=120)
    assert job.returncode == 143, err  # srun passes the stopped tasks' code through
    assert (workdir / "requeued").read_text().split() == ["requeue", env["SLURM_JOB_ID"]]
    assert "stopped by SIGTERM at step" in out
    assert not (workdir / "runs/summary.json").exists()
    # The requeued job runs the same script again and picks up where the first one stopped.
    result = run_cmd(["bash", script, *args], workdir, **env)
    assert result.returncode == 0, result.stderr
    summary = json.loads((workdir / "runs/summary.json").read_text())
    assert summary["resumed_from"] and summary["steps"] == 128
