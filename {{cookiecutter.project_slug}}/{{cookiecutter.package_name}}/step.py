"""One training step: `Step`, what a step function is given for one batch, and the default step.

The loop calls `task.train_step(step, batch)` once per batch when task.py defines one, else
`plain_step(task.loss_fn)` below (docs/custom-step.md). A run's step is one accumulation group:
`backward` weights a batch's loss by its share of the group's samples; gradients are exchanged
and `update` steps at the group's last batch only; then the fp16 scale and the EMA update once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import Config
from .failures import UsageError
from .metrics import OWN_FIELDS
from .optim import Optimization
from .runtime.torch_private import ddp_backward, uncompiled


class Step:
    """What a step function is given for one batch:

    model       the model as placed (DDP, fsdp, model_parallel_2), for forward passes
    module      your own module (task.build_model's): its parameters, and submodules to call
    optimizers  the optimizers by name: "default", or the names task.configure_optimizer gives
    cfg         the run's Config
    number      the optimizer steps taken before this one (the first step is 0)
    autocast()  around forward passes: --precision's autocast (nothing in fp32)
    and backward(loss) and update(name), below."""

    def __init__(self, model: nn.Module, module: nn.Module, optim: Optimization,
                 cfg: Config) -> None:
        self.model, self.module, self.cfg, self.optim = model, module, cfg, optim
        self.ddp = ddp if isinstance(ddp := uncompiled(model), DDP) else None
        self.ready_ddp = ddp_backward(self.ddp) if self.ddp is not None else None
        self.optimizers, self.autocast = optim.optimizers, optim.autocast
        self.number, self.weight, self.last = 0, 1.0, True

    def begin(self, number: int, weight: float, last: bool) -> None:
        """A batch of step `number`: `weight`, its share of the group; `last`, the group's last."""
        self.number, self.weight, self.last = number, weight, last

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, with fp16's loss scaling and the batch's weight in its group. DDP's
        reducer is readied from the loss, as Lightning does: gradients are exchanged whatever
        path the forward took (step.model, or submodules of step.module called directly)."""
        if (ddp := self.ddp) is not None and ddp.require_backward_grad_sync:  # not in no_sync
            self.ready_ddp(loss)
        self.optim.backward(loss if self.weight == 1.0 else loss * self.weight)

    def update(self, name: str | None = None) -> None:
        """At the group's last batch, optimizer `name` (None: the only one) steps: its gradients
        are unscaled (fp16) and clipped (--clip-grad), it steps, they are zeroed, its schedule
        steps. Before the last batch it does nothing."""
        # (before it, a name that does not exist is an error all the same)
        (self.optim.update if self.last else self.optim.named)(name)


def plain_step(loss_fn: Callable, optimizers: dict) -> Callable[[Step, Any], dict[str, Any]]:
    """The default step: task.loss_fn's loss (and its parts, when it returns
    `(loss, {name: tensor})`), its backward, and the one optimizer's update."""
    if len(optimizers) > 1:
        raise UsageError(f"task.configure_optimizer gives {len(optimizers)} optimizers; the "
                         "default step updates one: define train_step(step, batch) in task.py, "
                         "calling step.update(name) for each (docs/custom-step.md)",
                         everywhere=True)
    checked: list[bool] = []

    def train_step(step: Step, batch: Any) -> dict[str, torch.Tensor]:
        with step.autocast():
            loss = loss_fn(step.model, batch)
        loss, parts = loss if type(loss) is tuple else (loss, None)
        if not checked:  # once: the same code gives the same kind of loss every time
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise UsageError(f"task.loss_fn must return the batch's mean loss as a scalar "
                                 f"tensor that requires grad; it returned {shape}", everywhere=True)
            checked.append(True)
        step.backward(loss)
        step.update()
        return {"loss": loss, **check_values(parts or {}, "task.loss_fn's parts",
                                             OWN_FIELDS | {"loss"})}

    return train_step


def check_values(values: Any, where: str, taken: frozenset[str] = OWN_FIELDS) -> dict[str, Any]:
    """A step's result, `{name: scalar tensor}` with no name `taken`, or one error line."""
    if isinstance(values, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                        and v.numel() == 1 for k, v in values.items()):
        if not (clash := taken.intersection(values)):
            return values
        raise UsageError(f"{where}: {min(clash)!r} is a name the run logs itself "
                         f"({', '.join(sorted(taken))}); rename it", everywhere=True)
    got = ({k: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            for k, v in values.items()} if isinstance(values, dict) else type(values).__name__)
    raise UsageError(f"{where} must return a dict of scalar tensors by name (logged as they "
                     f"are named); it returned {got}", everywhere=True)
