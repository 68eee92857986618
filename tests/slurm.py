"""A real one-node SLURM cluster for the tests: munged, slurmctld and slurmd from Debian's
`slurm-wlm` and `munge`, with every file (key, sockets, state, logs) under one folder.

The node is this machine under its own host name (the batch scripts take MASTER_ADDR from the job's
node list, so the name must resolve here); its CPUs are the cores online (`nproc` obeys
OMP_NUM_THREADS). Jobs see the cluster through SLURM_CONF in their environment.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "srun")


def why_not() -> str | None:
    """Why no cluster can start on this machine, or None."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return f"needs SLURM and munge ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "needs root to run slurmd"
    try:
        socket.gethostbyname(socket.gethostname())
    except OSError:
        return f"this machine's host name {socket.gethostname()!r} does not resolve"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CONF = """\
ClusterName=tests
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.socket
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=30
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=tests Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        env = {**os.environ, **self.env}
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)

    def start(self) -> None:
        for sub in ("state", "spool"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o755)  # munged refuses a socket folder others may write to
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        f = self.folder
        subprocess.run(["munged", "--force", f"--socket={f}/munge.socket", f"--key-file={key}",
                        f"--log-file={f}/munged.log", f"--pid-file={f}/munged.pid",
                        f"--seed-file={f}/munged.seed"], check=True, timeout=30)
        cpus = os.sysconf("SC_NPROCESSORS_ONLN")
        self.conf.write_text(CONF.format(host=self.host, folder=f, cpus=cpus,
                                         ctld_port=free_port(), d_port=free_port()))
        for daemon in (["slurmctld", "-f", str(self.conf)],
                       ["slurmd", "-f", str(self.conf), "-N", self.host]):
            result = self._run(*daemon)
            assert result.returncode == 0, f"{daemon[0]}: {result.stderr}"
        deadline = time.monotonic() + 60
        while self._run("sinfo", "-h", "-o", "%T").stdout.strip() != "idle":
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.5)

    def stop(self) -> None:
        self._run("scancel", "--full", "--user=root")
        self._run("scontrol", "shutdown")
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            try:
                os.kill(int((self.folder / pid_file).read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in self.folder.glob("*.log"))

    def sbatch(self, args: list[str], cwd: Path, **env: str) -> int:
        """Submit as a user does from `cwd` (the environment goes with the job)."""
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env, **env}
        result = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=full_env,
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        return int(result.stdout.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        """The job's fields as `scontrol show job` has them (JobState, ExitCode, Restarts, ...)."""
        out = self._run("scontrol", "-o", "show", "job", str(job)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job: int, *states: str, timeout: float = 300) -> dict[str, str]:
        """Wait until the job is in one of `states`."""
        deadline = time.monotonic() + timeout
        while (info := self.job(job)).get("JobState") not in states:
            assert time.monotonic() < deadline, f"job {job}: {info}\n{self.logs()}"
            time.sleep(0.3)
        return info

    def start_now(self, job: int) -> None:
        """A requeued job waits two minutes (SLURM's delay for a requeue); the tests don't."""
        self._run("scontrol", "update", f"JobId={job}", "StartTime=now")

    def scancel(self, job: int, *args: str) -> None:
        result = self._run("scancel", *args, str(job))
        assert result.returncode == 0, result.stderr

    def srun(self, *cmd: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env}
        return subprocess.run(["srun", *cmd], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
