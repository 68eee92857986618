"""The optimizer step: AdamW (or task.configure_optimizer's), the learning-rate schedule, mixed
precision and gradient clipping."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import Config
from .ema import EMA
from .failures import UsageError
from .parallel import unwrap

AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int,
              floor: float = 0.0) -> Callable[[int], float]:
    """Multiplier of the peak LR at a step: linear warm-up, then constant, or a cosine or linear
    decay to `floor` (--min-lr / --lr)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def schedule(cfg: Config, samples: int, world: int) -> tuple[int, int, list[str]]:
    """(optimizer steps an epoch, steps in the run, problems) at `world` processes; a problem is
    a run that is not what its flags suggest: the run warns of it, `doctor --plan` fails on it."""
    shard = math.ceil(samples / world)  # each rank's samples an epoch (data.ShardedBatchSampler)
    per_epoch = math.ceil(math.ceil(shard / cfg.batch_size) / cfg.grad_accum)
    total = cfg.max_steps or per_epoch * cfg.epochs
    batch = cfg.batch_size * world * cfg.grad_accum
    problems = []
    if batch > samples:
        extra = shard * world - samples  # the sampler's padding
        repeats = f" (the shards repeat {extra} samples)" if extra else ""
        problems.append(f"a global batch of {batch:,} samples (--batch-size {cfg.batch_size} x "
                        f"{world} processes x --grad-accum {cfg.grad_accum}) is more than the "
                        f"{samples:,} training samples: each process gets {shard} sample(s) an "
                        f"epoch{repeats}; lower --batch-size or use more data")
    if cfg.warmup_steps > total:
        problems.append(f"--warmup-steps {cfg.warmup_steps} is longer than the run ({total} "
                        "steps): the learning rate never reaches --lr")
    if cfg.max_steps > per_epoch * cfg.epochs:
        problems.append(f"--max-steps {cfg.max_steps} is more than --epochs {cfg.epochs} give at "
                        f"{world} processes ({per_epoch} step(s) each): the run stops at step "
                        f"{per_epoch * cfg.epochs}, before its schedule ends")
    return per_epoch, total, problems


class Optimizers(dict):
    """The run's optimizers (or their schedulers) by name: one, named "default", unless
    task.configure_optimizer names several. Their state: the one's state_dict, or one per name."""

    def state_dict(self) -> dict[str, Any]:
        states = {name: optimizer.state_dict() for name, optimizer in self.items()}
        return states["default"] if list(self) == ["default"] else states

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, optimizer in self.items():
            optimizer.load_state_dict(state if list(self) == ["default"] else state[name])


class Optimization:
    """The optimizers with their schedules, autocast and (fp16 only) one GradScaler, behind the
    calls of a step: `autocast()`, `backward(loss)`, `update(name)`, and `finish_step()`.

    AdamW over every trainable parameter, or what task.configure_optimizer returns for the user's
    module: an optimizer, an (optimizer, scheduler) pair, or `{name: either}` over parts of it.
    Without a scheduler of its own, --lr-schedule and --warmup-steps scale its learning rate."""

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device, total_steps: int,
                 autocast: bool = True, configure: Callable | None = None) -> None:
        if cfg.precision == "fp16" and device.type != "cuda":
            raise UsageError("--precision fp16 needs CUDA (it relies on a GradScaler); use "
                             "--precision bf16 on CPU", everywhere=True)
        self.cfg, self.device, self.total_steps = cfg, device, total_steps
        # The fused AdamW, on a GPU and on the CPU alike: one kernel over all parameters. On a
        # CPU it steps 5 M parameters in 3.5 ms where the default (foreach) takes 28 ms.
        made = configure(unwrap(model), cfg) if configure else torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
            weight_decay=cfg.weight_decay, fused=True if device.type in ("cuda", "cpu") else None)
        self.optimizers, self.schedulers, self.kinds = Optimizers(), Optimizers(), {}
        for name, value in (made if isinstance(made, dict) and made else {"default": made}).items():
            optimizer, scheduler = checked(value)
            self.optimizers[name] = optimizer
            self.kinds[name] = (f"{type(optimizer).__name__}, "
                                f"{type(scheduler).__name__ if scheduler else '--lr-schedule'}")
            self.schedulers[name] = scheduler or torch.optim.lr_scheduler.LambdaLR(
                optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps,
                                     cfg.min_lr / cfg.lr))
        self.params = {name: [p for g in o.param_groups for p in g["params"]]
                       for name, o in self.optimizers.items()}
        self.unheld = check_disjoint(self.params, unwrap(model))
        # fsdp on CUDA casts through its own mixed-precision policy instead of autocast.
        self.amp_dtype = AMP_DTYPES[cfg.precision] if autocast else None
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")
        self.ema = EMA(unwrap(model), cfg.ema_decay) if cfg.ema_decay else None
        self.updated: list[str] = []  # the optimizers updated in this step, in order

    def autocast(self) -> contextlib.AbstractContextManager:
        # In fp32 skip autocast altogether: even a disabled autocast costs microseconds a step.
        return contextlib.nullcontext() if self.amp_dtype is None else torch.autocast(
            self.device.type, dtype=self.amp_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def update(self, name: str | None = None) -> None:
        """Optimizer `name` steps (the only one when None): clip its true gradients, step, zero
        them, then its schedule."""
        name = self.named(name)
        if name in self.updated:  # its schedule would step twice a step
            raise UsageError(f"task.train_step updated optimizer '{name}' twice in one step; call "
                             "step.update once a step for each optimizer", everywhere=True)
        optimizer = self.optimizers[name]
        if self.cfg.clip_grad > 0:
            self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            clip = torch.nn.utils.clip_grad_norm_
            if self.cfg.model_layout == "tensor_parallel":  # parameters on two device meshes
                from .tensor_parallel import clip_grad_norm as clip
            clip(self.params[name], self.cfg.clip_grad)
        self.scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        self.schedulers[name].step()
        self.updated.append(name)

    def named(self, name: str | None) -> str:
        """`name` when there is such an optimizer (None: the only one), else one error line."""
        name = next(iter(self.optimizers)) if name is None and len(self.optimizers) == 1 else name
        if name in self.optimizers:
            return name
        have = ", ".join(f"'{n}'" for n in self.optimizers)
        raise UsageError(f"task.train_step: no optimizer {name!r}: task.configure_optimizer "
                         f"gives {have}" if name else f"task.train_step: step.update() needs "
                         f"the name of one of the optimizers {have}", everywhere=True)

    def finish_step(self) -> bool:
        """After a step's last batch: one scale update (fp16), the gradients left by a backward
        after its optimizer's update zeroed, the EMA. True when the weights changed."""
        if not self.updated:
            at = (f" at the last batch of a --grad-accum {self.cfg.grad_accum} group, where the "
                  "optimizers step (call it at every batch)" if self.cfg.grad_accum > 1 else "")
            raise UsageError(f"task.train_step never called step.update(...){at}: no optimizer "
                             "stepped, so nothing would learn", everywhere=True)
        self.scaler.update()
        if len(self.optimizers) > 1:  # a later backward may have reached an updated optimizer
            for optimizer in self.optimizers.values():
                optimizer.zero_grad(set_to_none=True)
        self.updated.clear()
        if self.ema is not None:
            self.ema.update()
        return True

    def lr(self) -> dict[str, float]:
        """The learning rates to log: `lr` the first optimizer's, `lr_<name>` the others'."""
        return {f"lr_{name}" if i else "lr": s.get_last_lr()[0]
                for i, (name, s) in enumerate(self.schedulers.items())}

    def state_dict(self) -> dict[str, Any]:
        """Schedulers and scaler (the optimizers' own state is saved with the model)."""
        return {"scheduler": self.schedulers.state_dict(), "kinds": self.kinds,
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                "total_steps": self.total_steps}

    def check_saved(self, meta: dict[str, Any], path: Any) -> None:
        """A checkpoint of other optimizers or schedules is one line, before anything loads."""
        saved = meta["optim"].get("kinds", self.kinds)
        expected = self.kinds if any(", " in k for k in saved.values()) else {  # older: schedules
            n: k.split(", ")[1] for n, k in self.kinds.items()}
        if saved != expected:
            there, here = (", ".join(f"'{n}' ({k})" for n, k in kinds.items())
                           for kinds in (saved, self.kinds))
            raise UsageError(f"checkpoint {path} holds the optimizers (type, schedule) {there}; "
                             f"task.py gives {here}; use --resume weights-only to go on from "
                             "its weights with fresh optimizers, --resume never to start over, "
                             "or another --checkpoint-dir", everywhere=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedulers.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if state.get("total_steps", self.total_steps) != self.total_steps:
            self.say_new_length(state["total_steps"])

    def say_new_length(self, saved_total: int) -> None:
        """A resumed run of another length (--max-steps, --epochs, the data): the built-in
        schedule follows the new length from here on, so the learning rate moves at once; say
        where to, and how to keep the old schedule."""
        ours = [name for name, kind in self.kinds.items() if kind.endswith("--lr-schedule")]
        if not ours or self.cfg.lr_schedule == "constant":
            return
        cfg, step = self.cfg, self.schedulers[ours[0]].last_epoch
        floor = cfg.min_lr / cfg.lr
        before = cfg.lr * lr_lambda(cfg.lr_schedule, cfg.warmup_steps, saved_total, floor)(step)
        now = cfg.lr * lr_lambda(cfg.lr_schedule, cfg.warmup_steps, self.total_steps, floor)(step)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"note: this run is {self.total_steps} steps, the checkpoint's was "
                  f"{saved_total}: --lr-schedule {cfg.lr_schedule} now spans the new length, so "
                  f"the learning rate of step {step + 1} is {now:.3g}, not {before:.3g}; give the "
                  "old run's --max-steps and --epochs to keep its schedule", flush=True)


def checked(value: Any) -> tuple[torch.optim.Optimizer, Any]:
    """One of task.configure_optimizer's values as (optimizer, scheduler or None), or one line."""
    optimizer, scheduler = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if isinstance(optimizer, torch.optim.Optimizer) and not plateau and isinstance(
            scheduler, torch.optim.lr_scheduler.LRScheduler | None):
        return optimizer, scheduler
    got = (f"({', '.join(type(v).__name__ for v in value)})" if isinstance(value, tuple)
           else "an empty dict" if value == {} else type(value).__name__)
    raise UsageError("task.configure_optimizer must return a torch.optim.Optimizer, an "
                     f"(optimizer, scheduler) pair or a dict of them by name, not {got}" + (
                         ": a schedule steps with its optimizer, so one by a metric is not "
                         "supported; use one by step (e.g. LambdaLR) or --lr-schedule"
                         if plateau else ""), everywhere=True)


def check_disjoint(params: dict[str, list[torch.Tensor]], model: nn.Module) -> list[str]:
    """No parameter in two optimizers: each would step it. Returns the trainable ones in none."""
    names = {id(p): name for name, p in model.named_parameters()}
    owner: dict[int, str] = {}
    for optimizer, group in params.items():
        for p in group:
            if id(p) in owner:
                raise UsageError(f"task.configure_optimizer: parameter "
                                 f"'{names.get(id(p), '?')}' is in optimizers '{owner[id(p)]}' "
                                 f"and '{optimizer}'; give each parameter to one optimizer",
                                 everywhere=True)
            owner[id(p)] = optimizer
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owner]


def optimizer_state(model: nn.Module, cfg: Config,
                    configure: Callable | None) -> tuple[str, dict[int, list] | None]:
    """(name, parameter id -> its state tensors) of the run's optimizer stepped on the meta device
    (None: it cannot step there), for doctor --plan."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    name = "task.configure_optimizer's"
    try:  # Optimization's AdamW (fused in the run: the same state)
        made = configure(model, cfg) if configure else torch.optim.AdamW(
            trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
        optimizers = [m[0] if isinstance(m, tuple) else m
                      for m in (made.values() if isinstance(made, dict) else [made])]
        name = " + ".join(type(optimizer).__name__ for optimizer in optimizers)
        for p in trainable:
            p.grad = torch.empty_like(p)
        for optimizer in optimizers:
            optimizer.step()
    except Exception:
        return name, None
    return name, {id(p): [t for t in optimizer.state[p].values() if torch.is_tensor(t)]
                  for optimizer in optimizers for p in trainable if p in optimizer.state}
