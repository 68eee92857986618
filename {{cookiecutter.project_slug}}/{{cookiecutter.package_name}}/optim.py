"""The optimizer step: AdamW (or task.configure_optimizer's), the learning-rate schedule, mixed
precision and gradient clipping."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .config import Config
from .ema import EMA
from .failures import UsageError
from .parallel import unwrap

AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak LR at a step: linear warm-up, then constant, or a cosine or linear
    decay to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class Optimization:
    """The optimizer with its schedule, autocast and (fp16 only) a GradScaler, behind three calls:
    `autocast()` around the forward, `backward(loss)`, `step()` once per optimizer step.

    The optimizer is AdamW over every trainable parameter, or what `configure(model, cfg)`
    returns (task.configure_optimizer, given the user's model without DDP's wrapper): an optimizer,
    parameter groups allowed, or an (optimizer, scheduler) pair. Without a scheduler of its own,
    --lr-schedule and --warmup-steps scale each group's learning rate. Either way the scheduler
    steps once per optimizer step and its state goes into every checkpoint."""

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device, total_steps: int,
                 autocast: bool = True, configure: Callable | None = None) -> None:
        if cfg.precision == "fp16" and device.type != "cuda":
            raise UsageError("--precision fp16 needs CUDA (it relies on a GradScaler); use "
                             "--precision bf16 on CPU", everywhere=True)
        self.cfg, self.device, self.total_steps = cfg, device, total_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        # On a GPU, the fused AdamW: one kernel for all parameters (CPU: as it always was).
        made = configure(unwrap(model), cfg) if configure else torch.optim.AdamW(
            self.params, lr=cfg.lr, weight_decay=cfg.weight_decay,
            fused=True if device.type == "cuda" else None)
        self.optimizer, scheduler = made if isinstance(made, tuple) else (made, None)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise UsageError("task.configure_optimizer must return a torch.optim.Optimizer or an "
                             f"(optimizer, scheduler) pair, not {type(made).__name__}",
                             everywhere=True)
        self.scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps))
        # fsdp on CUDA casts through its own mixed-precision policy instead of autocast.
        self.amp_dtype = AMP_DTYPES[cfg.precision] if autocast else None
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")
        self.ema = EMA(unwrap(model), cfg.ema_decay) if cfg.ema_decay else None

    def autocast(self) -> contextlib.AbstractContextManager:
        # In fp32 skip autocast altogether: even a disabled autocast costs microseconds a step.
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self) -> None:
        """One optimizer step: clip, step, the schedule, the EMA."""
        if self.cfg.clip_grad > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update()

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_dict(self) -> dict[str, Any]:
        """Scheduler and scaler state (the optimizer's own state is saved with the model)."""
        return {"scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def optimizer_state(model: nn.Module, cfg: Config,
                    configure: Callable | None) -> tuple[str, dict[int, list] | None]:
    """(name, parameter id -> its state tensors) of the run's optimizer stepped on the meta device
    (None: it cannot step there), for doctor --plan."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    name = "task.configure_optimizer's"
    try:  # Optimization's AdamW (fused on CUDA: the same state, `step` on the GPU)
        made = configure(model, cfg) if configure else torch.optim.AdamW(
            trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
        optimizer = made[0] if isinstance(made, tuple) else made
        name = type(optimizer).__name__
        for p in trainable:
            p.grad = torch.empty_like(p)
        optimizer.step()
    except Exception:
        return name, None
    return name, {id(p): [t for t in optimizer.state[p].values() if torch.is_tensor(t)]
                  for p in trainable if p in optimizer.state}
