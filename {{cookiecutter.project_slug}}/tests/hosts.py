"""Test hosts on a real network, made on this machine with Linux network namespaces.

Each host is a namespace with its own loopback and one interface, `eth0`, on a bridge that joins
them (in a namespace of its own): a small LAN whose addresses exist nowhere else, so test traffic
never leaves this machine. The hosts share the file system, as nodes on shared storage do. Their
host name is this machine's, which resolves to a loopback address: the case that trips gloo.

    with TestHosts(2) as hosts:
        hosts[1].link("down")                       # a partition: host 1 drops off the network
        hosts[0].popen(["python", "train.py"], ...)  # a process on host 0

Needs root and `ip` (iproute2); `available()` says why not otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid

SUBNET = "192.168.77"  # the hosts' LAN: 192.168.77.1, .2, ...; nothing outside the namespaces
UNUSED_ADDRESS = f"{SUBNET}.99"  # on the LAN, held by no host: a store that never answers


def available() -> str | None:
    """None when test hosts can be made here, else why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need `ip` (apt-get install iproute2)"
    probe = f"ddpprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


class Host:
    def __init__(self, namespace: str, address: str) -> None:
        self.namespace, self.address = namespace, address

    def command(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *cmd]

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(cmd), **kwargs)

    def run(self, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(cmd), **kwargs)

    def link(self, state: str) -> None:
        """`down`: the host drops off the network (its processes live on); `up`: it is back."""
        _ip("-n", self.namespace, "link", "set", "eth0", state)

    def pids(self) -> list[int]:
        """Processes running on this host (zombies included)."""
        out = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True,
                             text=True).stdout
        return [int(pid) for pid in out.split()]


class TestHosts:
    """`count` hosts on one bridge; everything is removed on exit, processes included."""

    __test__ = False  # not a test class, whatever pytest thinks of its name

    def __init__(self, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.switch = f"ddpsw{tag}"
        self.hosts = [Host(f"ddph{i}{tag}", f"{SUBNET}.{i + 1}") for i in range(count)]
        self._tag = tag

    def __enter__(self) -> list[Host]:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                port, nic = f"s{i}{self._tag}", f"h{i}{self._tag}"
                _ip("netns", "add", host.namespace)
                _ip("link", "add", port, "type", "veth", "peer", "name", nic)
                _ip("link", "set", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("link", "set", nic, "netns", host.namespace)
                _ip("-n", host.namespace, "link", "set", nic, "name", "eth0")
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.namespace, "link", "set", "eth0", "up")
                _ip("-n", host.namespace, "link", "set", "lo", "up")
        except Exception:
            self.__exit__()
            raise
        return self.hosts

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts:
            for pid in host.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for name in [h.namespace for h in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
