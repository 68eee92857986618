"""The optimizer step: AdamW, the learning-rate schedule, mixed precision and gradient clipping."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .config import Config
from .failures import SetupError

AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak LR at a step: linear warm-up, then constant or cosine decay to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class Optimization:
    """AdamW with its schedule, autocast and (fp16 only) a GradScaler, behind three calls:
    `autocast()` around the forward, `backward(loss)`, `step()` once per optimizer step."""

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device, total_steps: int,
                 autocast: bool = True) -> None:
        if cfg.precision == "fp16" and device.type != "cuda":
            raise SetupError("--precision fp16 needs CUDA (it relies on a GradScaler); use "
                             "--precision bf16 on CPU", everywhere=True)
        self.cfg, self.device, self.total_steps = cfg, device, total_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps))
        # fsdp on CUDA casts through its own mixed-precision policy instead of autocast.
        self.amp_dtype = AMP_DTYPES[cfg.precision] if autocast else None
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")

    def autocast(self) -> contextlib.AbstractContextManager:
        # In fp32 skip autocast altogether: even a disabled autocast costs microseconds a step.
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self) -> None:
        if self.cfg.clip_grad > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

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
