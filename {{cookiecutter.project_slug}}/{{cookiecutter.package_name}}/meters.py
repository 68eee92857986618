"""The instruments of a run: the progress bar, the step clock (--step-times), the profiler
(--profile-steps), and tokens/s and MFU. metrics.py reads them."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


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
