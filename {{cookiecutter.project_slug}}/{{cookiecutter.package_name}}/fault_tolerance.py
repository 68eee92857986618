"""Per-step fault tolerance with torchft: replica groups that keep training when one is lost.

A replica group is an ordinary job of this project (torchrun, any launcher, one or several nodes).
Every group holds a whole copy of the model; inside a group DDP averages the gradients as usual,
and torchft's Manager then averages them across the groups that are alive at this step. A group
that dies is dropped after the lighthouse's heartbeat timeout and the others go on; started again,
it heals: it copies the live state (model, optimizer, schedule, position) from a peer and joins
in. See docs/fault-tolerance.md. Here: train_ft.py's main, the step and healing;
replica_groups.py: how a group finds the others and starts torchft's Manager.

Start it with train_ft.py instead of train.py, with these set in each group's environment:
    TORCHFT_LIGHTHOUSE    the lighthouse's address, e.g. http://host:29510
    REPLICA_GROUP_ID      this group's number, 0 .. NUM_REPLICA_GROUPS - 1
    NUM_REPLICA_GROUPS    how many groups the data is split between
    TORCHFT_MIN_REPLICAS  commit a step only with at least this many groups (default 1)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ReduceOp

from . import main as entry
from . import task
from .config import Config, parse_args
from .data import ShardedBatchSampler
from .failures import ProjectError, RunFailure, UsageError, report_error
from .loop import Runtime, Trainer
from .metrics import fingerprint
from .optim import Optimization, schedule
from .parallel import parallelize, unwrap
from .replica_groups import (
    START_IT,
    Replicas,
    first_line,
    quiet_torchft,
    refuse_plain_run,
    start_manager,
)
from .runtime.comm_hooks import register_comm_hook
from .runtime.environments import World
from .runtime.launch import start
from .runtime.lifeline import Lifeline
from .runtime.rendezvous import collective_device


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
        self.module = unwrap(args[0])  # the model: its state is what the groups compare
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
                                 f"({first_line(exc)}); {START_IT}", everywhere=True) from None
            raise RunFailure(f"lost the torchft lighthouse at {self.lighthouse} "
                             f"({first_line(exc)}); restart it, then the replica groups (they "
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
            every = self.cfg.check_replicas_every  # every group of a quorum is at its step
            if participants > 1 and every and self.manager.current_step() % every == 0:
                self._one_model()
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

    def _one_model(self) -> None:
        """torchft heals only a group that is behind: groups that trained apart (a lighthouse
        that dropped one under load) and meet at one step would go on with their own weights. So
        the groups compare each tensor's fingerprint (the replica check's), largest and smallest;
        where they differ, every group takes the quorum's first group's state, and says so."""
        tensors = [t for t in [*self.module.state_dict().values(),
                               *(v for state in self.optimizers["default"].state.values()
                                 for v in state.values() if torch.is_tensor(v))]
                   if t.is_floating_point()]
        marks = torch.stack([fingerprint(t) for t in tensors]).to(self._flat.device)
        spread = torch.cat([marks, -marks])
        self.manager.allreduce(spread, reduce_op=ReduceOp.MAX).wait()
        if self.manager.errored() or torch.equal(spread[:len(marks)], -spread[len(marks):]):
            return  # the same state (or a failed step, which is not committed)
        first = self.manager.participating_rank() == 0
        for t in tensors:  # a sum in which only the first group's values are not zero
            if not first:
                t.zero_()
            self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        if self.say:
            print(f"torchft: step {self.manager.current_step()}: the replica groups had "
                  "different weights (they trained apart); each now has the first group's",
                  flush=True)

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
