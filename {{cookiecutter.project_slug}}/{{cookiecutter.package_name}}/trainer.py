"""The training loop: `_run_batch` -> `_run_epoch` -> `train`, plus `_save_snapshot` and `resume`.

Per step it does what a hand-written DDP loop does and nothing more: the loss stays on the device
and is averaged across ranks (one all_reduce, one host sync) only every --log-every steps, where
the ranks also agree on stopping. The model, its loss and its metrics come from task.py; the other
jobs live in their own modules (optim, evaluation, checkpoint, resume, metrics).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import storage
from .checkpoint import CheckpointDir, Staging, checkpoint_path
from .config import Config
from .data import ShardedBatchSampler, move_to
from .evaluation import Evaluator, ModelSelection
from .failures import SetupError, agree
from .metrics import (
    Bookkeeping,
    MetricsWriter,
    Progress,
    StepClock,
    StepProfiler,
    Throughput,
    closing_lines,
    log_step_stats,
)
from .optim import Optimization
from .parallel import set_gradient_sync, unwrap
from .resume import (
    config_differences,
    gather_rng_states,
    keep_retention,
    load_snapshot,
    pick_checkpoint,
    restore_position,
)
from .runtime.comm_hooks import PowerSGD
from .runtime.environments import World
from .runtime.lifeline import Lifeline
from .runtime.rendezvous import collective_device
from .runtime.workarounds import set_group_timeout


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
    def __init__(self, cfg: Config, world: World, task: Any, model: nn.Module,
                 optim: Optimization, data: Data, runtime: Runtime) -> None:
        self.cfg, self.world, self.task, self.model, self.optim = cfg, world, task, model, optim
        self.batches, self.loader, self.evaluator = data.batches, data.loader, data.evaluator
        self.data_notes = data.notes
        self.device, self.backend = runtime.device, runtime.backend
        self.lifeline, self.started_at = runtime.lifeline, runtime.started_at
        self.comm_hook = runtime.comm_hook
        device, backend = runtime.device, runtime.backend
        self.raw = unwrap(model)  # the user's module: state_dicts without prefixes
        self.comm_device = collective_device(backend, device)  # for our own collectives
        self.ckpt_dir = (CheckpointDir(cfg.checkpoint_dir, cfg.keep_last, cfg.timeout_s)
                         if world.is_main else None)
        self.dcp = None
        if cfg.model_layout == "fsdp":  # torch.distributed.checkpoint: imported where it is used
            from . import sharded
            self.dcp = sharded.ShardedCheckpoints(self.ckpt_dir, cfg.checkpoint_dir,
                                                  cfg.async_save, self.comm_device)
        self.staging = Staging() if cfg.async_save else None
        self.progress = Progress(cfg.progress and world.is_main)
        self.clock = StepClock(device, cuda_events=bool(cfg.step_times))
        self.profiler = StepProfiler(cfg.profile_range(), cfg.output_dir, world.is_main, device)
        self.book = Bookkeeping(self.progress, self.clock, self.profiler, cfg.log_every,
                                cfg.save_every_steps)
        self.metrics = MetricsWriter(cfg.output_dir, False)  # rank 0's real one opens in train()
        self.selection = ModelSelection(cfg.keep_best, cfg.early_stop)
        self.throughput = Throughput(task, self.raw, cfg, device,
                                     runtime.devices_per_process * world.world_size)

        # Position: the epoch being trained, the batches of it already done, optimizer steps.
        self.epoch, self.batch_in_epoch, self.step = 0, 0, 0
        self.resumed_from: str | None = None
        self.last_loss: float | None = None
        self.val_metrics: dict[str, float] = {}
        self.peak_mem_mb: list[float] = []
        self.peak_reserved_mb: list[float] = []
        self.tracker_run_id: str | None = None
        self.stopped_by: str | None = None
        self.stop_signal = signal.SIGTERM  # the exit code of a stopped run is 128 + this
        self._saved_step = -1
        self._set_aside = False  # other runs' checkpoints moved out of the folder yet?
        self._stalls_ms: list[float] = []  # how long training stood still for each save
        self._loss_sum = torch.zeros((), device=device)
        self._loss_count = 0
        self._samples = 0  # samples this rank trained on since the last log
        self._samples_total = 0
        self._first_step_s: float | None = None
        self._checked_loss = False

    # ---------------------------------------------------------------- resume
    def resume(self) -> None:
        """Apply --resume: rank 0 takes the checkpoint folder and chooses; every rank loads."""
        with self.lifeline.waiting("rank 0 to open --checkpoint-dir and choose a checkpoint",
                                   "check that rank 0 is alive and its storage answers",
                                   phase="checkpoint I/O"):
            choice = agree(self._open_and_pick, self.comm_device)
        if choice is None:
            return
        path = storage.location(choice)
        try:
            meta = load_snapshot(path, self.raw, self.optim.optimizer, self.world.world_size,
                                 self.world.rank, self.cfg.batch_size, self.device, self.optim.ema)
        except SetupError:
            raise
        except Exception as exc:  # its metadata read, but not all loads
            raise SetupError(f"cannot load checkpoint {path} ({type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc) else ''}); use "
                             "--resume with an older one, or --resume never",
                             everywhere=True) from exc
        self.optim.load_state_dict(meta["optim"])
        if self.comm_hook is not None and meta.get("comm_hook") is not None:
            note = self.comm_hook.load_state_dict(meta["comm_hook"], self.world.rank,
                                                  self.world.world_size)
            if note and self.world.is_main:
                print(f"note: {note}", flush=True)
        self.last_loss, self.tracker_run_id = meta.get("last_loss"), meta.get("tracker_run_id")
        self.epoch, self.batch_in_epoch, self.step = restore_position(
            meta, self.cfg, self.world.world_size, self.batches.batches_per_epoch(), path,
            say=self.world.is_main)
        self.resumed_from, self._saved_step = str(path), self.step
        for saver in (self.ckpt_dir, self.dcp):  # what an error names as the newest checkpoint
            if saver is not None:
                saver.saved = path
        if self.world.is_main:
            print(f"resumed from {path} (epoch {self.epoch}, batch {self.batch_in_epoch}, step "
                  f"{self.step})", flush=True)
        retention = keep_retention(self.cfg, meta.get("config", {}))  # every rank: same cfg
        self.selection = ModelSelection(self.cfg.keep_best, self.cfg.early_stop)
        self.selection.load_state_dict(meta.get("selection"))
        if self.ckpt_dir is not None:
            self.ckpt_dir.keep_last = self.cfg.keep_last
            self.ckpt_dir.keep_step = self.selection.best.get("step")
        if self.world.is_main:
            changed = config_differences(meta.get("config", {}), self.cfg.to_dict())
            if changed:
                print(f"note: settings that differ from the checkpoint's run: {'; '.join(changed)}",
                      flush=True)
            for note in retention:
                print(f"note: {note}", flush=True)

    def _open_and_pick(self) -> str | None:
        self.ckpt_dir.open()
        # Parameters and AdamW's two moments, 4 bytes each: what one checkpoint needs on disk.
        self.ckpt_dir.check_space(12 * sum(p.numel() for p in self.raw.parameters()))
        path = pick_checkpoint(self.cfg.resume, self.cfg.checkpoint_dir)
        return None if path is None else str(path)

    # ---------------------------------------------------------------- checkpoints
    def _save_snapshot(self) -> None:
        """Every rank's random state goes into the checkpoint; rank 0 writes it (fsdp: every rank
        writes its shards), and every rank learns whether that worked before going on."""
        started = time.perf_counter()
        if self.selection.pending_save:  # this step's evaluation is the best so far
            self.selection.pending_save = False
            if self.ckpt_dir is not None:
                self.ckpt_dir.keep_step = self.step  # beside the newest, never pruned
        rng = gather_rng_states(self.device, self.comm_device)
        meta = {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "samples_in_epoch": self.batch_in_epoch * self.cfg.batch_size * self.world.world_size,
            "step": self.step,
            "world_size": self.world.world_size,
            "batch_size": self.cfg.batch_size,
            "grad_accum": self.cfg.grad_accum,
            "last_loss": self.last_loss,
            "optim": self.optim.state_dict(),
            "tracker_run_id": self.tracker_run_id,
            "config": self.cfg.to_dict(),
            "selection": self.selection.state_dict(),
        }
        if self.dcp is not None:
            ema = self.optim.ema
            self.dcp.save(self.raw, self.optim.optimizer, rng, {**meta, "has_ema": ema is not None},
                          self.step, self._prepare_folder, ema and {"ema": ema.state_dict()})
        else:
            if self.comm_hook is not None:  # every rank's part: a collective
                meta["comm_hook"] = self.comm_hook.state_dict(self.comm_device)
            agree(lambda: self._write_file(rng, meta), self.comm_device)
        self._saved_step = self.step
        self._stalls_ms.append(1000 * (time.perf_counter() - started))

    def _write_file(self, rng: torch.Tensor, meta: dict[str, Any]) -> None:
        self._prepare_folder()
        state = {"model": self.raw.state_dict(), "optimizer": self.optim.optimizer.state_dict(),
                 "rng": rng, **meta}
        if self.optim.ema is not None:
            state["ema"] = self.optim.ema.state_dict()
        if self.staging is None:
            self.ckpt_dir.save_file(state, self.step)
        else:
            self.ckpt_dir.save_file_in_background(state, self.step, self.staging)

    def _prepare_folder(self) -> None:
        """Rank 0, before this run's first save: other runs' checkpoints move aside."""
        if not self._set_aside:
            moved = self.ckpt_dir.set_aside(storage.location(self.resumed_from)
                                            if self.resumed_from else None)
            if moved:
                print(f"note: moved checkpoints of another run (or later than the one resumed) "
                      f"to {moved}", flush=True)
            self._set_aside = True

    def _finish_saves(self) -> None:
        """Wait for a background save (and learn its outcome) before the process ends."""
        if self.dcp is not None:
            self.dcp.finish()
        elif self.cfg.async_save:
            agree(lambda: self.ckpt_dir.wait(), self.comm_device)

    # ---------------------------------------------------------------- training
    def _run_batch(self, batch: Any, weight: float, sync: bool = True) -> torch.Tensor:
        """Forward and backward of one micro-batch. `weight` is its share of the samples of its
        accumulation group, so K accumulated micro-batches give the gradient of one K-times
        larger batch (a short last group included). Gradients are exchanged (`sync`) only at
        the group's last micro-batch."""
        if not sync:
            with set_gradient_sync(self.model, False):
                return self._run_batch(batch, weight)
        with self.optim.autocast():
            loss = self.task.loss_fn(self.model, batch)
        if not self._checked_loss:
            self._check_loss(loss)
        self.optim.backward(loss if weight == 1.0 else loss * weight)
        return loss.detach()

    def _check_loss(self, loss: Any) -> None:
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise SetupError(f"task.loss_fn must return the batch's mean loss as a scalar tensor "
                             f"that requires grad; it returned {shape}", everywhere=True)
        self._checked_loss = True

    def _agreed_batch_count(self) -> int:
        """The batches every rank will run this epoch: the smallest count of any rank. Our sampler
        pads shards to equal length; a custom one may not, and a rank waiting for a step the others
        never take is a hang."""
        count = torch.tensor([self.batches.batches_per_epoch()], device=self.comm_device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)  # once per epoch
        return int(count.item())

    def _accumulation(self, i: int, total: int) -> tuple[bool, float]:
        """Whether batch `i` ends its accumulation group, and its weight in the group."""
        accum = self.cfg.grad_accum
        if accum == 1:
            return True, 1.0
        start = i - i % accum
        end = min(start + accum, total)  # the last group of an epoch may be short
        group = sum(self.batches.batch_len(j) for j in range(start, end))
        return i == end - 1, self.batches.batch_len(i) / group

    def _run_epoch(self, epoch: int) -> None:
        total = self._agreed_batch_count()
        self.batches.set_epoch(epoch, self.batch_in_epoch)  # a new shuffle each epoch, every rank
        self.book.start_epoch(epoch, total, self.batch_in_epoch)
        for i, batch in zip(range(self.batch_in_epoch, total), self.loader, strict=False):
            last_in_group, weight = self._accumulation(i, total)
            loss = self._run_batch(move_to(batch, self.device), weight, sync=last_in_group)
            self._loss_sum += loss  # stays on the device: no host sync until the log step
            self._loss_count += 1
            self._samples += self.batches.batch_len(i)
            self.book.batch_done()
            # optim.step() is False for a refused step: the weights did not change.
            if last_in_group and self.optim.step():
                self.step, self.batch_in_epoch = self.step + 1, i + 1
                if self._after_step(epoch, last_of_epoch=i + 1 == total):
                    break
        self.book.end_epoch()
        if self.batch_in_epoch == total:
            self.epoch, self.batch_in_epoch = epoch + 1, 0
            self._evaluate(epoch)

    def _after_step(self, epoch: int, last_of_epoch: bool) -> bool:
        """Log, evaluate and save where each is due; True when training stops at this step."""
        log, save = self.book.step_done(self.step, last_of_epoch, self._done())
        if self._first_step_s is None:
            self._after_first_step()
        if log:
            self._log(epoch)
        every = self.cfg.eval_every_steps
        if every and self.step % every == 0 and not last_of_epoch:  # epochs end with one anyway
            self._evaluate(epoch)
        if self._done():  # --max-steps, a stop agreed at the log step, or an early stop
            return True
        if save or self.selection.pending_save:
            self._save_snapshot()
        return False

    def _after_first_step(self) -> None:
        self._first_step_s = time.time() - self.started_at
        self.lifeline.resume_hint = ("resume continues from the newest checkpoint in "
                                     f"{storage.shown(self.cfg.checkpoint_dir)}")
        if self.backend == "nccl":  # start-up had longer: training gets --timeout-s
            set_group_timeout(self.cfg.timeout_s)

    def _evaluate(self, epoch: int) -> None:
        if self.evaluator is None:
            return
        model = self.model if self.dcp is not None else self.raw  # fsdp needs its wrapper
        self.val_metrics = self.evaluator.run(model, self.optim.autocast, self.optim.ema)
        self.metrics.log({"step": self.step, "epoch": epoch, **self.val_metrics})
        notes = self.selection.update(self.val_metrics, self.step)
        if self.world.is_main:
            shown = ", ".join(f"{k} {v:.5g}" for k, v in self.val_metrics.items())
            print(f"epoch {epoch} validation: {shown}", flush=True)
            for note in notes:
                print(note, flush=True)

    def _evaluate_only(self) -> dict[str, Any]:
        """--eval-only: the metrics of the resumed checkpoint, written to eval.json; no training,
        no checkpoint, no summary."""
        if not self.resumed_from:
            raise SetupError(f"--eval-only needs a checkpoint, and there is none in "
                             f"--checkpoint-dir {self.cfg.checkpoint_dir}; name one with --resume "
                             "PATH", everywhere=True)
        model = self.model if self.dcp is not None else self.raw
        metrics = self.evaluator.run(model, self.optim.autocast, self.optim.ema)
        result = {"checkpoint": self.resumed_from, "step": self.step, **metrics}
        if self.world.is_main:
            shown = ", ".join(f"{k} {v:.5g}" for k, v in metrics.items())
            print(f"evaluation of {self.resumed_from} (step {self.step}): {shown}", flush=True)
            out = Path(self.cfg.output_dir) / "eval.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
        return result

    def _done(self) -> bool:
        return (self.epoch >= self.cfg.epochs or self.stopped_by is not None
                or self.selection.should_stop
                or bool(self.cfg.max_steps and self.step >= self.cfg.max_steps))

    def _log(self, epoch: int) -> None:
        """Average the loss over ranks and steps since the last log and agree on a stop request:
        the only collective and host sync of the loop besides DDP's own."""
        if self._loss_count == 0:
            return
        signum = self.lifeline.stop_signal
        loss, stop, self.peak_mem_mb, self.peak_reserved_mb = log_step_stats(
            self._loss_sum, self._loss_count, signum is not None, self.device, self.comm_device)
        if not math.isfinite(loss):
            newest = checkpoint_path(self.cfg.checkpoint_dir, self._saved_step,
                                     sharded=self.dcp is not None)
            where = (f"the newest good checkpoint is {newest}" if self._saved_step >= 0
                     else "no checkpoint was saved yet")
            raise SetupError(f"the loss became {loss} by step {self.step}; {where}; lower --lr, "
                             "use --clip-grad, or check the data", everywhere=True)
        if stop:  # some rank was asked to stop: every rank stops after this step
            self.stopped_by = signal.Signals(signum).name if signum else "another rank's signal"
            self.stop_signal = signum or signal.SIGTERM
        now = time.perf_counter()
        samples_per_s = self._samples * self.world.world_size / max(now - self._last_log_time, 1e-9)
        self.last_loss = loss
        self._samples_total += self._samples
        self._loss_sum.zero_()
        self._loss_count, self._samples, self._last_log_time = 0, 0, now
        record = {"step": self.step, "epoch": epoch, "loss": loss, "lr": self.optim.lr(),
                  "samples_per_s": round(samples_per_s, 1),
                  **self.throughput.of(samples_per_s), "time_s": round(now - self._start, 3),
                  "peak_mem_mb": self.peak_mem_mb}
        if self.device.type == "cuda":
            record["peak_reserved_mb"] = self.peak_reserved_mb
        self.metrics.log(record)
        if not self.progress.show(f"loss={loss:.4f}") and self.world.is_main:
            print(f"epoch {epoch} step {self.step} loss {loss:.5f} samples/s {samples_per_s:.0f}",
                  flush=True)

    def train(self) -> dict[str, Any]:
        """Train until --epochs (or --max-steps), saving as configured; returns the summary."""
        early = self._before_training()
        if early is not None:  # --eval-only, or a run that is already complete
            return early
        self._start = self._last_log_time = time.perf_counter()
        self.lifeline.phase = "training"
        self.profiler.step_done(self.step)
        try:
            while not self._done():
                self._run_epoch(self.epoch)
                at_epoch_end = self.batch_in_epoch == 0
                cadence = self.cfg.save_every and self.epoch % self.cfg.save_every == 0
                if at_epoch_end and (cadence or self.selection.pending_save):
                    self._save_snapshot()
            self.lifeline.phase = "finishing"
            if self.step != self._saved_step:
                self._save_snapshot()
            self._finish_saves()
            if self.stopped_by is not None:
                return self._stopped()
            summary = self._summary()
            path = self.metrics.write_json("summary.json", summary)
            if self.cfg.step_times and self.world.is_main:
                Path(self.cfg.step_times).write_text(json.dumps(self.clock.report(self.started_at)))
        finally:
            self.metrics.close()
            self.progress.close()
            if self.ckpt_dir is not None:
                self.ckpt_dir.close()
        if self.world.is_main:
            print(closing_lines(summary, self.last_loss, storage.shown(self.cfg.checkpoint_dir),
                                path), flush=True)
        return summary

    def _stopped(self) -> dict[str, Any]:
        """A stop signal's end: the checkpoint is saved; the exit code is 128 + the signal."""
        if self.world.is_main:
            print(f"stopped by {self.stopped_by} at step {self.step}: checkpoint saved in "
                  f"{storage.shown(self.cfg.checkpoint_dir)}; run the same command to resume",
                  flush=True)
        return {"stopped_by": self.stopped_by, "steps": self.step,
                "exit_code": 128 + self.stop_signal}

    def _before_training(self) -> dict[str, Any] | None:
        """Checks that need the model and data, then the metrics; a result when there is nothing
        to train (--eval-only, a complete run)."""
        wants = [flag for flag, on in (("--eval-only", self.cfg.eval_only),
                                       ("--eval-every-steps", self.cfg.eval_every_steps),
                                       ("--keep-best", self.cfg.keep_best),
                                       ("--early-stop", self.cfg.early_stop)) if on]
        if wants and self.evaluator is None:
            raise SetupError(f"{wants[0]} needs a validation set, and task.build_datasets "
                             "returned none (raise --val-fraction?)", everywhere=True)
        if self.cfg.eval_only:
            return self._evaluate_only()
        if self.resumed_from and self._done():  # every rank resumed the same checkpoint
            if self.world.is_main:
                where = (f"step {self.step} of --max-steps {self.cfg.max_steps}"
                         if self.cfg.max_steps and self.step >= self.cfg.max_steps
                         else f"epoch {self.epoch} of {self.cfg.epochs}, step {self.step}")
                print(f"this run is complete: {where}; raise --epochs or --max-steps, or use "
                      "--resume never to start over", flush=True)
            return {"complete": True, "steps": self.step}  # summary and metrics stay as they are
        if self.selection.keep or self.selection.stop:  # a misspelt metric: before training
            model = self.model if self.dcp is not None else self.raw  # as in _evaluate
            self.selection.check(self.evaluator.reported(model, self.optim.autocast,
                                                         self.optim.ema))
        with self.lifeline.waiting("rank 0 to start the metrics and tracker",
                                   "check rank 0's output"):
            agree(self._open_metrics, self.comm_device)
        if self.cfg.warmup_steps > self.optim.total_steps and self.world.is_main:
            print(f"warning: --warmup-steps {self.cfg.warmup_steps} is longer than the run "
                  f"({self.optim.total_steps} steps): the learning rate never reaches --lr",
                  file=sys.stderr, flush=True)
        return None

    def _open_metrics(self) -> None:
        """Rank 0: metrics.jsonl, the tracker, config.json; and whether --step-times can be
        written (it is written at the end: find out now)."""
        self.metrics = MetricsWriter(self.cfg.output_dir, True, self.cfg.tracker,
                                     append=self.resumed_from is not None,
                                     config=self.cfg.to_dict(), tracker_run_id=self.tracker_run_id)
        if self.metrics.tracker is not None:
            self.tracker_run_id = self.metrics.tracker.run_id
        self.metrics.write_json("config.json", self.cfg.to_dict())
        if self.cfg.step_times:
            try:
                Path(self.cfg.step_times).parent.mkdir(parents=True, exist_ok=True)
                Path(self.cfg.step_times).touch()
            except OSError as exc:
                raise SetupError(f"--step-times {self.cfg.step_times}: cannot write it "
                                 f"({exc.strerror or exc})") from None

    def _summary(self) -> dict[str, Any]:
        wall = time.perf_counter() - self._start
        stalls = sorted(self._stalls_ms)
        # Every rank trains on the same number of samples (the sampler pads): exact.
        samples_per_s = self._samples_total * self.world.world_size / max(wall, 1e-9)
        return {
            "world_size": self.world.world_size,
            "backend": self.backend,
            "launcher": self.world.launcher,
            "model_layout": self.cfg.model_layout,
            "epochs_completed": self.epoch,
            "steps": self.step,
            "final_loss": self.last_loss,
            "samples_per_s": round(samples_per_s, 1),
            **self.throughput.of(samples_per_s),
            **self.clock.summary(),
            "checkpoint_stall_ms": round(stalls[len(stalls) // 2], 1) if stalls else None,
            "checkpoint_stall_ms_max": round(stalls[-1], 1) if stalls else None,
            "checkpoint_saves": len(stalls),
            "async_save": self.cfg.async_save,
            "time_to_first_step_s": round(self._first_step_s, 3) if self._first_step_s else None,
            "peak_mem_mb": self.peak_mem_mb,
            **({"peak_reserved_mb": self.peak_reserved_mb} if self.device.type == "cuda" else {}),
            **self.val_metrics,
            "wall_time_s": round(wall, 3),
            "resumed_from": self.resumed_from,
            "checkpoint_dir": str(storage.location(self.cfg.checkpoint_dir)),
            **self.selection.summary(),
            **self.data_notes,
        }
