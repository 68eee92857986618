"""The instruments of a run: the progress bar, the step clock (--step-times), the profiler
(--profile-steps), tokens/s and MFU, and a log step's one collective (LogStats: the logged values
over ranks, the stop agreement, peak memory). metrics.py reads them."""

from __future__ import annotations

import statistics
import sys
import time
import zlib
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .failures import UsageError


def human_size(n_bytes: float) -> str:
    """Bytes as people read them: 1234567 -> "1.23 MB" (units of 1000)."""
    units = ["bytes", "KB", "MB", "GB", "TB"]
    while n_bytes >= 1000 and len(units) > 1:
        n_bytes, units = n_bytes / 1000, units[1:]
    return f"{n_bytes:.3g} {units[0]}"


VALUES = 1024  # a log step's slots for the values a step returns: the same on every rank


class Progress:
    """A tqdm bar on rank 0 when asked for (and tqdm is installed); otherwise it does nothing."""

    def __init__(self, enabled: bool) -> None:
        self.bar, self.enabled = None, False
        if enabled:
            with suppress(ImportError):
                from tqdm import tqdm
                self._tqdm, self.enabled = tqdm, True

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

    def summary(self) -> dict[str, float | None]:
        ms = [1000 * (b - a) for a, b in zip(self.ends, self.ends[1:], strict=False)]
        ms = ms[self.WARMUP:] if len(ms) > 2 * self.WARMUP else ms
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

    def __init__(self, steps: str | None, output_dir: str | Path, enabled: bool,
                 device: torch.device) -> None:
        self.steps = tuple(map(int, steps.split(":"))) if steps and enabled else None
        self.folder = Path(output_dir) / "profile"
        self.device, self.profile = device, None

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
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""  # CPU: None
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
        cost, peak = getattr(task, "flops_per_token", None), peak_flops(device)
        self.flops_per_s_peak = peak * devices if peak else None
        self.flops_per_token = cost(model, cfg) if cost and peak else None

    def of(self, samples_per_s: float) -> dict[str, float | None]:
        if self.tokens_per_sample is None:
            return {}
        tokens_per_s = samples_per_s * self.tokens_per_sample
        mfu = (round(tokens_per_s * self.flops_per_token / self.flops_per_s_peak, 4)
               if self.flops_per_token else None)
        return {"tokens_per_s": round(tokens_per_s, 1), "mfu": mfu}


class LogStats:
    """One all_reduce for a log step, started without waiting: each logged value's sum over ranks
    and batches and its count, and every rank's stop signal, peak memory and digest of its values'
    names (its own slots: a gather: ranks that logged other names are told). On a GPU (`queued`)
    the copy to the host is queued too: `result()` waits for it, not for the steps after it."""

    def __init__(self, sums: dict[str, torch.Tensor], counts: dict[str, int], signum: int | None,
                 record: dict[str, Any], device: torch.device, comm_device: torch.device,
                 queued: bool) -> None:
        self.signum, self.record, self.names = signum, record, list(sums)
        rank, world, order = dist.get_rank(), dist.get_world_size(), sorted(sums)
        self.slot = {name: i for i, name in enumerate(order)}
        # [sums, counts, signals, peak memory, digests]: filled where it lives, with no copy from
        # host memory (one from pageable memory would make the host wait for the GPU).
        stats = torch.zeros(2 * VALUES + 4 * world, device=comm_device)
        for i, name in enumerate(order[:VALUES]):
            stats[i], stats[VALUES + i] = sums[name], counts[name]
        stats[2 * VALUES + rank] = signum or 0  # the signal each rank got: its name is shown
        stats[2 * VALUES + world + rank], stats[-2 * world + rank] = peak_memory_mb(device)
        # the names' digest (24 bits: exact in float32), or -1: more values than slots
        stats[-world + rank] = (zlib.crc32("/".join(order).encode()) & 0xFFFFFF
                                if len(order) <= VALUES else -1)
        self.work = dist.all_reduce(stats, async_op=True)
        self.copied: torch.cuda.Event | None = None
        if queued:
            self.work.wait()  # NCCL: the stream waits, the host goes on
            stats = stats.to("cpu", non_blocking=True)  # into pinned memory
            self.copied = torch.cuda.Event()
            self.copied.record()
        self.stats = stats

    def result(self) -> tuple[dict[str, float], int, list[float], list[float]]:
        """The means, the stop signal (this rank's, else another's; 0: none), peak memory."""
        if self.copied is not None:
            self.copied.synchronize()
        else:
            self.work.wait()
        values, world, rank = self.stats.tolist(), dist.get_world_size(), dist.get_rank()
        signals, memory = values[2 * VALUES:2 * VALUES + world], values[2 * VALUES + world:-world]
        digests = values[-world:]
        if min(digests) < 0:
            raise UsageError(f"a step returned more than {VALUES} values to log; log fewer",
                             everywhere=True)
        if min(digests) != max(digests):
            others = ", ".join(str(r) for r, d in enumerate(digests) if d != digests[rank])
            raise UsageError(f"the values logged by step {self.record['step']} differ in name "
                             f"between ranks: rank {rank} logs {', '.join(self.slot) or 'none'}, "
                             f"rank(s) {others} others; return the same names on every rank (0 "
                             "for a part a batch lacks)", everywhere=True)
        return ({n: values[self.slot[n]] / values[VALUES + self.slot[n]] for n in self.names},
                int(self.signum or max(signals)), [round(v, 1) for v in memory[:world]],
                [round(v, 1) for v in memory[world:]])


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
