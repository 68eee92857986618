"""Per-step fault tolerance with torchft: replica groups that keep training when one is lost.

A replica group is an ordinary job of this project (torchrun, any launcher, one or several nodes).
Every group holds a whole copy of the model; inside a group DDP averages the gradients as usual,
and torchft's Manager then averages them across the groups that are alive at this step. A group
that dies is dropped after the lighthouse's heartbeat timeout and the others go on; started again,
it heals: it copies the live state (model, optimizer, schedule, position) from a peer and joins
in. See docs/fault-tolerance.md.

Start it with train_ft.py instead of train.py, with these set in each group's environment:
    TORCHFT_LIGHTHOUSE    the lighthouse's address, e.g. http://host:29510
    REPLICA_GROUP_ID      this group's number, 0 .. NUM_REPLICA_GROUPS - 1
    NUM_REPLICA_GROUPS    how many groups the data is split between
    TORCHFT_MIN_REPLICAS  commit a step only with at least this many groups (default 1)
"""

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
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from . import main as entry
from . import task
from .config import Config, parse_args
from .data import ShardedBatchSampler
from .failures import ProjectError, RunFailure, UsageError, report_error
from .loop import Runtime, Trainer
from .optim import Optimization, schedule
from .parallel import parallelize
from .runtime.comm_hooks import register_comm_hook
from .runtime.environments import World
from .runtime.launch import start
from .runtime.lifeline import Lifeline
from .runtime.network import VARIABLES, route_to
from .runtime.rendezvous import collective_device

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
    if torch.__version__ < "2.7":  # torchft 0.2's own floor (TorchVersion compares as a version)
        raise UsageError(f"fault_tolerance=torchft needs torch 2.7 or later (torchft 0.2 requires "
                         f"it), not torch {torch.__version__}: upgrade torch, then {INSTALL}",
                         everywhere=True)
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
            raise RunFailure(f"torchft's Manager did not start ({_first_line(exc)})",
                             everywhere=True) from None
        raise UsageError(f"cannot reach the torchft lighthouse at {replicas.lighthouse} "
                         f"({_first_line(exc)}); {START_IT}", everywhere=True) from None


class FaultTolerantOptimization(Optimization):
    """Optimization whose update averages the gradients across the live replica groups and is
    taken only if every group of this step's quorum got that far (torchft's should_commit). A
    step that is not committed leaves the weights as they were and is not counted; its batch is
    lost."""

    def __init__(self, manager: Any, lighthouse: str, say: bool, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if len(self.optimizers) > 1:
            raise UsageError("train_ft.py takes one optimizer: task.configure_optimizer gives "
                             f"{len(self.optimizers)}; train several with train.py",
                             everywhere=True)
        self.manager, self.lighthouse, self.say = manager, lighthouse, say
        self.skipped_steps = 0
        self.participants = 0
        self.params = next(iter(self.params.values()))
        # All gradients in one buffer: one allreduce across the groups per step.
        self._flat = torch.empty(sum(p.numel() for p in self.params), device=self.params[0].device,
                                 dtype=self.params[0].dtype)
        self._committed = False
        self._in_step = False
        self._joined = False  # has this group had a quorum yet?

    def begin_step(self) -> None:
        """Join this step's quorum (at most once a step); heal from a peer if behind."""
        if self._in_step:
            return
        with self._lighthouse_errors():
            # Synchronous (use_async_quorum=False): a group that is behind heals here, before its
            # forward. Every group must use the same mode: a healing group counts itself in the
            # step's average in this mode and not in the other, so mixing them gives the groups
            # different weights.
            self.manager.start_quorum()
        self._in_step = self._joined = True

    @contextlib.contextmanager
    def _lighthouse_errors(self) -> Iterator[None]:
        """A quorum or commit that fails: the lighthouse (or this group's manager) is gone."""
        try:
            yield
        except ProjectError:
            raise
        except Exception as exc:
            if not self._joined:
                raise UsageError(f"cannot reach the torchft lighthouse at {self.lighthouse} "
                                 f"({_first_line(exc)}); {START_IT}", everywhere=True) from None
            raise RunFailure(f"lost the torchft lighthouse at {self.lighthouse} "
                             f"({_first_line(exc)}); restart it, then the replica groups (they "
                             "resume from their checkpoints)", everywhere=True) from None

    def backward(self, loss: torch.Tensor) -> None:
        self.begin_step()  # this step's quorum, before the gradients are exchanged
        super().backward(loss)

    def update(self, name: str | None = None) -> None:
        self.begin_step()
        flat, offset = self._flat, 0
        for p in self.params:
            part = flat[offset:offset + p.numel()]
            if p.grad is None:  # unused this step: no gradient, counts as zero
                part.zero_()
            else:
                part.copy_(p.grad.reshape(-1))
            offset += p.numel()
        with self._lighthouse_errors():
            self.manager.allreduce(flat).wait()  # the average over the groups of this step
            participants = self.manager.num_participants()
            commit = self.manager.should_commit()
        self._in_step = False
        if participants != self.participants and self.say:
            print(f"torchft: step {self.manager.current_step()}: {participants} replica "
                  "group(s) taking part", flush=True)
        self.participants = participants
        self._committed = commit
        if commit:
            offset = 0
            for p in self.params:
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            super().update(name)
            return
        # Not committed: no update, and the step does not count (the trainer's step stays equal
        # to the Manager's, which decides who is behind and heals).
        self.skipped_steps += 1
        self.optimizers[self.named(name)].zero_grad(set_to_none=True)

    def finish_step(self) -> bool:
        if self._committed or self._in_step:  # committed, or update() never called
            self._committed = False
            return super().finish_step()
        return False  # not committed: the step does not count

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "torchft": self.manager.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("torchft"):
            self.manager.load_state_dict(state["torchft"])


class Healing:
    """What a healing group copies from a peer: everything the result depends on."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.training = False  # set once the group trains: from then on it never falls behind

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {"model": t.unwrapped.state_dict(), "optimizer": t.optim.optimizers.state_dict(),
                "optim": Optimization.state_dict(t.optim),
                "selection": t.evaluation.selection.state_dict(),
                "position": [t.epoch, t.batch_in_epoch, t.step], "last_loss": t.metrics.last_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.trainer
        if self.training:  # it cannot rewind the loop it is in: start over, and heal at start
            raise RunFailure("this replica group fell behind the others (a step it could not "
                             "commit); restart it and it heals from them", everywhere=True)
        t.unwrapped.load_state_dict(state["model"])
        t.optim.optimizers.load_state_dict(state["optimizer"])
        Optimization.load_state_dict(t.optim, state["optim"])
        t.evaluation.selection.load_state_dict(state["selection"])
        t.epoch, t.batch_in_epoch, t.step = state["position"]
        t.metrics.last_loss = state["last_loss"]
        if t.world.is_main and t.step > 0:  # at step 0 every group takes the first's weights
            print(f"torchft: healed from a live replica group: epoch {t.epoch}, batch "
                  f"{t.batch_in_epoch}, step {t.step}", flush=True)


def build_replica_trainer(cfg: Config, world: World, backend: str, devices: list[torch.device],
                          lifeline: Lifeline, manager: Any,
                          replicas: Replicas) -> Trainer:
    """main.build_trainer for one replica group: the groups split the data, then their ranks, and
    the optimizer steps through torchft's Manager."""
    entry.prepare(cfg)
    train_set, val_set = entry.load_datasets(cfg)
    batches = ShardedBatchSampler(len(train_set), *replicas.share(world), cfg.batch_size,
                                  cfg.seed)
    data = entry.loaders(cfg, world, train_set, val_set, batches, devices[0],
                         collective_device(backend, devices[0]))
    model = parallelize(entry.build_model(cfg), cfg, devices, task, world.is_main,
                        world.local_world_size)  # data_parallel: DDP
    comm_hook = register_comm_hook(model, cfg)  # None without one
    cfg.total_steps = schedule(cfg, batches.size, batches.world_size)[1]  # read by task code
    optim = FaultTolerantOptimization(manager, replicas.lighthouse, world.is_main, model, cfg,
                                      devices[0], cfg.total_steps,
                                      configure=getattr(task, "configure_optimizer", None))
    trainer = Trainer(cfg, world, task, model, optim, data,
                      Runtime(devices[0], backend, lifeline, entry.STARTED_AT, comm_hook,
                              len(set(devices))))
    entry.seed_everything(cfg.seed + world.rank)  # different random streams per rank from here on
    return trainer


def refuse_unsupported(cfg: Config) -> None:
    """The settings a replica group cannot train with (yet)."""
    if cfg.model_layout != "data_parallel":
        raise UsageError(f"train_ft.py needs --model-layout data_parallel (torchft averages whole "
                         f"gradients across the replica groups), not {cfg.model_layout}",
                         everywhere=True)
    if cfg.ema_decay:
        raise UsageError("train_ft.py does not take --ema-decay yet: a replica group that heals "
                         "would not get the others' average; train without it", everywhere=True)
    if cfg.comm_hook == "powersgd":
        raise UsageError("train_ft.py does not take --comm-hook powersgd: its state (each rank's "
                         "error feedback) is not copied when a replica group heals, so the groups "
                         "would drift apart; use --comm-hook none, bf16 or fp16", everywhere=True)


def work_in_group(cfg: Config, world: World, backend: str, devices: list[torch.device],
                  lifeline: Lifeline) -> dict:
    """main.work for one replica group: the same loop, with torchft's step."""
    refuse_unsupported(cfg)
    replicas = Replicas.from_env(os.environ)
    quiet_torchft(Path(cfg.output_dir) / f"torchft-rank{world.rank}.log")
    if world.is_main:
        print(f"torchft: replica group {replicas.group} of {replicas.groups}, lighthouse "
              f"{replicas.lighthouse}", flush=True)
    with lifeline.waiting(f"the torchft lighthouse at {replicas.lighthouse}", START_IT,
                          phase="rendezvous"):
        manager, _store = start_manager(replicas, world, backend,
                                        collective_device(backend, devices[0]), cfg.timeout_s)
    try:
        trainer = build_replica_trainer(cfg, world, backend, devices, lifeline, manager,
                                        replicas)
        healing = Healing(trainer)
        manager.register_state_dict_fn("trainer", healing.load_state_dict, healing.state_dict)
        trainer.resume()  # this group's own newest checkpoint, with the Manager's step
        with lifeline.waiting(f"the other replica groups' quorum at {replicas.lighthouse}",
                              "check the lighthouse and the other groups", phase="rendezvous"):
            trainer.optim.begin_step()  # the first quorum: heals from a peer that is ahead
        healing.training = True
        summary = trainer.train()
        if world.is_main and trainer.optim.skipped_steps:
            print(f"torchft: {trainer.optim.skipped_steps} step(s) not committed (a replica "
                  "group dropped out during them)", flush=True)
        return summary
    finally:
        manager.shutdown(wait=False)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _first_line(exc: BaseException) -> str:
    """The exception's gist: torchft's messages go on with advice after a ';'."""
    text = str(exc).strip()
    if isinstance(exc, TimeoutError) or "Timeout expired" in text:
        return "no answer within --timeout-s"
    return f"{type(exc).__name__}: {text.splitlines()[0].split(';')[0]}" if text else \
        type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """train_ft.py: main.main, with each process running `work_in_group` above."""
    return start(parse_args(argv, getattr(task, "Settings", None)), work_in_group)


def plain_main(argv: list[str] | None = None) -> int:
    """train.py in a project with replica groups: main.main, refusing a replica group's
    variables (train_ft.py starts the groups)."""
    cfg = parse_args(argv, getattr(task, "Settings", None))
    try:
        refuse_plain_run(os.environ)
    except ProjectError as exc:
        report_error(exc)
        return 1
    return start(cfg, entry.work)
