"""The training loop: `_run_batch` -> `_run_epoch` -> `train`, plus checkpoints and logging.

Per step it does what a hand-written DDP loop does and nothing more: the loss stays on the device and
is only averaged across ranks (one all_reduce, one host sync) every `--log-every` steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from .checkpoint import load_checkpoint, load_for_resume, save_checkpoint
from .config import Config
from .data import InMemoryLoader, TensorPairDataset, eval_shard
from .distributed import SetupError, World
from .metrics import MetricsWriter

AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """Multiplier of the peak LR at a step: linear warm-up, then constant or cosine decay to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())  # RNG states must be CPU byte tensors
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


class Trainer:
    def __init__(self, cfg: Config, world: World, model: nn.Module, loader: InMemoryLoader | DataLoader,
                 devices: list[torch.device], backend: str, val_set: TensorPairDataset | None = None,
                 started_at: float | None = None) -> None:
        self.cfg, self.world, self.loader, self.backend = cfg, world, loader, backend
        self.val_set = val_set
        self.started_at = time.time() if started_at is None else started_at  # for time to first step
        self.input_device, self.output_device = devices[0], devices[-1]
        self.raw_model = model
        # A model spread over two devices (or on CPU) is wrapped without device_ids.
        single_cuda = len(set(devices)) == 1 and devices[0].type == "cuda"
        self.model: nn.Module = DDP(
            model,
            device_ids=[devices[0]] if single_cuda else None,
            find_unused_parameters=cfg.find_unused_parameters,
        )
        if cfg.compile:
            if not getattr(torch._dynamo, "is_dynamo_supported", lambda: True)():
                raise SetupError(f"--compile: torch.compile does not support Python {sys.version.split()[0]} on "
                                 f"{sys.platform} with PyTorch {torch.__version__}; run without --compile",
                                 quiet=not world.is_main)
            self.model = torch.compile(self.model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        steps_per_epoch = math.ceil(loader.sampler.batches_per_epoch() / cfg.grad_accum)
        total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps))
        self.amp_dtype = AMP_DTYPES[cfg.precision]
        if cfg.precision == "fp16" and self.input_device.type != "cuda":
            raise SetupError("--precision fp16 needs CUDA (it relies on a GradScaler); use --precision bf16 on CPU",
                             quiet=not world.is_main)  # every rank finds the same: say it once
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")

        # Position: the epoch being trained, the batches of it already done, optimizer steps in total.
        self.epoch, self.batch_in_epoch, self.step = 0, 0, 0
        self.resumed_from: str | None = None
        self.last_loss: float | None = None
        self._saved_step = -1
        self._loss_sum = torch.zeros((), device=self.output_device)
        self._loss_count = 0
        self._samples = 0  # samples this rank has trained on since the last log
        self._samples_total = 0
        # Preemption: a signal handler sets `stop_signal`; the ranks agree to stop at the next log step,
        # where the flag rides along with the loss all_reduce, so stopping costs no extra collective.
        self.stop_signal: int | None = None
        self.stopped_by: str | None = None
        self.val_loss: float | None = None
        self._step_ends: list[float] = []  # perf_counter after each optimizer step, for the step-time report
        # On a GPU the host clock only sees kernel launches; --step-times also records a CUDA event per step.
        want_events = bool(cfg.step_times) and self.output_device.type == "cuda"
        self._step_events: list[torch.cuda.Event] | None = [] if want_events else None
        self._first_step_s: float | None = None
        self._save_ms: list[float] = []

    # ---------------------------------------------------------------- resume
    def resume(self) -> None:
        """Apply `--resume`. Rank 0 chooses the checkpoint and every rank loads that same file."""
        choice: list[Any] = [None]
        loaded = None
        if self.world.is_main:
            try:
                loaded = load_for_resume(self.cfg.resume, self.cfg.checkpoint_dir, self.input_device)
                choice[0] = ("ok", str(loaded[0]) if loaded else None)
            except SetupError as exc:
                choice[0] = ("error", str(exc))  # tell the other ranks instead of leaving them waiting
        dist.broadcast_object_list(choice, src=0)
        status, value = choice[0]
        if status == "error":
            raise SetupError(value, quiet=not self.world.is_main)
        if value is None:
            return
        # Load onto this rank's own device: tensors saved from cuda:0 must not all land on cuda:0.
        state = loaded[1] if loaded else load_checkpoint(value, map_location=self.input_device)
        self._restore(state)
        self.resumed_from = value
        self._saved_step = self.step
        if self.world.is_main:
            print(f"resumed from {value} (epoch {self.epoch}, batch {self.batch_in_epoch}, step {self.step})",
                  flush=True)

    def _restore(self, state: dict[str, Any]) -> None:
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.batch_in_epoch, self.step = state["epoch"], state["batch_in_epoch"], state["step"]
        self.last_loss = state.get("last_loss")
        same_layout = (state["world_size"], state["batch_size"]) == (self.world.world_size, self.cfg.batch_size)
        if same_layout:
            _set_rng_state(state["rng"][self.world.rank], self.input_device)  # bit-for-bit continuation
        elif self.batch_in_epoch:
            # Other shards and batch sizes: continue after the same number of samples of this epoch.
            samples_done = state["samples_in_epoch"]
            per_batch = self.cfg.batch_size * self.world.world_size
            self.batch_in_epoch = samples_done // per_batch // self.cfg.grad_accum * self.cfg.grad_accum
            if self.world.is_main:
                print(f"warning: checkpoint is from {state['world_size']} processes x batch {state['batch_size']}; "
                      f"continuing epoch {self.epoch} after {self.batch_in_epoch * per_batch} of the "
                      f"{samples_done} samples already seen (exact resume needs the same world and batch size)",
                      file=sys.stderr, flush=True)

    # ---------------------------------------------------------------- checkpoints
    def _save_snapshot(self) -> None:
        """Every rank hands its RNG state to rank 0, rank 0 writes, and nobody goes on before it is done."""
        started = time.perf_counter()
        rng_states: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(rng_states, _rng_state(self.input_device))
        if self.world.is_main:
            state = {
                "model": self.raw_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "samples_in_epoch": self.batch_in_epoch * self.cfg.batch_size * self.world.world_size,
                "step": self.step,
                "world_size": self.world.world_size,
                "batch_size": self.cfg.batch_size,
                "grad_accum": self.cfg.grad_accum,
                "last_loss": self.last_loss,
                "rng": rng_states,
                "config": self.cfg.to_dict(),
            }
            save_checkpoint(state, self.cfg.checkpoint_dir, self.step, self.cfg.keep_last)
        dist.barrier()
        self._saved_step = self.step
        self._save_ms.append(1000 * (time.perf_counter() - started))  # how long training stood still

    # ---------------------------------------------------------------- training
    def _run_batch(self, x: torch.Tensor, y: torch.Tensor, sync: bool, weight: float = 1.0) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients are all-reduced only when `sync`.

        `weight` is this micro-batch's share of the samples of its accumulation group, so K accumulated
        micro-batches give the gradient of one K-times-larger batch (a short last group included).
        """
        # no_sync must cover the backward too: that is where DDP's all-reduce hooks fire.
        with self.model.no_sync() if not sync else contextlib.nullcontext():
            with self._autocast():
                out = self.model(x)
            loss = F.mse_loss(out.float(), y)
            self.scaler.scale(loss if weight == 1.0 else loss * weight).backward()
        return loss.detach()

    def _autocast(self) -> contextlib.AbstractContextManager:
        # In fp32 skip autocast altogether: even a disabled autocast costs a few microseconds a step.
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.input_device.type, dtype=self.amp_dtype)

    def _optimizer_step(self) -> None:
        if self.cfg.clip_grad > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.cfg.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _agreed_batch_count(self) -> int:
        """The batches every rank will run this epoch: the smallest count of any rank. Our sampler pads
        shards to equal length; a custom one may not, and one rank waiting for a step the others never
        take is a hang."""
        count = torch.tensor([self.loader.sampler.batches_per_epoch()], device=self.output_device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)  # once per epoch
        return int(count.item())

    def _run_epoch(self, epoch: int) -> None:
        batch_sampler = self.loader.sampler
        batch_sampler.set_epoch(epoch, self.batch_in_epoch)  # a new shuffle each epoch, on every rank
        total = self._agreed_batch_count()
        accum, batch_size = self.cfg.grad_accum, self.cfg.batch_size
        shard = len(batch_sampler.sampler)  # this rank's samples this epoch; the last batch may be short
        bar = self._progress_bar(epoch, total)
        for i, (x, y) in zip(range(self.batch_in_epoch, total), self.loader, strict=False):
            x = x.to(self.input_device, non_blocking=True)
            y = y.to(self.output_device, non_blocking=True)
            group_start = i - i % accum
            group_end = min(group_start + accum, total)  # the last group of an epoch may be short
            last_in_group = i == group_end - 1
            weight = 1.0
            if accum > 1:
                group_samples = min(group_end * batch_size, shard) - group_start * batch_size
                weight = x.shape[0] / group_samples
            self._loss_sum += self._run_batch(x, y, sync=last_in_group, weight=weight)
            self._loss_count += 1
            self._samples += x.shape[0]
            self._samples_total += x.shape[0]
            if bar is not None:
                bar.update()
            if not last_in_group:
                continue
            self._optimizer_step()
            self.step += 1
            self.batch_in_epoch = i + 1
            self._step_ends.append(time.perf_counter())
            if self._step_events is not None:
                self._step_events.append(torch.cuda.Event(enable_timing=True))
                self._step_events[-1].record()
            if self._first_step_s is None:
                self._first_step_s = time.time() - self.started_at
            # _done() here means --max-steps was reached: the last step is always logged.
            if self.step % self.cfg.log_every == 0 or i + 1 == total or self._done():
                self._log(epoch, bar)
            if self._done():
                break
            if self.cfg.save_every_steps and self.step % self.cfg.save_every_steps == 0 and i + 1 < total:
                self._save_snapshot()
        if bar is not None:
            bar.close()
        if self.batch_in_epoch == total:
            self.epoch, self.batch_in_epoch = epoch + 1, 0
            self._evaluate(epoch)

    @torch.no_grad()
    def _evaluate(self, epoch: int) -> None:
        """Validation MSE over all ranks, each sample counted once: the single-process value up to rounding."""
        if self.val_set is None:
            return
        indices = eval_shard(len(self.val_set), self.world.rank, self.world.world_size)
        totals = torch.zeros(2, dtype=torch.float64, device=self.output_device)  # squared error, count
        self.raw_model.eval()
        for chunk in indices.split(max(self.cfg.batch_size, 256)):
            x, y = self.val_set[chunk]
            with self._autocast():
                out = self.raw_model(x.to(self.input_device))
            error = out.double() - y.to(self.output_device, torch.float64)
            totals[0] += error.square().sum()
            totals[1] += error.numel()
        self.raw_model.train()
        dist.all_reduce(totals)
        self.val_loss = (totals[0] / totals[1]).item()
        self.metrics.log({"step": self.step, "epoch": epoch, "val_loss": self.val_loss})
        if self.world.is_main:
            print(f"epoch {epoch} validation loss {self.val_loss:.5f}", flush=True)

    def _done(self) -> bool:
        return (self.epoch >= self.cfg.epochs or bool(self.cfg.max_steps and self.step >= self.cfg.max_steps)
                or self.stopped_by is not None)

    def request_stop(self, signum: int, frame: Any = None) -> None:
        """Signal handler (SIGTERM, SIGUSR1): stop at the next log step, checkpoint, exit cleanly."""
        self.stop_signal = signum

    def _log(self, epoch: int, bar: Any) -> None:
        """Average the loss over ranks and steps since the last log, and agree on a stop request: the only
        collective and host sync of the loop besides DDP's own."""
        if self._loss_count == 0:
            return
        extra = torch.tensor([float(self._loss_count), float(self.stop_signal is not None)], device=self.output_device)
        stats = torch.cat([self._loss_sum.float().reshape(1), extra])
        dist.all_reduce(stats)
        loss = (stats[0] / stats[1]).item()
        if stats[2].item() > 0:  # some rank was asked to stop: every rank stops after this step
            self.stopped_by = signal.Signals(self.stop_signal).name if self.stop_signal else "another rank's signal"
        now = time.perf_counter()
        samples_per_s = self._samples * self.world.world_size / max(now - self._last_log_time, 1e-9)
        self.last_loss = loss
        self._loss_sum.zero_()
        self._loss_count, self._samples, self._last_log_time = 0, 0, now
        record = {"step": self.step, "epoch": epoch, "loss": loss, "lr": self.scheduler.get_last_lr()[0],
                  "samples_per_s": round(samples_per_s, 1), "time_s": round(now - self._start_time, 3)}
        self.metrics.log(record)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}")
        elif self.world.is_main:
            print(f"epoch {epoch} step {self.step} loss {loss:.5f} samples/s {samples_per_s:.0f}", flush=True)

    def _progress_bar(self, epoch: int, total: int):
        if not (self.cfg.progress and self.world.is_main):
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=total, initial=self.batch_in_epoch, desc=f"epoch {epoch}", file=sys.stderr,
                    dynamic_ncols=True, leave=False)

    def _write_step_times(self, path: Path) -> None:
        """Wall-clock end of every step (and on a GPU each step's time between CUDA events), as JSON."""
        to_wall = time.time() - time.perf_counter()
        report: dict[str, Any] = {"started_at": self.started_at, "step_ends": [t + to_wall for t in self._step_ends]}
        if self._step_events:
            torch.cuda.synchronize(self.output_device)
            events = self._step_events
            report["cuda_step_ms"] = [a.elapsed_time(b) for a, b in zip(events, events[1:], strict=False)]
        path.write_text(json.dumps(report))

    def train(self) -> dict[str, Any]:
        """Train until --epochs (or --max-steps), saving as configured; returns the run summary."""
        self.metrics = MetricsWriter(self.cfg.output_dir, self.world.is_main, self.cfg.tracker,
                                     append=self.resumed_from is not None)
        self._start_time = self._last_log_time = time.perf_counter()
        try:
            while not self._done():
                self._run_epoch(self.epoch)
                at_epoch_end = self.batch_in_epoch == 0
                if at_epoch_end and self.cfg.save_every and self.epoch % self.cfg.save_every == 0:
                    self._save_snapshot()
            if self.step != self._saved_step:
                self._save_snapshot()
            if self.stopped_by is not None:
                if self.world.is_main:
                    print(f"stopped by {self.stopped_by} at step {self.step}: checkpoint saved in "
                          f"{Path(self.cfg.checkpoint_dir).resolve()}; run the same command to resume", flush=True)
                return {"stopped_by": self.stopped_by, "steps": self.step}
            wall = time.perf_counter() - self._start_time
            step_ms = [1000 * (b - a) for a, b in zip(self._step_ends, self._step_ends[1:], strict=False)]
            if len(step_ms) > 40:
                step_ms = step_ms[20:]  # the first steps warm up allocators and DDP's buckets
            summary = {
                "world_size": self.world.world_size,
                "backend": self.backend,
                "launcher": self.world.launcher,
                "epochs_completed": self.epoch,
                "steps": self.step,
                "final_loss": self.last_loss,
                # Every rank trains on the same number of samples (the sampler pads), so this is exact.
                "samples_per_s": round(self._samples_total * self.world.world_size / max(wall, 1e-9), 1),
                "median_step_ms": round(statistics.median(step_ms), 3) if step_ms else None,
                "p90_step_ms": round(statistics.quantiles(step_ms, n=10)[-1], 3) if len(step_ms) > 1 else None,
                "checkpoint_save_ms": round(statistics.median(self._save_ms), 1) if self._save_ms else None,
                "time_to_first_step_s": round(self._first_step_s, 3) if self._first_step_s is not None else None,
                "val_loss": self.val_loss,
                "wall_time_s": round(wall, 3),
                "resumed_from": self.resumed_from,
                "checkpoint_dir": str(Path(self.cfg.checkpoint_dir)),
            }
            path = self.metrics.write_summary(summary)
            if self.cfg.step_times and self.world.is_main:
                self._write_step_times(Path(self.cfg.step_times))
        finally:
            self.metrics.close()
        if self.world.is_main:
            print(f"throughput: {summary['samples_per_s']:.0f} samples/s, median step {summary['median_step_ms']} ms, "
                  f"first step {summary['time_to_first_step_s']} s after start", flush=True)
            print(f"done: {self.step} steps, final loss {self.last_loss:.5f}\n"
                  f"checkpoints: {Path(self.cfg.checkpoint_dir).resolve()}\nsummary: {path.resolve()}", flush=True)
        return summary
