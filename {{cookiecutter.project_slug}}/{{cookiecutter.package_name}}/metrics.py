"""What a run reports, and when: every --log-every steps the mean loss over ranks (one collective,
where the ranks also agree on a stop), before saves the check of the weights, and at the end
summary.json, --step-times and the closing lines. Rank 0 writes metrics.jsonl, summary.json,
config.json and the tracker; the other ranks' writers are silent."""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import storage
from .config import Config
from .ema import local_part
from .failures import RunFailure, UsageError, agree
from .meters import LogStats, Progress, StepClock, StepProfiler, Throughput
from .runtime.environments import World
from .runtime.trackers import MetricsWriter

# The fields of a metrics.jsonl line that the run writes itself: no logged value may take one.
OWN_FIELDS = frozenset({"step", "epoch", "lr", "samples_per_s", "tokens_per_s", "mfu", "time_s",
                        "peak_mem_mb", "peak_reserved_mb"})
# Called with each metrics line on every rank (the same line): a launcher that collects them.
EVERY_RANK: list[Callable[[dict[str, Any]], None]] = []


def fingerprint(p: torch.Tensor) -> torch.Tensor:
    """A float64 number of this rank's values of `p` that changes where any value or their order
    does: each weighted by (r + 1)^2 (c + 1) at row r, column c (weights that add up miss changes
    keeping every row and column sum); a float32 matrix-vector product; nan or inf where one is."""
    x = local_part(p).detach()
    x = x.reshape(x.shape[0], -1) if x.dim() and x.numel() else x.reshape(1, -1)
    place = torch.arange(1, max(x.shape) + 1, dtype=torch.float32, device=x.device)
    rows = (x.float() @ place[:x.shape[1]]).double()  # each row, its values weighted by column
    return rows @ place[:len(rows)].double() ** 2


class Metrics:
    """The loop's reporting. `lr` reads the learning rates; `newest_checkpoint` names the newest
    good checkpoint (for a NaN loss)."""

    def __init__(self, cfg: Config, world: World, runtime: Any, comm_device: torch.device,
                 throughput: Throughput, lr: Callable[[], dict[str, float]],
                 newest_checkpoint: Callable[[], str]) -> None:
        self.cfg, self.world, self.throughput = cfg, world, throughput
        self.runtime, self.device, self.comm_device = runtime, runtime.device, comm_device
        self.lr, self.newest_checkpoint, self.every = lr, newest_checkpoint, cfg.log_every
        self.writer = MetricsWriter(cfg.output_dir, False)  # rank 0's real one opens in open()
        self.progress = Progress(cfg.progress and world.is_main)
        self.clock = StepClock(runtime.device, cuda_events=bool(cfg.step_times))
        self.profiler = StepProfiler(cfg.profile_steps, cfg.output_dir, world.is_main,
                                     runtime.device)
        self.last_loss: float | None = None
        self.tracker_run_id: str | None = None
        self.stopped_by: str | None = None  # the signal's name, once every rank agreed to stop
        self.stop_signal = signal.SIGTERM  # the exit code of a stopped run is 128 + this
        self.first_step_s: float | None = None
        self.peak_mem_mb, self.peak_reserved_mb = [], []  # every rank's, at the last log step
        self.summary_path: Path | None = None
        # Each logged value's sum over the batches since the last log, on the device, and count.
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        self._samples, self._samples_total = 0, 0  # this rank's, since the last log; in all
        self.evaluation_s = 0.0  # not in samples/s
        self._checked_at = -1  # the step whose weights check_weights passed last
        self._pending: LogStats | None = None  # a log step's all_reduce, read one step later

    def open(self, resumed: bool) -> None:
        """Rank 0 opens metrics.jsonl, the tracker and config.json; every rank learns the result."""
        with self.runtime.lifeline.waiting("rank 0 to start the metrics and tracker",
                                           "check rank 0's output"):
            agree(lambda: self._open(resumed), self.comm_device)

    def _open(self, resumed: bool) -> None:
        """Rank 0: metrics.jsonl, the tracker, config.json; and whether --step-times can be
        written (it is written at the end: find out now)."""
        cfg = self.cfg
        self.writer = MetricsWriter(cfg.output_dir, True, cfg.tracker, append=resumed,
                                    config=cfg.to_dict(), tracker_run_id=self.tracker_run_id)
        if self.writer.tracker is not None:
            self.tracker_run_id = self.writer.tracker.run_id
        self.writer.write_json("config.json", cfg.to_dict())
        if cfg.step_times:
            try:
                Path(cfg.step_times).parent.mkdir(parents=True, exist_ok=True)
                Path(cfg.step_times).touch()
            except OSError as exc:
                raise UsageError(f"--step-times {cfg.step_times}: cannot write it "
                                 f"({exc.strerror or exc})") from None

    # ---------------------------------------------------------------- during training
    def start(self, step: int) -> None:
        self._start = self._last_log_time = time.perf_counter()
        self.profiler.step_done(step)

    def not_training(self, seconds: float) -> None:
        """Time spent evaluating: left out of samples/s and tokens/s, which are training's."""
        self.evaluation_s += seconds
        self._last_log_time += seconds

    def batch_done(self, values: dict[str, torch.Tensor], samples: int) -> None:
        """A batch's logged values (the loss, its parts): on the device until the log step."""
        for name, value in values.items():
            if (total := self._sums.get(name)) is None:
                kind = torch.promote_types(value.dtype, torch.float32)  # float64 stays so
                total = self._sums[name] = torch.zeros((), dtype=kind, device=value.device)
            total += value.detach() if value.dim() == 0 else value.detach().reshape(())
            self._counts[name] = self._counts.get(name, 0) + 1
        self._samples += samples
        self.progress.update()

    def step_done(self, step: int, epoch: int, last: bool) -> None:
        """After optimizer step `step`: the clocks; the log every --log-every steps and at the last
        step of an epoch and of the run (`last`). Its all_reduce is read one step later, by every
        rank (all stop at the same step), or before a save, an evaluation and the end."""
        self.clock.tick()
        self.profiler.step_done(step)
        self.settle()
        if step % self.every == 0 or last:
            self.log(step, epoch)
            if last:
                self.settle()

    def check_weights(self, step: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """Before a save and every --check-replicas-every steps, in one all_gather: the values
        since the last log step and the weights are finite, and the ranks meant to hold the same
        weights (plain fsdp: none; HSDP: a shard's replicas) agree on each parameter's fingerprint
        (SPEC §10); else the run stops before a bad checkpoint replaces the newest good one."""
        if step == self._checked_at:  # a replica check, then a save: the same weights
            return
        # Its group: the ranks meant to hold equal weights share their places on sharded mesh dims.
        group = hash(tuple(p.device_mesh.get_coordinate()[i] for _, p in named if hasattr(
            p, "placements") for i, place in enumerate(p.placements) if place.is_shard()))
        zero = torch.zeros((), device=self.comm_device, dtype=torch.float64)
        mine = torch.cat([torch.stack([self._sums.get("loss", zero).to(zero), zero + sum(
            (~v.isfinite()).to(zero) for k, v in self._sums.items() if k != "loss"),
            zero + group % 2**52]),  # a float64 holds it exactly
            torch.stack([fingerprint(p) for _, p in named]).to(zero)])
        rows = [torch.empty_like(mine) for _ in range(self.world.world_size)]
        dist.all_gather(rows, mine)
        rows = torch.stack(rows).cpu()
        loss_sum, parts_bad = rows[:, :2].sum(0).tolist()
        what = (f"the loss became {loss_sum}" if not math.isfinite(loss_sum) else
                "a logged loss part became nan or inf" if parts_bad else
                "the weights became nan or inf" if not rows[:, 3:].isfinite().all() else "")
        groups = rows[:, 2].tolist()
        first = [groups.index(g) for g in groups]  # the lowest rank of each rank's group
        if not what and (differ := (rows[:, 3:] != rows[first, 3:]).nonzero().tolist()):
            r, i = min(differ, key=lambda d: d[::-1])  # the first parameter that differs
            a, b = rows[first[r], 3 + i].item(), rows[r, 3 + i].item()
            raise RunFailure(f"the ranks' weights differ at step {step}: '{named[i][0]}' has "
                             f"fingerprint {a} on rank {first[r]} and {b} on rank {r} ("
                             f"{len({d[1] for d in differ})} of {len(named)} parameters "
                             "differ): a step changed weights on some ranks only (docs/custom-"
                             f"step.md); {self.newest_checkpoint()}; nothing was saved after it",
                             everywhere=True)
        if what:
            raise RunFailure(f"{what} by step {step}; {self.newest_checkpoint()}; nothing was "
                             "saved after it; lower --lr, use --clip-grad, or check the data",
                             everywhere=True)
        self._checked_at = step

    def record(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl (and the tracker)."""
        self.writer.log(record)

    def log(self, step: int, epoch: int) -> None:
        """Start averaging the loss over ranks and steps since the last log, and agreeing on a
        stop request; `settle()` finishes it. Every rank takes part, whatever its step logs."""
        now = time.perf_counter()
        samples_per_s = self._samples * self.world.world_size / max(now - self._last_log_time, 1e-9)
        record = {"step": step, "epoch": epoch, **dict.fromkeys(self._sums), **self.lr(),
                  "samples_per_s": round(samples_per_s, 1),
                  **self.throughput.of(samples_per_s), "time_s": round(now - self._start, 3)}
        self._pending = LogStats(self._sums, self._counts, self.runtime.lifeline.stop_signal,
                                 record, self.device, self.comm_device,
                                 queued=self.comm_device.type == "cuda")
        self._samples_total += self._samples
        self._sums, self._counts, self._samples, self._last_log_time = {}, {}, 0, now

    def settle(self) -> None:
        """Finish the pending log step: the NaN check, the stop agreement, its metrics line."""
        if self._pending is None:
            return
        stats, self._pending = self._pending, None
        means, signum, self.peak_mem_mb, self.peak_reserved_mb = stats.result()
        record = stats.record
        for name, value in means.items():
            if not math.isfinite(value):
                raise RunFailure(f"the {name} became {value} by step {record['step']}; "
                                 f"{self.newest_checkpoint()}; lower --lr, use --clip-grad, or "
                                 "check the data", everywhere=True)
        if signum:  # some rank was asked to stop: every rank stops at the step that reads it
            self.stopped_by, self.stop_signal = signal.Signals(signum).name, signum
        self.last_loss = means.get("loss", self.last_loss)
        record.update(**means, peak_mem_mb=self.peak_mem_mb)
        if self.device.type == "cuda":
            record["peak_reserved_mb"] = self.peak_reserved_mb
        self.writer.log(record)
        for also in EVERY_RANK:
            also(record)
        shown = " ".join(f"{name} {value:.5f}" for name, value in means.items())
        bar = " ".join(f"{name}={value:.4f}" for name, value in means.items())
        if not self.progress.show(bar) and self.world.is_main:
            print(f"epoch {record['epoch']} step {record['step']} {shown} samples/s "
                  f"{record['samples_per_s']:.0f}", flush=True)

    # ---------------------------------------------------------------- the end
    def stopped(self, step: int) -> dict[str, Any]:
        """A stop signal's end: the checkpoint is saved; the exit code is 128 + the signal."""
        if self.world.is_main:
            print(f"stopped by {self.stopped_by} at step {step}: checkpoint saved in "
                  f"{storage.shown(self.cfg.checkpoint_dir)}; run the same command to resume",
                  flush=True)
        return {"stopped_by": self.stopped_by, "steps": step, "exit_code": 128 + self.stop_signal}

    def summary(self, epoch: int, step: int, *parts: dict[str, Any]) -> dict[str, Any]:
        """summary.json, with the other components' `parts`; and --step-times (rank 0)."""
        wall = time.perf_counter() - self._start
        # Every rank trains on the same number of samples (the sampler pads): exact.
        samples_per_s = (self._samples_total * self.world.world_size
                         / max(wall - self.evaluation_s, 1e-9))
        summary = {
            "world_size": self.world.world_size, "backend": self.runtime.backend,
            "launcher": self.world.launcher, "model_layout": self.cfg.model_layout,
            "epochs_completed": epoch, "steps": step, "final_loss": self.last_loss,
            "samples_per_s": round(samples_per_s, 1), **self.throughput.of(samples_per_s),
            **self.clock.summary(),
            "time_to_first_step_s": round(self.first_step_s, 3) if self.first_step_s else None,
            "peak_mem_mb": self.peak_mem_mb,
            **({"peak_reserved_mb": self.peak_reserved_mb} if self.device.type == "cuda" else {}),
            "wall_time_s": round(wall, 3), "evaluation_s": round(self.evaluation_s, 3),
        }
        for part in parts:
            summary.update(part)
        self.summary_path = self.writer.write_json("summary.json", summary)
        if self.cfg.step_times and self.world.is_main:
            report = self.clock.report(self.runtime.started_at)
            Path(self.cfg.step_times).write_text(json.dumps(report))
        return summary

    def close(self) -> None:
        self.writer.close()
        self.progress.close()

    def print_closing(self, summary: dict[str, Any]) -> None:
        """What rank 0 prints at a successful end: throughput, the final loss, where things are."""
        if not self.world.is_main:
            return
        loss = "n/a" if self.last_loss is None else f"{self.last_loss:.5f}"
        tokens = f"{summary['tokens_per_s']:.0f} tokens/s, " if "tokens_per_s" in summary else ""
        if summary.get("mfu") is not None:
            tokens += f"MFU {100 * summary['mfu']:.1f}%, "
        median = summary["median_step_ms"]  # None: a run of one step (the first is not timed)
        print(f"throughput: {summary['samples_per_s']:.0f} samples/s, {tokens}median step "
              f"{'n/a' if median is None else f'{median} ms'}, first step "
              f"{summary['time_to_first_step_s']} s after start\ndone: {summary['steps']} steps, "
              f"final loss {loss}\ncheckpoints: {storage.shown(self.cfg.checkpoint_dir)}\n"
              f"summary: {self.summary_path.resolve()}", flush=True)
