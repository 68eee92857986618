"""Entry point: parse flags, find out who we are, join the process group, assemble the parts, train.

Works under every launcher (see the README); with `--nprocs N` and no launcher it starts N
processes itself with `torch.multiprocessing`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import re
import signal
import time
import traceback
import uuid
from collections.abc import Callable
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import task
from .config import Config, parse_args
from .data import (
    ShardedBatchSampler,
    build_loader,
    place_on_device,
    validation_batches,
)
from .evaluation import Evaluator
from .failures import (
    QUIET_EXIT_DELAY_S,
    LostContact,
    PeerErrors,
    SetupError,
    is_communication_failure,
    keep_torch_messages_in,
    report_error,
)
from .optim import Optimization
from .parallel import parallelize
from .runtime.comm_hooks import register_comm_hook
from .runtime.environments import World, find_free_port, resolve_world
from .runtime.lifeline import STOP_SIGNALS, Lifeline
from .runtime.nccl import flight_recorder_hint, nccl_env, startup_timeout_s
from .runtime.network import route_to, socket_interface_env
from .runtime.rendezvous import (
    assign_devices,
    cleanup,
    collective_device,
    ddp_setup,
    resolve_backend,
    resolve_rendezvous,
)
from .runtime.workarounds import exit_process, stop_stuck_agent
from .runtime.workers import worker_context
from .trainer import Data, Runtime, Trainer

STARTED_AT = time.time()  # when this process imported the code: the start of "time to first step"
# What a process runs once its process group started: train_on, or another function that builds
# the Trainer with other parts and calls main with it (your own entry script can).
TrainFn = Callable[[Config, World, str, list[torch.device], Lifeline], dict]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def rendezvous_dir(cfg: Config) -> Path:
    """Where `--init-method file` keeps its store file: under the output dir, which multi-node
    runs share."""
    return Path(cfg.output_dir) / "rendezvous"


def build_data(cfg: Config, world: World, device: torch.device, comm_device: torch.device,
               share: tuple[int, int] | None = None) -> Data:
    """task.build_datasets, sharded: this rank's batches (share `index` of `count`, by default
    rank of world size), their loader, and the evaluator of the validation set (None without
    one)."""
    train_set, val_set = task.build_datasets(cfg)
    if len(train_set) == 0:
        raise SetupError("task.build_datasets returned an empty training set", everywhere=True)
    collate = getattr(task, "collate", None)
    index, count = share or (world.rank, world.world_size)
    batches = ShardedBatchSampler(len(train_set), index, count, cfg.batch_size, cfg.seed)
    summary = dict(getattr(train_set, "summary", {}))
    train_set, val_set = place_on_device([train_set, val_set], device, cfg.num_workers,
                                         cfg.data_on_device)
    loader = build_loader(train_set, batches, collate, cfg.num_workers, device)
    evaluator = None
    if val_set is not None and len(val_set) > 0:
        val_batches = validation_batches(len(val_set), world.rank, world.world_size,
                                         cfg.batch_size, cfg.seed)
        val_loader = build_loader(val_set, val_batches, collate, cfg.num_workers, device)
        evaluator = Evaluator(task, val_loader, val_batches, device, comm_device)
    # A training set may carry a `summary` dict (e.g. files it left out): it goes in summary.json.
    return Data(batches, loader, evaluator, summary)


def train_on(cfg: Config, world: World, backend: str, devices: list[torch.device],
             lifeline: Lifeline) -> dict:
    """Everything after joining the process group: data, model, optimizer, Trainer."""
    trainer = build_trainer(cfg, world, backend, devices, lifeline)
    trainer.resume()
    return trainer.train()


def build_trainer(cfg: Config, world: World, backend: str, devices: list[torch.device],
                  lifeline: Lifeline, share: tuple[int, int] | None = None,
                  optimization: Callable[..., Optimization] = Optimization) -> Trainer:
    """Data, model, optimizer and the Trainer around them. `share` is (index, count) of this
    rank's share of the training data when it is not (rank, world size)."""
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    seed_everything(cfg.seed)  # the same data and the same initial model on every rank
    data = build_data(cfg, world, devices[0], collective_device(backend, devices[0]), share)
    model = parallelize(build_model(cfg), cfg, devices, task, world.is_main,
                        world.local_world_size)
    comm_hook = register_comm_hook(model, cfg)
    steps_per_epoch = math.ceil(data.batches.batches_per_epoch() / cfg.grad_accum)
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    # fsdp on a GPU casts through its mixed-precision policy instead of autocast.
    autocast = not (cfg.model_layout == "fsdp" and devices[0].type == "cuda")
    optim = optimization(model, cfg, devices[0], total_steps, autocast=autocast,
                         configure=getattr(task, "configure_optimizer", None))
    trainer = Trainer(cfg, world, task, model, optim, data,
                      Runtime(devices[0], backend, lifeline, STARTED_AT, comm_hook,
                              len(set(devices))))
    seed_everything(cfg.seed + world.rank)  # different random streams per rank from here on
    return trainer


def build_model(cfg: Config) -> torch.nn.Module:
    """task.build_model; a model too large for memory is one line with its size."""
    try:
        return task.build_model(cfg)
    except RuntimeError as exc:  # torch.OutOfMemoryError too; the CPU allocator's has no type
        asked = re.search(r"[Tt]ried to allocate ([\d.]+ ?\w+)", str(exc))
        if not (isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)):
            raise
    request = asked.group(1) if asked else ""
    if request.endswith("bytes"):
        request = _size(float(request.split()[0]))
    what = f" (the allocator was asked for {request} at once)" if request else ""
    try:
        with torch.device("meta"):  # the same model without memory, to count its parameters
            count = sum(p.numel() for p in task.build_model(cfg).parameters())
        what += (f": the model has {count:,} parameters, {_size(4 * count)} in fp32 before "
                 "gradients and optimizer state")
    except Exception:  # a task.build_model that cannot run on the meta device
        pass
    raise SetupError(f"task.build_model: out of memory{what}; build a smaller model (e.g. "
                     "--hidden-size, --num-layers)", everywhere=True)


def _size(n_bytes: float) -> str:
    units = ["bytes", "KB", "MB", "GB", "TB"]
    while n_bytes >= 1000 and len(units) > 1:
        n_bytes, units = n_bytes / 1000, units[1:]
    return f"{n_bytes:.3g} {units[0]}"


def launcher_pid(world: World) -> int:
    """The process whose end ends this one: torchrun's agent, the mp.spawn parent, srun's step
    daemon. 0 for a process started by hand (`nohup python train.py` may outlive its shell)."""
    managed = world.launcher in ("spawn", "slurm") or "TORCHELASTIC_RUN_ID" in os.environ
    return os.getppid() if managed else 0


def run(cfg: Config, world: World, train_fn: TrainFn = train_on) -> dict:
    """Train as one process of `world` (`train_fn` does the training after the process group
    started). The process group is always left, even on errors."""
    lifeline = Lifeline(world.rank, cfg.timeout_s, cfg.output_dir,  # signals count from here on
                        launcher_pid(world)).start()
    # After the watchdog started (it keeps the terminal for its own lines).
    keep_torch_messages_in(Path(cfg.output_dir) / f"torch-rank{world.rank}.log")
    if cfg.num_workers > 0:
        worker_context()  # the data workers' server starts its imports now
    store = rdzv = None
    try:
        cuda_count = torch.cuda.device_count()
        backend = resolve_backend(cfg.backend, cuda_count, dist.is_nccl_available())
        devices = assign_devices(world.local_rank, world.local_world_size, cuda_count,
                                 cfg.model_layout, cfg.stage_devices,
                                 os.environ.get("CUDA_VISIBLE_DEVICES"))
        rdzv = resolve_rendezvous(cfg.init_method, world, rendezvous_dir(cfg))
        if backend == "nccl":
            os.environ.update(nccl_env(cfg.output_dir, os.environ))
        master = rdzv.host or world.master_addr
        route = route_to(master) if world.world_size > 1 else None
        interface, network = socket_interface_env(backend, route, master, os.environ)
        os.environ.update(interface)  # before the process group starts: gloo reads it then
        store = ddp_setup(world, backend, rdzv, startup_timeout_s(cfg.timeout_s, backend),
                          devices, lifeline)
        if world.is_main:
            print(f"world: {world.world_size} process(es), launcher {world.launcher}, backend "
                  f"{backend}, layout {cfg.model_layout}, rank 0 on "
                  f"{', '.join(map(str, devices))}" + (f", network {network}" if network else ""),
                  flush=True)
        peers = PeerErrors(store, world.rank, world.world_size,
                           route.address if route and not route.loopback else "",
                           f" at {rdzv.address}" if rdzv.port else "")
        peers.announce()
        try:
            return train_fn(cfg, world, backend, devices, lifeline)
        except SetupError as exc:
            if not (exc.quiet or exc.everywhere):
                peers.record(str(exc))  # this rank's own problem: tell the others why
            raise
        except Exception as exc:
            if world.world_size > 1 and is_communication_failure(exc):
                with lifeline.waiting("the job's store, to learn why the others stopped",
                                      "see the other ranks' output", phase="error reporting"):
                    error = peers.explain(exc, cfg.timeout_s)
                if backend == "nccl":
                    error = SetupError(f"{error}; {flight_recorder_hint(cfg.output_dir)}",
                                       quiet=error.quiet)
                raise error from exc
            peers.record(f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise
    finally:
        with lifeline.waiting("the process group to shut down", "see the other ranks' output",
                              phase="shutdown"):
            cleanup(store, rdzv)
        lifeline.close()


def run_and_report(cfg: Config, world: World, train_fn: TrainFn = train_on) -> int:
    """`run`, with every failure turned into an exit code (the process then ends through
    `exit_process`). A run stopped by a signal saved a checkpoint and ends with 128 + the
    signal's number (130 for Ctrl-C, 143 for SIGTERM), so `train && next` does not go on."""
    try:
        result = run(cfg, world, train_fn)
    except SetupError as exc:
        agent = launcher_pid(world) if world.launcher == "torchrun" else 0
        if isinstance(exc, LostContact) and agent and world.world_size > world.local_world_size:
            report_error(LostContact(f"{exc}. torchrun's agent on this node was stopped too: it "
                                     "waits on that store with no timeout"), world.local_rank)
            stop_stuck_agent(agent)
        else:
            report_error(exc, world.local_rank)
        return 1
    except Exception:
        traceback.print_exc()  # a bug, not a known failure: the whole story
        return 1
    return result.get("exit_code", 0)


def _spawn_worker(index: int, cfg: Config, nprocs: int, port: int, run_id: str,
                  train_fn: TrainFn) -> None:
    world = World(rank=index, local_rank=index, world_size=nprocs, local_world_size=nprocs,
                  launcher="spawn", master_addr="127.0.0.1", master_port=port, run_id=run_id)
    exit_process(run_and_report(cfg, world, train_fn))


def spawn(cfg: Config, train_fn: TrainFn = train_on) -> int:
    """Start `cfg.nprocs` processes on this machine. A free port is picked here, so parallel runs
    don't collide; if one child fails, the others are stopped and the run exits non-zero."""
    port = find_free_port()
    run_id = f"spawn-{uuid.uuid4().hex[:8]}"
    # Check --init-method once here (a stale file, a bad URL) rather than once per child.
    resolve_rendezvous(cfg.init_method, World(0, 0, cfg.nprocs, cfg.nprocs, "spawn", "127.0.0.1",
                                              port, run_id), rendezvous_dir(cfg))
    context = mp.start_processes(_spawn_worker, args=(cfg, cfg.nprocs, port, run_id, train_fn),
                                 nprocs=cfg.nprocs, join=False, start_method="spawn")

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
    """Wait for every worker. One that fails stops the others (not torch's `join`, which would
    also stop the workers of a stopped run while they save); a stopped run exits as a worker
    did: 128 + the signal."""
    waiting = {process.sentinel: index for index, process in enumerate(processes)}
    while waiting:
        for sentinel in mp_connection.wait(list(waiting)):
            index = waiting.pop(sentinel)
            processes[index].join()
            code = processes[index].exitcode
            if code == 0 or (stop and code - 128 in STOP_SIGNALS):  # stopped and saved
                continue
            if code == 1:  # it printed its error; the others may be about to print theirs
                mp_connection.wait(list(waiting), timeout=QUIET_EXIT_DELAY_S * 3)
            for process in processes:
                if process.is_alive():
                    process.terminate()
            how = (f"was killed by {signal.Signals(-code).name}" if code < 0
                   else f"exited with code {code}")
            if code != 1:  # exit code 1: a worker that printed its own `error:` line
                report_error(SetupError(f"worker {index} {how}; the other workers were "
                                        "stopped"))
            for process in processes:
                process.join()
            return 1
    return 128 + stop[0] if stop else 0


def main(argv: list[str] | None = None, train_fn: TrainFn = train_on) -> int:
    """Parse the flags and train (`train_fn`: what each process runs once its group started)."""
    cfg = parse_args(argv, getattr(task, "Settings", None))
    try:
        # Projects made with replica groups start them with their own entry point: a plain run
        # refuses their variables.
        if train_fn is train_on and importlib.util.find_spec(f"{__package__}.fault_tolerance"):
            importlib.import_module(f"{__package__}.fault_tolerance").refuse_plain_run(os.environ)
        world = resolve_world(local_rank_flag=cfg.local_rank)
        if cfg.nprocs > 1:
            if world.launcher != "none":
                raise SetupError(f"--nprocs starts processes itself, but this one was started by "
                                 f"{world.launcher}; drop --nprocs (the launcher sets the process "
                                 "count)", everywhere=True)
            return spawn(cfg, train_fn)
    except SetupError as exc:
        report_error(exc)
        return 1
    return run_and_report(cfg, world, train_fn)


if __name__ == "__main__":
    exit_process(main())
