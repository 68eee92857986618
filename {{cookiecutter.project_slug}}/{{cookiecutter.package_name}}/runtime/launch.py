"""How a process joins its run and leaves it: the set-up training, the doctor and every other entry
point share (`joined`), and the processes `--nprocs N` starts when no launcher did (`start`)."""

from __future__ import annotations

import os
import signal
import sys
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import failures
from ..config import Config
from ..failures import LostContact, ProjectError, RunFailure, UsageError, kind_name, report_error
from . import rendezvous
from .environments import World, find_free_port, resolve_world
from .lifeline import STOP_SIGNALS, Lifeline, keep_torch_messages_in
from .nccl import flight_recorder_hint, nccl_env, startup_timeout_s
from .network import Route, route_to, socket_interface_env
from .rendezvous import Rendezvous, assign_devices, cleanup, ddp_setup, resolve_rendezvous
from .workarounds import exit_process, stop_agent_if_store_lost, stop_stuck_agent
from .workers import worker_context

# What each process runs once it joined its group (main.work trains): the flags, the world, the
# backend, this process's devices and its lifeline in; the run's summary out.
Work = Callable[[Config, World, str, list[torch.device], Lifeline], dict]


def crash_hint(exc: Exception) -> str | None:
    """What a launcher knows of a crash in task.py, said after its traceback: none here; a
    launcher whose workers start in another environment than its own sets its own."""
    return None


def rendezvous_dir(cfg: Config) -> Path:
    """Where --init-method file keeps its store: the output dir, which multi-node runs share."""
    return Path(cfg.output_dir) / "rendezvous"


def launcher_pid(world: World) -> int:
    """The process whose end ends this one: torchrun's agent, the mp.spawn parent, srun's step
    daemon. 0 for a process started by hand (`nohup python train.py` may outlive its shell)."""
    managed = world.launcher in ("spawn", "slurm") or "TORCHELASTIC_RUN_ID" in os.environ
    return os.getppid() if managed else 0


def torchrun_agent_of_a_multinode_job(world: World) -> int:
    """The pid of torchrun's agent where this node is one of several, else 0."""
    several = world.launcher == "torchrun" and world.world_size > world.local_world_size
    return launcher_pid(world) if several else 0


@dataclass
class Setup:
    """What a process works out before it joins its group; while joined, its lifeline and store."""

    backend: str
    devices: list[torch.device]
    rdzv: Rendezvous
    route: Route | None  # to the head node; None in a world of one
    network: str  # the interface the group uses, and why ("" when nothing needed choosing)
    lifeline: Lifeline | None = None
    store: Any = None


def resolve(cfg: Config, world: World) -> Setup:
    """Backend, devices and rendezvous from the flags, and the variables the process group reads
    when it starts (NCCL's settings, the network interface) set; no process group yet."""
    cuda_count = torch.cuda.device_count()
    backend = (dist.get_backend() if dist.is_initialized()  # the launcher made the group
               else rendezvous.resolve_backend(cfg.backend, cuda_count, dist.is_nccl_available()))
    devices = assign_devices(world.local_rank, world.local_world_size, cuda_count, cfg.model_layout,
                             cfg.stage_devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    rdzv = resolve_rendezvous(cfg.init_method, world, rendezvous_dir(cfg))
    if backend == "nccl":
        os.environ.update(nccl_env(cfg.output_dir, os.environ))
    master = rdzv.host or world.master_addr
    route = route_to(master) if world.world_size > 1 else None
    interface, network = socket_interface_env(backend, route, master, os.environ)
    os.environ.update(interface)  # before the process group starts: gloo reads it then
    return Setup(backend, devices, rdzv, route, network)


@contextmanager
def joined(cfg: Config, world: World, setup: Setup | None = None,
           workers: bool = False) -> Iterator[Setup]:
    """This process in its group for the `with` block, and out of it after, even on errors. The
    lifeline (deadlines, signals) starts first; `workers`: the data workers' server starts now."""
    lifeline = Lifeline(world.rank, cfg.timeout_s, cfg.output_dir,  # signals count from here on
                        launcher_pid(world)).start()
    if agent := torchrun_agent_of_a_multinode_job(world):  # a deadline may end this process
        lifeline.cleanups.append(
            lambda: stop_agent_if_store_lost(agent, world.master_addr, world.master_port))
    # After the watchdog started (it keeps the terminal for its own lines).
    keep_torch_messages_in(Path(cfg.output_dir) / f"torch-rank{world.rank}.log")
    if workers:
        worker_context()
    store = None
    try:
        setup = setup or resolve(cfg, world)
        store = ddp_setup(world, setup.backend, setup.rdzv,
                          startup_timeout_s(cfg.timeout_s, setup.backend), setup.devices, lifeline)
        if world.is_main:
            print(f"world: {world.world_size} process(es), launcher {world.launcher}, backend "
                  f"{setup.backend}, layout {cfg.model_layout}, rank 0 on "
                  f"{', '.join(map(str, setup.devices))}"
                  + (f", network {setup.network}" if setup.network else ""), flush=True)
        setup.lifeline, setup.store = lifeline, store
        yield setup
    finally:
        with lifeline.waiting("the process group to shut down", "see the other ranks' output",
                              phase="shutdown"):
            cleanup(store, setup.rdzv if setup else None)
        lifeline.close()


def run(cfg: Config, world: World, work: Work) -> dict:
    """`work` as one process of `world`, in its process group. This rank's own failure is left
    for the others to read; one it learned of through a collective is explained from theirs."""
    with joined(cfg, world, workers=cfg.num_workers > 0) as setup:
        route, lifeline = setup.route, setup.lifeline
        peers = failures.PeerErrors(setup.store, world.rank, world.world_size,
                                    route.address if route and not route.loopback else "",
                                    f" at {setup.rdzv.address}" if setup.rdzv.port else "")
        peers.announce()
        try:
            return work(cfg, world, setup.backend, setup.devices, lifeline)
        except ProjectError as exc:
            if not (exc.quiet or exc.everywhere):
                peers.record(str(exc), kind_name(exc))  # this rank's own: tell the others why
            raise
        except Exception as exc:
            if world.world_size > 1 and failures.is_communication_failure(exc):
                with lifeline.waiting("the job's store, to learn why the others stopped",
                                      "see the other ranks' output", phase="error reporting"):
                    error = peers.explain(exc, cfg.timeout_s)
                if setup.backend == "nccl":  # the same class: LostContact stays LostContact
                    error = type(error)(f"{error}; {flight_recorder_hint(cfg.output_dir)}",
                                        quiet=error.quiet)
                raise error from exc
            # A crash, not a known failure: the others learn of it as a RunFailure.
            peers.record(f"{type(exc).__name__}: {exc}".splitlines()[0], kind_name(exc))
            raise


def run_and_report(cfg: Config, world: World, work: Work) -> int:
    """`run`'s exit code (1 for a failure). A run stopped by a signal saved a checkpoint and exits
    with 128 + its number (130 for Ctrl-C, 143 for SIGTERM), so `train && next` does not go on."""
    try:
        result = run(cfg, world, work)
    except ProjectError as exc:
        agent = torchrun_agent_of_a_multinode_job(world)
        if isinstance(exc, LostContact) and agent:
            report_error(LostContact(f"{exc}. torchrun's agent on this node was stopped too: it "
                                     "waits on that store with no timeout"), world.local_rank)
            stop_stuck_agent(agent)
        else:
            report_error(exc, world.local_rank)
            if agent:
                stop_agent_if_store_lost(agent, world.master_addr, world.master_port)
        return 1
    except Exception as exc:
        traceback.print_exc()  # a bug, not a known failure: the whole story
        if hint := crash_hint(exc):
            print(f"error: {hint}", file=sys.stderr, flush=True)
        return 1
    return result.get("exit_code", 0)


def start(cfg: Config, work: Work) -> int:
    """Run `work` here (launched or alone) or in `--nprocs` new processes; returns the exit code."""
    try:
        world = resolve_world(local_rank_flag=cfg.local_rank)
        if cfg.nprocs > 1:
            if world.launcher != "none":
                raise UsageError(f"--nprocs starts processes itself, but this one was started by "
                                 f"{world.launcher}; drop --nprocs (the launcher sets the process "
                                 "count)", everywhere=True)
            return spawn(cfg, work)
    except ProjectError as exc:
        report_error(exc)
        return 1
    return run_and_report(cfg, world, work)


def _spawn_worker(index: int, cfg: Config, world: World, work: Work) -> None:
    exit_process(run_and_report(cfg, replace(world, rank=index, local_rank=index), work))


def spawn(cfg: Config, work: Work) -> int:
    """Start `cfg.nprocs` processes here, on a free port (parallel runs don't collide)."""
    world = World(0, 0, cfg.nprocs, cfg.nprocs, "spawn", "127.0.0.1", find_free_port(),
                  f"spawn-{uuid.uuid4().hex[:8]}")  # rank 0's; each worker takes its own rank
    # Check --init-method once here (a stale file, a bad URL) rather than once per child.
    resolve_rendezvous(cfg.init_method, world, rendezvous_dir(cfg))
    context = mp.start_processes(_spawn_worker, args=(cfg, world, work), nprocs=cfg.nprocs,
                                 join=False, start_method="spawn")
    stop: list[int] = []

    def forward(signum: int, frame: Any) -> None:  # the workers stop, save and exit themselves
        stop.append(signum)
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
    try:
        return _wait_for_workers(context.processes, stop)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _wait_for_workers(processes: list, stop: list[int]) -> int:
    """Wait for every worker. One that fails stops the others (torch's `join` would also stop a
    stopped run's workers as they save); a stopped run exits as a worker did: 128 + the signal."""
    waiting = {process.sentinel: index for index, process in enumerate(processes)}
    while waiting:
        for sentinel in mp_connection.wait(list(waiting)):
            index = waiting.pop(sentinel)
            processes[index].join()
            code = processes[index].exitcode
            if code == 0 or (stop and code - 128 in STOP_SIGNALS):  # stopped and saved
                continue
            if code == 1:  # it printed its error; the others may be about to print theirs
                mp_connection.wait(list(waiting), timeout=failures.QUIET_EXIT_DELAY_S * 3)
            for process in processes:
                if process.is_alive():
                    process.terminate()
            how = (f"was killed by {signal.Signals(-code).name}" if code < 0
                   else f"exited with code {code}")
            if code != 1:  # exit code 1: a worker that printed its own `error:` line
                report_error(RunFailure(f"worker {index} {how}; the other workers were stopped"))
            for process in processes:
                process.join()
            return 1
    return 128 + stop[0] if stop else 0
