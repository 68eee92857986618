"""Entry point: parse flags, find out who we are, set up the process group, train, tear down.

Works under every launcher (see the README); with `--nprocs N` and no launcher it starts N processes
itself with `torch.multiprocessing`.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .config import Config, parse_args
from .data import build_datasets, build_loader
from .distributed import (
    SetupError,
    World,
    assign_devices,
    cleanup,
    ddp_setup,
    describe_communication_failure,
    find_free_port,
    is_communication_failure,
    report_error,
    resolve_backend,
    resolve_init_method,
    resolve_world,
)
from .model import build_model
from .trainer import Trainer

STARTED_AT = time.time()  # when this process imported the code: the start of "time to first step"

# SIGTERM: torchrun, SLURM and Kubernetes stopping the job; SIGUSR1: SLURM's --signal warning.
STOP_SIGNALS = [signal.SIGTERM] + ([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else [])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def run(cfg: Config, world: World) -> dict:
    """Train as one process of `world`. The process group is always torn down, even on errors."""
    cuda_count = torch.cuda.device_count()
    backend = resolve_backend(cfg.backend, cuda_count, dist.is_nccl_available())
    devices = assign_devices(world.local_rank, world.local_world_size, cuda_count, cfg.model_layout,
                             cfg.stage_devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    init_url = ""
    try:
        init_url = ddp_setup(world, backend, cfg.init_method, cfg.timeout_s, devices,
                             rendezvous_dir=rendezvous_dir(cfg))
        if world.is_main:
            print(f"world: {world.world_size} process(es), launcher {world.launcher}, backend {backend}, "
                  f"rank 0 on {', '.join(map(str, devices))}", flush=True)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        seed_everything(cfg.seed)  # the same initial model on every rank
        train_set, val_set = build_datasets(cfg.data, cfg.dataset_size, cfg.seed, cfg.val_fraction)
        loader = build_loader(train_set, world.rank, world.world_size, cfg.batch_size, cfg.seed,
                              cfg.num_workers, pin_memory=devices[0].type == "cuda")
        model = build_model(cfg.model_layout, devices, cfg.hidden_size, cfg.num_layers, cfg.batch_norm)
        if cfg.sync_bn:
            if devices[0].type == "cuda":
                # Batch statistics over the global batch; only the CUDA kernels support it.
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            elif world.is_main:
                print("warning: --sync-bn needs CUDA; keeping per-process BatchNorm on CPU", file=sys.stderr,
                      flush=True)
        trainer = Trainer(cfg, world, model, loader, devices, backend, val_set, started_at=STARTED_AT)
        seed_everything(cfg.seed + world.rank)  # different random streams per rank from here on
        trainer.resume()
        for signum in STOP_SIGNALS:
            signal.signal(signum, trainer.request_stop)
        return trainer.train()
    except RuntimeError as exc:
        if world.world_size > 1 and is_communication_failure(exc):
            raise SetupError(describe_communication_failure(world, exc, cfg.timeout_s)) from exc
        raise
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        cleanup(init_url)


def rendezvous_dir(cfg: Config) -> Path:
    """Where `--init-method file` keeps its store file: under the output dir, which multi-node runs share."""
    return Path(cfg.output_dir) / "rendezvous"


def exit_process(code: int) -> NoReturn:
    """End a training process without Python's interpreter shutdown.

    torch keeps a process group used by DDP alive until the process ends, and gloo's worker threads
    can let go of a tensor while the interpreter is being torn down. That aborts a run that finished
    fine ("terminate called without an active exception", exit -6; torchrun then calls it a failure).
    By now everything is saved and closed: flush the output and leave.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawn_worker(index: int, cfg: Config, nprocs: int, port: int, run_id: str) -> None:
    world = World(rank=index, local_rank=index, world_size=nprocs, local_world_size=nprocs,
                  launcher="spawn", master_addr="127.0.0.1", master_port=port, run_id=run_id)
    try:
        run(cfg, world)
    except SetupError as exc:
        report_error(exc)
        exit_process(1)
    exit_process(0)


def spawn(cfg: Config) -> int:
    """Start `cfg.nprocs` processes on this machine. A free port is picked here, so parallel runs don't
    collide; if one child fails, the others are stopped and the run exits non-zero."""
    port = find_free_port()
    run_id = f"spawn-{uuid.uuid4().hex[:8]}"
    # Check --init-method once here (a stale file, a bad URL) rather than once per child.
    resolve_init_method(cfg.init_method, World(0, 0, cfg.nprocs, cfg.nprocs, "spawn", "127.0.0.1", port, run_id),
                        rendezvous_dir(cfg))
    try:
        mp.start_processes(_spawn_worker, args=(cfg, cfg.nprocs, port, run_id), nprocs=cfg.nprocs,
                           start_method="spawn")
    except mp.ProcessExitedException as exc:
        how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
        # Exit code 1 is a worker that already printed its own `error:` line.
        report_error(SetupError(f"worker {exc.error_index} {how}; the other workers were stopped",
                                quiet=exc.exit_code == 1))
        return 1
    except mp.ProcessRaisedException as exc:
        sys.stderr.write(f"{exc}\n")  # the child's traceback
        report_error(SetupError(f"worker {exc.error_index} failed: {str(exc).strip().splitlines()[-1]}"))
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        world = resolve_world(local_rank_flag=cfg.local_rank)
        if cfg.nprocs > 1:
            if world.launcher != "none":
                raise SetupError(f"--nprocs starts processes itself, but this one was started by {world.launcher}; "
                                 "drop --nprocs (the launcher sets the process count)")
            return spawn(cfg)
        run(cfg, world)
    except SetupError as exc:
        report_error(exc)
        return 1
    return 0
