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
SlurmctldHost={host}({controller})
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.socket
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
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
"""
NODE = "NodeName={name} NodeAddr={address} NodeHostname={name} CPUs={cpus} State=UNKNOWN\n"
PARTITION = "PartitionName=tests Nodes={names} Default=YES MaxTime=INFINITE State=UP\n"


class SlurmCluster:
    """One node: this machine under its own host name."""

    controller = "127.0.0.1"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        self.nodes = {self.host: "127.0.0.1"}  # name -> address

    def start_node(self, name: str) -> None:
        result = self._run("slurmd", "-f", str(self.conf), "-N", name)
        assert result.returncode == 0, f"slurmd: {result.stderr}"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        env = {**os.environ, **self.env}
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)

    def start(self) -> None:
        for sub in ("state", "spool"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        for name in self.nodes:
            (self.folder / "spool" / name).mkdir(exist_ok=True)
        self.folder.chmod(0o755)  # munged refuses a socket folder others may write to
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        f = self.folder
        subprocess.run(["munged", "--force", f"--socket={f}/munge.socket", f"--key-file={key}",
                        f"--log-file={f}/munged.log", f"--pid-file={f}/munged.pid",
                        f"--seed-file={f}/munged.seed"], check=True, timeout=30)
        cpus = os.sysconf("SC_NPROCESSORS_ONLN")
        self.conf.write_text(
            CONF.format(host=self.host, controller=self.controller, folder=f,
                        ctld_port=free_port(), d_port=free_port())
            + "".join(NODE.format(name=n, address=a, cpus=cpus) for n, a in self.nodes.items())
            + PARTITION.format(names=",".join(self.nodes)))
        result = self._run("slurmctld", "-f", str(self.conf))
        assert result.returncode == 0, f"slurmctld: {result.stderr}"
        for name in self.nodes:
            self.start_node(name)
        deadline = time.monotonic() + 60
        while set(self._run("sinfo", "-h", "-N", "-o", "%T").stdout.split()) != {"idle"}:
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.5)

    def stop(self) -> None:
        self._run("scancel", "--full", "--user=root")
        self._run("scontrol", "shutdown")
        pid_files = [f"slurmd-{name}.pid" for name in self.nodes]
        for pid_file in (*pid_files, "slurmctld.pid", "munged.pid"):
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


SUBNET = "192.168.78"  # the two nodes' LAN, on a bridge of this machine (.1: the controller)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"ip {' '.join(args)}: {result.stderr}"


def why_not_two_nodes() -> str | None:
    """Why two nodes in network namespaces cannot be made here, or None."""
    missing = [name for name in ("ip", "nsenter", "unshare") if shutil.which(name) is None]
    if missing:
        return f"two nodes need {', '.join(missing)} (apt-get install iproute2 util-linux)"
    return why_not()


class TwoNodeCluster(SlurmCluster):
    """Two nodes, `nodea` and `nodeb`, each a network namespace with its own address, host name
    and /etc/hosts, joined by a bridge on which this machine runs the controller. The nodes share
    the file system, as cluster nodes share storage.

    Each slurmd runs in its node's network namespace and in a mount and UTS namespace of its own
    (`unshare`), where its /etc/hosts and host name are bound; every job step inherits them.
    (`ip netns exec` would also remount /sys, which slurmd does not survive.)"""

    controller = f"{SUBNET}.1"

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.tag = os.urandom(3).hex()
        self.bridge = f"ddpsl{self.tag}"
        self.nodes = {"nodea": f"{SUBNET}.2", "nodeb": f"{SUBNET}.3"}

    def namespace(self, name: str) -> str:
        return f"{name}{self.tag}"

    def start(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.controller}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.nodes.items())
        for i, (name, address) in enumerate(self.nodes.items()):
            ns, port = self.namespace(name), f"{self.bridge}p{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", port, "master", self.bridge)
            _ip("link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            (self.folder / f"hosts-{name}").write_text(hosts)
        super().start()

    def start_node(self, name: str) -> None:
        inside = (f"mount --bind {self.folder}/hosts-{name} /etc/hosts && hostname {name} && "
                  f"exec slurmd -f {self.conf} -N {name}")
        result = self._run("nsenter", f"--net=/run/netns/{self.namespace(name)}", "unshare",
                           "--mount", "--uts", "--propagation", "private", "sh", "-c", inside)
        assert result.returncode == 0, f"slurmd on {name}: {result.stderr}"

    def stop(self) -> None:
        super().stop()
        time.sleep(1)
        for name in self.nodes:
            ns = self.namespace(name)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:  # whatever a job left behind
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
