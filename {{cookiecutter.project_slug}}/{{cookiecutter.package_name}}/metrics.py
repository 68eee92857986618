"""What a run reports: rank 0's metrics.jsonl, summary.json and config.json, the tracker, the
progress bar, step times and peak memory. Each writer is told whether this rank writes (rank 0
only), and is silent elsewhere."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .failures import SetupError
from .runtime.trackers import Tracker, open_tracker


class MetricsWriter:
    def __init__(self, output_dir: str | Path, enabled: bool, tracker: str = "none",
                 append: bool = False, config: dict[str, Any] | None = None,
                 tracker_run_id: str | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self._file = None
        self.tracker: Tracker | None = None
        if not enabled:
            return
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            # A resumed run continues the same curve; a fresh run starts a new one.
            self._file = open(self.output_dir / "metrics.jsonl", "a" if append else "w",
                              encoding="utf-8")
        except OSError as exc:
            raise SetupError(f"--output-dir {output_dir}: cannot write there "
                             f"({exc.strerror or exc}); choose a writable folder") from None
        self.tracker = open_tracker(tracker, self.output_dir, config or {}, tracker_run_id)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.tracker is not None:
            self.tracker.log(record)

    def write_json(self, name: str, data: dict[str, Any]) -> Path | None:
        """`name` in the output folder, replaced atomically."""
        if not self.enabled:
            return None
        path = self.output_dir / name
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


class Progress:
    """A tqdm bar on rank 0 when asked for (and tqdm is installed); otherwise it does nothing."""

    def __init__(self, enabled: bool) -> None:
        self.bar = None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
                self._tqdm = tqdm
            except ImportError:
                self.enabled = False

    def start(self, epoch: int, total: int, done: int) -> None:
        if self.enabled:
            self.bar = self._tqdm(total=total, initial=done, desc=f"epoch {epoch}",
                                  file=sys.stderr, dynamic_ncols=True, leave=False)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def show(self, text: str) -> bool:
        """Put `text` on the bar; False when there is no bar (print it instead)."""
        if self.bar is None:
            return False
        self.bar.set_postfix_str(text)
        return True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StepClock:
    """The end of every optimizer step on the host clock, and on a GPU also a CUDA event per step
    (the host clock only sees kernel launches there). `--step-times` writes what it measured."""

    WARMUP = 20  # steps dropped from the statistics: allocators and DDP's buckets warm up

    def __init__(self, device: torch.device, cuda_events: bool = False) -> None:
        self.ends: list[float] = []
        self.events: list[torch.cuda.Event] | None = (
            [] if cuda_events and device.type == "cuda" else None)

    def tick(self) -> None:
        self.ends.append(time.perf_counter())
        if self.events is not None:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()

    def step_ms(self) -> list[float]:
        ms = [1000 * (b - a) for a, b in zip(self.ends, self.ends[1:], strict=False)]
        return ms[self.WARMUP:] if len(ms) > 2 * self.WARMUP else ms

    def summary(self) -> dict[str, float | None]:
        ms = self.step_ms()
        return {"median_step_ms": round(statistics.median(ms), 3) if ms else None,
                "p90_step_ms": round(statistics.quantiles(ms, n=10)[-1], 3) if len(ms) > 1
                else None}

    def report(self, started_at: float) -> dict[str, Any]:
        """Wall-clock step ends (and on a GPU each step's CUDA-event time), for --step-times."""
        to_wall = time.time() - time.perf_counter()
        report: dict[str, Any] = {"started_at": started_at,
                                  "step_ends": [t + to_wall for t in self.ends]}
        if self.events:
            torch.cuda.synchronize()
            report["cuda_step_ms"] = [a.elapsed_time(b) for a, b in
                                      zip(self.events, self.events[1:], strict=False)]
        return report


class StepProfiler:
    """A torch.profiler trace of optimizer steps FIRST..LAST (--profile-steps) on rank 0, written
    to <output-dir>/profile/ for TensorBoard or Perfetto. Every other step costs one comparison."""

    def __init__(self, steps: tuple[int, int] | None, output_dir: str | Path, enabled: bool,
                 device: torch.device) -> None:
        self.steps = steps if enabled else None
        self.folder = Path(output_dir) / "profile"
        self.device = device
        self.profile: Any = None

    def step_done(self, step: int) -> None:
        """Call after optimizer step `step` (and with the first step's number minus one before
        training starts)."""
        if self.steps is None:
            return
        first, last = self.steps
        if step == first - 1:
            from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profile = profile(activities=activities, record_shapes=True, profile_memory=True,
                                   on_trace_ready=tensorboard_trace_handler(str(self.folder),
                                                                            "rank0"))
            self.profile.start()
        elif step == last and self.profile is not None:
            self.profile.stop()
            self.profile = None
            print(f"profile of steps {first}-{last}: {self.folder.resolve()}", flush=True)


# Dense bf16 peak FLOP/s of one device, what MFU is a fraction of. Others (CPUs, other GPUs,
# the PCIe and NVL versions of the H100 and H200) have no entry, and their MFU is null.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if ("H100" in name or "H200" in name) and ("PCIe" in name or "NVL" in name):
        return None
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


class Throughput:
    """Tokens/s and MFU (model FLOPs utilisation) from samples/s, for a task that says how many
    tokens a sample has (`task.tokens_per_sample(cfg)`) and, for MFU, what a token costs to train
    (`task.flops_per_token(model, cfg)`). MFU = FLOPs per token x tokens/s / (peak of one device
    x devices); null where the peak is unknown."""

    def __init__(self, task: Any, model: torch.nn.Module, cfg: Any, device: torch.device,
                 devices: int) -> None:
        count = getattr(task, "tokens_per_sample", None)
        self.tokens_per_sample = count(cfg) if count else None
        cost = getattr(task, "flops_per_token", None)
        peak = peak_flops(device)
        self.flops_per_s_peak = peak * devices if peak else None
        self.flops_per_token = cost(model, cfg) if cost and peak else None

    def of(self, samples_per_s: float) -> dict[str, float | None]:
        if self.tokens_per_sample is None:
            return {}
        tokens_per_s = samples_per_s * self.tokens_per_sample
        mfu = (tokens_per_s * self.flops_per_token / self.flops_per_s_peak
               if self.flops_per_token else None)
        return {"tokens_per_s": round(tokens_per_s, 1),
                "mfu": None if mfu is None else round(mfu, 4)}


def log_step_stats(loss_sum: torch.Tensor, count: int, stop: bool, device: torch.device,
                   comm_device: torch.device) -> tuple[float, bool, list[float], list[float]]:
    """One all_reduce for a log step: the mean loss over ranks and steps, whether any rank was
    asked to stop, and every rank's peak memory (each rank fills its own slots: a gather)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stats = torch.zeros(3 + 2 * world, device=comm_device)
    stats[0] = loss_sum.float().to(comm_device)
    stats[1] = count
    stats[2] = float(stop)
    stats[3 + rank], stats[3 + world + rank] = peak_memory_mb(device)
    dist.all_reduce(stats)
    values = stats.tolist()
    return (values[0] / values[1], values[2] > 0, [round(v, 1) for v in values[3:3 + world]],
            [round(v, 1) for v in values[3 + world:]])


def peak_memory_mb(device: torch.device) -> tuple[float, float]:
    """(peak allocated, peak reserved) on a GPU; (peak resident set, 0) of this process on CPU."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) / 2**20,
                torch.cuda.max_memory_reserved(device) / 2**20)
    try:
        import resource
    except ImportError:  # Windows
        return 0.0, 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), 0.0  # bytes vs KiB


def closing_lines(summary: dict[str, Any], last_loss: float | None, checkpoints: str,
                  path: Path) -> str:
    """What rank 0 prints at a successful end: throughput, the final loss, where things are."""
    loss = "n/a" if last_loss is None else f"{last_loss:.5f}"
    tokens = f"{summary['tokens_per_s']:.0f} tokens/s, " if "tokens_per_s" in summary else ""
    if summary.get("mfu") is not None:
        tokens += f"MFU {100 * summary['mfu']:.1f}%, "
    return (f"throughput: {summary['samples_per_s']:.0f} samples/s, {tokens}median step "
            f"{summary['median_step_ms']} ms, first step {summary['time_to_first_step_s']} s "
            f"after start\ndone: {summary['steps']} steps, final loss {loss}\n"
            f"checkpoints: {checkpoints}\nsummary: {path.resolve()}")


class Bookkeeping:
    """The chores around every step, behind one object: the progress bar, the step clock, the
    profiler, and when to log and when to save."""

    def __init__(self, progress: Progress, clock: StepClock, profiler: StepProfiler,
                 log_every: int, save_every_steps: int) -> None:
        self.progress, self.clock, self.profiler = progress, clock, profiler
        self.log_every, self.save_every_steps = log_every, save_every_steps

    def start_epoch(self, epoch: int, total: int, done: int) -> None:
        self.progress.start(epoch, total, done)

    def batch_done(self) -> None:
        self.progress.update()

    def step_done(self, step: int, last_of_epoch: bool, finished: bool) -> tuple[bool, bool]:
        """After optimizer step `step`: (log now, save now). The last step of an epoch and of
        the run is always logged; a step save is skipped where the epoch's own save follows."""
        self.clock.tick()
        self.profiler.step_done(step)
        log = step % self.log_every == 0 or last_of_epoch or finished
        save = (self.save_every_steps > 0 and step % self.save_every_steps == 0
                and not last_of_epoch)
        return log, save

    def end_epoch(self) -> None:
        self.progress.close()
