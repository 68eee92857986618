"""The training loop: `train` -> `_run_epoch` -> `_run_batch`, shaped like PyTorch's DDP tutorial.

Per step it does what a hand-written DDP loop does and nothing more: the loss stays on the device
until a log step. The step itself (forward, backward, update) is a function of step.py's, or
task.train_step. When to log, evaluate and save is decided by the part that owns it: metrics.py,
evaluation.py and checkpoint/checkpointer.py. The model, its loss and its metrics come from task.py.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import storage
from .checkpoint.checkpointer import Checkpointer
from .config import Config
from .data import ShardedBatchSampler, move_to
from .evaluation import Evaluation, Evaluator
from .failures import warn
from .meters import Throughput
from .metrics import Metrics
from .optim import Optimization, schedule
from .parallel import no_gradient_sync, unwrap
from .runtime.comm_hooks import PowerSGD
from .runtime.environments import World
from .runtime.lifeline import Lifeline
from .runtime.rendezvous import collective_device
from .runtime.torch_private import set_group_timeout
from .step import Step, check_values, plain_step


@dataclass
class Data:
    """This rank's training batches (which ones, and the loader that makes them) and the
    evaluator of the validation set (None without one)."""

    batches: ShardedBatchSampler
    loader: Any
    evaluator: Evaluator | None
    notes: dict[str, Any] = field(default_factory=dict)  # the training set's `summary`, if any


@dataclass
class Runtime:
    """Where and how this process runs."""

    device: torch.device  # the first (or only) device of the model
    backend: str
    lifeline: Lifeline
    started_at: float  # process start: for "time to first step"
    comm_hook: PowerSGD | None = None  # --comm-hook with state to checkpoint
    devices_per_process: int = 1  # model_parallel_2: 2 (or 1, with one device named twice)


class Trainer:
    """One rank's training: the model, its optimizer and data, and the parts that log
    (metrics.py), evaluate (evaluation.py) and save (checkpoint/checkpointer.py)."""

    def __init__(self, cfg: Config, world: World, task: Any, model: nn.Module,
                 optim: Optimization, data: Data, runtime: Runtime) -> None:
        self.cfg, self.world, self.task, self.model, self.optim = cfg, world, task, model, optim
        self.batches, self.loader, self.data_notes = data.batches, data.loader, data.notes
        self.device, self.backend, self.lifeline = runtime.device, runtime.backend, runtime.lifeline
        self.started_at, self.comm_hook = runtime.started_at, runtime.comm_hook
        self.unwrapped = unwrap(model)  # the user's module: state_dicts without prefixes
        self.comm_device = collective_device(runtime.backend, runtime.device)  # our collectives
        # Position: the epoch being trained, the batches of it already done, optimizer steps.
        self.epoch, self.batch_in_epoch, self.step = 0, 0, 0
        self.resumed_layout: str | None = None  # the --model-layout of the checkpoint resumed
        self.checkpointer = Checkpointer(cfg, world, self.unwrapped, optim, runtime.device,
                                         self.comm_device, runtime.lifeline, runtime.comm_hook)
        throughput = Throughput(task, self.unwrapped, cfg, runtime.device,
                                runtime.devices_per_process * world.world_size)
        self.metrics = Metrics(cfg, world, runtime, self.comm_device, throughput, optim.lr,
                               self.checkpointer.newest_good)
        evaluated = model if cfg.model_layout == "fsdp" else self.unwrapped  # fsdp: its wrapper
        self.evaluation = Evaluation(cfg, data.evaluator, evaluated, optim.autocast, optim.ema,
                                     world.is_main, self.metrics.record)
        # One batch of training: task.train_step, or the default step (step.py).
        self.custom_step = getattr(task, "train_step", None)
        self.train_step = self.custom_step or plain_step(task.loss_fn, optim.optimizers)
        self.step_state = Step(model, self.unwrapped, optim, cfg)

    def resume(self) -> None:
        """Apply --resume (checkpoint/checkpointer.py); the loop goes on from the checkpoint."""
        meta = self.checkpointer.resume(self.batches.batches_per_epoch(), self.data_notes)
        if meta is not None:
            self.epoch, self.batch_in_epoch, self.step = meta["position"]
            self.metrics.last_loss = meta.get("last_loss")
            self.metrics.tracker_run_id = meta.get("tracker_run_id")
            self.evaluation.restart_selection(meta.get("selection"))
            self.resumed_layout = meta.get("config", {}).get("model_layout")

    def loop_state(self) -> dict[str, Any]:
        """The loop's part of a checkpoint: position, last loss, tracker run, model selection.
        The pending log step is read first, then the loss since it and the weights are checked."""
        self.metrics.settle()
        self.metrics.check_weights(self.step, list(self.unwrapped.named_parameters()))
        samples = self.batch_in_epoch * self.cfg.batch_size * self.world.world_size
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "step": self.step,
                "samples_in_epoch": samples, "last_loss": self.metrics.last_loss,
                "tracker_run_id": self.metrics.tracker_run_id,
                "selection": self.evaluation.selection.state_dict(), "data": self.data_notes}

    # ---------------------------------------------------------------- training
    def train(self) -> dict[str, Any]:
        """Train until --epochs (or --max-steps), saving as configured; returns the summary."""
        if (early := self._before_training()) is not None:  # --eval-only, or a complete run
            return early
        self.metrics.start(self.step)
        self.lifeline.tell("phase", "training")
        try:
            while not self._done():
                self._run_epoch(self.epoch)
                if self.batch_in_epoch == 0:  # a whole epoch done
                    self.checkpointer.maybe_save(self.step, self.loop_state, epoch_end=self.epoch)
            if self.evaluation.at_step != self.step and self.metrics.stopped_by is None:
                # --max-steps inside an epoch: evaluated as at an epoch's end, the RNG untouched
                with torch.random.fork_rng(devices=[]):
                    self._evaluate(self.epoch)
            self.lifeline.tell("phase", "finishing")
            self.checkpointer.maybe_save(self.step, self.loop_state, last=True)
            self.checkpointer.finish()
            if self.metrics.stopped_by is not None:
                return self.metrics.stopped(self.step)
            summary = self.metrics.summary(self.epoch, self.step, self.checkpointer.summary(),
                                           self.evaluation.summary(), self.data_notes)
        finally:
            self.metrics.close()
            self.checkpointer.close()
        self.metrics.print_closing(summary)
        return summary

    def _run_epoch(self, epoch: int) -> None:
        total = self._agreed_batch_count()
        self.batches.set_epoch(epoch, self.batch_in_epoch)  # a new shuffle each epoch, every rank
        self.metrics.progress.start(epoch, total, self.batch_in_epoch)
        for i, batch in zip(range(self.batch_in_epoch, total), self.loader, strict=False):
            last_in_group, weight = self._accumulation(i, total)
            values = self._run_batch(move_to(batch, self.device), weight, last=last_in_group)
            self.metrics.batch_done(values, self.batches.batch_len(i))
            if last_in_group and self.optim.finish_step():  # False: the step was not taken
                self.step, self.batch_in_epoch = self.step + 1, i + 1
                if self._after_step(epoch, last_of_epoch=i + 1 == total):
                    break
        self.metrics.settle()
        self.metrics.progress.close()
        if self.batch_in_epoch == total:
            self.epoch, self.batch_in_epoch = epoch + 1, 0
            self._evaluate(epoch)

    def _run_batch(self, batch: Any, weight: float, last: bool) -> dict[str, torch.Tensor]:
        """One batch through the step function (`weight`, `last`: as Step.begin); returns what it
        logs."""
        self.step_state.begin(self.step, weight, last)
        with contextlib.nullcontext() if last else no_gradient_sync(self.model):
            values = self.train_step(self.step_state, batch)
        return check_values(values, "task.train_step") if self.custom_step else values

    def _agreed_batch_count(self) -> int:
        """The batches every rank will run this epoch: the smallest count of any rank (a custom
        sampler may not pad to equal length, and a rank waiting for a step is a hang)."""
        count = torch.tensor([self.batches.batches_per_epoch()], device=self.comm_device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)  # once per epoch
        return int(count.item())

    def _accumulation(self, i: int, total: int) -> tuple[bool, float]:
        """Whether batch `i` ends its accumulation group, and its weight in the group."""
        if (accum := self.cfg.grad_accum) == 1:
            return True, 1.0
        start = i - i % accum
        end = min(start + accum, total)  # the last group of an epoch may be short
        group = sum(self.batches.batch_len(j) for j in range(start, end))
        return i == end - 1, self.batches.batch_len(i) / group

    def _after_step(self, epoch: int, last_of_epoch: bool) -> bool:
        """Log, evaluate and save where each is due; True when training stops at this step."""
        if self.metrics.first_step_s is None:  # the first step
            self.metrics.first_step_s = time.time() - self.started_at
            self.lifeline.tell("hint", "resume continues from the newest checkpoint in "
                               f"{storage.shown(self.cfg.checkpoint_dir)}")
            if self.backend == "nccl":  # start-up had longer: training gets --timeout-s
                set_group_timeout(self.cfg.timeout_s)
        self.metrics.step_done(self.step, epoch, last=last_of_epoch or self._done())
        if self.evaluation.due(self.step, last_of_epoch):  # epochs end with one anyway
            self._evaluate(epoch)
        if self._done():  # --max-steps, a stop agreed at the log step, or an early stop
            return True
        if (every := self.cfg.check_replicas_every) and self.step % every == 0:
            self.metrics.check_weights(self.step, list(self.unwrapped.named_parameters()))
        self.checkpointer.maybe_save(self.step, self.loop_state, last_of_epoch=last_of_epoch)
        return False

    def _evaluate(self, epoch: int) -> None:
        self.metrics.settle()  # the step's metrics line comes before its evaluation's
        started = time.perf_counter()
        if self.evaluation.run(epoch, self.step):  # a new best (--keep-best): saved, kept
            self.checkpointer.keep_next = True
        self.metrics.not_training(time.perf_counter() - started)

    def _done(self) -> bool:
        return (self.epoch >= self.cfg.epochs or self.metrics.stopped_by is not None
                or self.evaluation.selection.should_stop
                or bool(self.cfg.max_steps and self.step >= self.cfg.max_steps))

    def _before_training(self) -> dict[str, Any] | None:
        """Checks that need the model and data, then the metrics; a result if nothing trains."""
        self.evaluation.check()
        resumed_from = self.checkpointer.resumed_from
        if self.cfg.eval_only:
            return self.evaluation.evaluate_only(resumed_from, self.step)
        if resumed_from and self._done():  # every rank resumed the same checkpoint
            if self.world.is_main:
                where = (f"step {self.step} of --max-steps {self.cfg.max_steps}"
                         if self.cfg.max_steps and self.step >= self.cfg.max_steps
                         else f"epoch {self.epoch} of {self.cfg.epochs}, step {self.step}")
                layout = self.resumed_layout
                todo = ("raise --epochs or --max-steps, or use --resume never to start over"
                        if layout in (None, self.cfg.model_layout) else
                        f"its checkpoints are a --model-layout {layout} run's: give this run its "
                        "own --run-name or --checkpoint-dir")
                print(f"this run is complete: {where}; {todo}", flush=True)
            return {"complete": True, "steps": self.step}  # summary and metrics stay as they are
        self.evaluation.check_metric_names()
        self.metrics.open(resumed=resumed_from is not None)
        _, steps, problems = schedule(self.cfg, self.batches.size, self.batches.world_size)
        if self.comm_hook is not None:  # PowerSGD's
            note, wrong = self.comm_hook.report(steps)
            problems += wrong
            if self.world.is_main:
                print(f"note: {note}", flush=True)
        for problem in problems:
            if self.world.is_main:  # what `doctor --plan` fails on, the run warns of
                warn(problem)
        if (unheld := self.optim.unheld) and self.world.is_main:
            warn(f"no optimizer of task.configure_optimizer holds {len(unheld)} trainable "
                 f"parameters ({', '.join(unheld[:3])}{', ...' * (len(unheld) > 3)}): they never "
                 "change; set requires_grad=False on those meant to stay frozen")
        return None
