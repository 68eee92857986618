"""How a replica group joins the others (fault_tolerance.py trains it): its place among them from
the environment, the lighthouse reached, and torchft's Manager started at an address the other
groups can reach."""

from __future__ import annotations

import contextlib
import http.server
import ipaddress
import logging
import os
import re
import socket
import time
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from .failures import RunFailure, UsageError
from .runtime import torch_private as private
from .runtime.environments import World
from .runtime.network import VARIABLES, route_to

INSTALL = 'pip install -e ".[ft]"'
START_IT = "start it (scripts/train_ft.sh lighthouse) or fix TORCHFT_LIGHTHOUSE"


@dataclass(frozen=True)
class Replicas:
    """This replica group's place among the others, from the environment."""

    group: int
    groups: int
    lighthouse: str
    min_replicas: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Replicas:
        lighthouse = env.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise UsageError("TORCHFT_LIGHTHOUSE is not set: start a lighthouse "
                             "(scripts/train_ft.sh lighthouse) and export its address, e.g. "
                             "TORCHFT_LIGHTHOUSE=http://localhost:29510", everywhere=True)
        lighthouse = lighthouse_address(lighthouse)
        numbers = {}
        for name, default in (("REPLICA_GROUP_ID", None), ("NUM_REPLICA_GROUPS", None),
                              ("TORCHFT_MIN_REPLICAS", "1")):
            value = env.get(name, default)
            if value is None or not value.isdigit():
                raise UsageError(f"{name}={value or ''!s} is not a whole number; set "
                                 "REPLICA_GROUP_ID (0, 1, ...) and NUM_REPLICA_GROUPS for each "
                                 "replica group", everywhere=True)
            numbers[name] = int(value)
        group, groups = numbers["REPLICA_GROUP_ID"], numbers["NUM_REPLICA_GROUPS"]
        if groups < 1:
            raise UsageError(f"NUM_REPLICA_GROUPS={groups}: there must be at least one replica "
                             "group; set it to how many groups train", everywhere=True)
        if not 0 <= group < groups:
            raise UsageError(f"REPLICA_GROUP_ID {group} is not below NUM_REPLICA_GROUPS "
                             f"{groups}; number the groups 0 to {groups - 1}", everywhere=True)
        return cls(group, groups, lighthouse, max(1, numbers["TORCHFT_MIN_REPLICAS"]))

    def share(self, world: World) -> tuple[int, int]:
        """This rank's share of the training data: the groups split it, then their ranks."""
        return self.group * world.world_size + world.rank, self.groups * world.world_size


def lighthouse_address(value: str) -> str:
    """TORCHFT_LIGHTHOUSE as torchft needs it, http://HOST:PORT (given `host:29510`, torchft waits
    out every timeout without a word): http:// is added to HOST:PORT, anything else is refused."""
    url = urlsplit(value.strip() if "://" in value else f"http://{value.strip()}")
    with contextlib.suppress(ValueError):  # a port that is not a number, or past 65535
        if (url.scheme == "http" and url.port and re.fullmatch(r"[\w.:-]+", url.hostname or "")
                and url.path in ("", "/") and not url.query + url.fragment):
            host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
            return f"http://{host}:{url.port}"
    raise UsageError(f"TORCHFT_LIGHTHOUSE={value} is not a lighthouse address: write "
                     "http://HOST:PORT, e.g. http://localhost:29510", everywhere=True)


def refuse_plain_run(env: Mapping[str, str]) -> None:
    """train.py with a replica group's variables set would train without torchft, silently."""
    if names := [name for name in ("REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE") if env.get(name)]:
        raise UsageError(f"{' and '.join(names)} set, but train.py trains without torchft: start "
                         "a replica group with train_ft.py (scripts/train_ft.sh group), or unset "
                         f"{'it' if len(names) == 1 else 'them'} for a plain run", everywhere=True)


def lighthouse_answers(lighthouse: str, timeout_s: float) -> bool:
    """Whether the lighthouse takes a connection, tried (saying so at once) until a little before
    --timeout-s, when the other ranks stop waiting for this one. torchft's Manager would say
    nothing until --timeout-s is out, and then only that a store lacks its address."""
    url, deadline = urlsplit(lighthouse), time.monotonic() + timeout_s - min(2.0, timeout_s / 4)
    said = False
    while True:
        try:
            left = max(0.1, min(3.0, deadline - time.monotonic()))  # a few seconds per try
            socket.create_connection((url.hostname, url.port), left).close()
            return True
        except OSError as exc:
            if not said:
                print(f"torchft: waiting for the lighthouse at {lighthouse} ({exc.strerror or exc})"
                      f", up to --timeout-s {timeout_s:g} s; {START_IT}", flush=True)
            said = True
        if time.monotonic() > deadline - 0.5:
            return False
        time.sleep(0.5)


def quiet_torchft(log_file: Path) -> None:
    """torchft's own messages (a line per quorum, per checkpoint request) go to `log_file`; the
    terminal keeps this project's lines."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
        logger.setLevel(logging.INFO if name in ("torchft", "torchft_errors") else logging.WARNING)
    # The checkpoint server (Python's http.server) writes every request it serves to stderr.
    http.server.BaseHTTPRequestHandler.log_message = lambda *args: None
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def reachable_address(replicas: Replicas, backend: str, env: MutableMapping[str, str]) -> str:
    """The address other groups reach this one at, and the interface the groups' allreduce uses.

    torchft advertises the host name, which many machines resolve to loopback (this one too:
    Debian maps it to 127.0.1.1), and gloo picks its interface the same way; then the groups on
    other machines cannot heal from this one, or reach it at all. The address that works is this
    machine's on the route to the lighthouse. With the lighthouse on this machine there is no such
    route: then the host name, or the interface set in GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME."""
    route = route_to(urlsplit(replicas.lighthouse).hostname or "")
    if route is None or route.loopback or not route.interface:
        return socket.gethostname()
    env.setdefault(VARIABLES[backend], route.interface)  # the user's choice wins
    return route.address


def checkpoint_transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint server (what a healing group reads a peer's state from), at
    `host` rather than at the host name."""
    from torchft.checkpointing import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            url = urlsplit(super().address())
            name = f"[{host}]" if ":" in host else host
            return url._replace(netloc=f"{name}:{url.port}").geturl()

    return Transport(timeout=timeout, num_chunks=0)


def group_store(world: World, device: torch.device, timeout_s: float,
                lighthouse: str) -> tuple[Any, int]:
    """A TCP store for the Manager, on a free port of rank 0 (the launcher's store may be a file,
    or be hidden, as under mp.spawn): the store on rank 0 (None elsewhere) and its port. Port 0
    tells every rank that the lighthouse never answered rank 0."""
    store, port = None, torch.zeros(1, dtype=torch.int64, device=device)
    if world.is_main and lighthouse_answers(lighthouse, timeout_s):
        store = dist.TCPStore(world.master_addr, 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        port[0] = store.port
    dist.broadcast(port, 0)
    if not port.item():
        raise UsageError(f"cannot reach the torchft lighthouse at {lighthouse} (no connection in "
                         f"--timeout-s {timeout_s:g} s); {START_IT}", everywhere=True)
    return store, int(port.item())


def start_manager(replicas: Replicas, world: World, backend: str, device: torch.device,
                  timeout_s: float) -> tuple[Any, Any]:
    """torchft's Manager for this rank, and the store it uses (keep it while the Manager runs).
    Quorums are synchronous (computed at the start of each step's backward), so a group heals
    before it trains, never in the middle of a step."""
    private.library_floor("torchft 0.2", "2.7", "fault_tolerance=torchft", INSTALL)
    try:
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
    except ImportError:
        raise UsageError(f"this project trains with torchft (fault_tolerance=torchft), but torchft "
                         f"is not installed: {INSTALL}", everywhere=True) from None
    store, port = group_store(world, device, timeout_s, replicas.lighthouse)
    host = reachable_address(replicas, backend, os.environ)
    # The other groups meet this one's ranks at its store: an address they can reach.
    store_host = host if is_loopback(world.master_addr) else world.master_addr
    timeout = timedelta(seconds=timeout_s)
    group = ProcessGroupNCCL(timeout=timeout) if backend == "nccl" else ProcessGroupGloo(timeout)
    try:
        return Manager(pg=group, load_state_dict=None, state_dict=None,
                       min_replica_size=replicas.min_replicas, use_async_quorum=False,
                       timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                       rank=world.rank, world_size=world.world_size, store_addr=store_host,
                       store_port=port, lighthouse_addr=replicas.lighthouse,
                       replica_id=f"replica_group_{replicas.group}", hostname=host,
                       checkpoint_transport=checkpoint_transport(host, timeout)), store
    except Exception as exc:
        if "connect" not in str(exc):
            raise RunFailure(f"torchft's Manager did not start ({first_line(exc)})",
                             everywhere=True) from None
        raise UsageError(f"cannot reach the torchft lighthouse at {replicas.lighthouse} "
                         f"({first_line(exc)}); {START_IT}", everywhere=True) from None


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def first_line(exc: BaseException) -> str:
    """The exception's gist: torchft's messages go on with advice after a ';'."""
    text = str(exc).strip()
    if isinstance(exc, TimeoutError) or "Timeout expired" in text:
        return "no answer within --timeout-s"
    return f"{type(exc).__name__}: {text.splitlines()[0].split(';')[0]}" if text else \
        type(exc).__name__
