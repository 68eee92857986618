"""Entry point: parse the flags, start the run's processes (runtime/launch.py: find out who we are,
join the process group), assemble the parts, train.

Works under every launcher (see the README); with `--nprocs N` and no launcher it starts N
processes itself with `torch.multiprocessing`."""

from __future__ import annotations

import os
import random
import re
import time
from contextlib import suppress
from typing import Any

import torch

from . import task
from .config import SHARDED, Config, parse_args
from .data import ShardedBatchSampler, build_loader, place_on_device, validation_batches
from .evaluation import Evaluator
from .failures import RunFailure, UsageError
from .loop import Data, Runtime, Trainer
from .meters import human_size
from .optim import Optimization, schedule
from .parallel import parallelize
from .runtime.comm_hooks import register_comm_hook
from .runtime.environments import World
from .runtime.launch import start
from .runtime.lifeline import Lifeline
from .runtime.rendezvous import collective_device
from .runtime.workarounds import exit_process

STARTED_AT = time.time()  # when this process imported the code: the start of "time to first step"


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and train: `work` in each process of the run. Returns the exit code."""
    return start(parse_args(argv, getattr(task, "Settings", None)), work)


def work(cfg: Config, world: World, backend: str, devices: list[torch.device],
         lifeline: Lifeline) -> dict:
    """Everything after joining the process group: data, model, optimizer, Trainer."""
    trainer = build_trainer(cfg, world, backend, devices, lifeline)
    trainer.resume()
    return trainer.train()


def build_trainer(cfg: Config, world: World, backend: str, devices: list[torch.device],
                  lifeline: Lifeline) -> Trainer:
    """Data, model, optimizer and the Trainer around them."""
    prepare(cfg)
    train_set, val_set = load_datasets(cfg)
    batches = ShardedBatchSampler(len(train_set), world.rank, world.world_size, cfg.batch_size,
                                  cfg.seed, order=getattr(train_set, "epoch_order", None))
    data = loaders(cfg, world, train_set, val_set, batches, devices[0],
                   collective_device(backend, devices[0]))
    model = parallelize(build_model(cfg), cfg, devices, task, world.is_main,
                        world.local_world_size)  # placed by --model-layout
    comm_hook = register_comm_hook(model, cfg)  # None without one
    cfg.total_steps = schedule(cfg, len(train_set), world.world_size)[1]  # read by task code
    # fsdp (and tensor_parallel's) on a GPU casts through its mixed-precision policy, not autocast.
    optim = Optimization(model, cfg, devices[0], cfg.total_steps,
                         autocast=not (cfg.model_layout in SHARDED and devices[0].type == "cuda"),
                         configure=getattr(task, "configure_optimizer", None))
    trainer = Trainer(cfg, world, task, model, optim, data,
                      Runtime(devices[0], backend, lifeline, STARTED_AT, comm_hook,
                              len(set(devices))))
    seed_everything(cfg.seed + world.rank)  # different random streams per rank from here on
    return trainer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def prepare(cfg: Config) -> None:
    """--deterministic, and the seed: the same data and the same initial model on every rank."""
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    seed_everything(cfg.seed)


def load_datasets(cfg: Config) -> tuple[Any, Any]:
    """task.build_datasets: (training set, validation set or None); an empty one is refused."""
    train_set, val_set = task.build_datasets(cfg)
    if len(train_set) == 0:
        raise UsageError("task.build_datasets returned an empty training set", everywhere=True)
    return train_set, val_set


def loaders(cfg: Config, world: World, train_set: Any, val_set: Any, batches: Any,
            device: torch.device, comm_device: torch.device) -> Data:
    """The loader of `batches` of the training set, and the evaluator of this rank's share of
    the validation set (None without one)."""
    collate = getattr(task, "collate", None)
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
        request = human_size(float(request.split()[0]))
    what = f" (the allocator was asked for {request} at once)" if request else ""
    # The same model without memory, to count its parameters (if task.build_model runs there).
    with suppress(Exception), torch.device("meta"):
        count = sum(p.numel() for p in task.build_model(cfg).parameters())
        what += (f": the model has {count:,} parameters, {human_size(4 * count)} in fp32 before "
                 "gradients and optimizer state")
    raise RunFailure(f"task.build_model: out of memory{what}; build a smaller model (e.g. "
                     "--hidden-size, --num-layers)", everywhere=True)


if __name__ == "__main__":
    exit_process(main())
