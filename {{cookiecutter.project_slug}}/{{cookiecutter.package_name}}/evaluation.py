"""Validation: task.eval_metrics over the validation set, every sample counted once across ranks.

Each rank sums its share; one all_reduce adds the sums of all ranks, so `val_<name> = sum / count`
is exactly the single-process value (up to rounding), whatever the number of ranks."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .data import FixedBatches, move_to
from .ema import EMA
from .failures import UsageError


class Evaluator:
    def __init__(self, task: Any, loader: Any, batches: FixedBatches, device: torch.device,
                 comm_device: torch.device) -> None:
        self.task, self.loader, self.batches = task, loader, batches
        self.device, self.comm_device = device, comm_device
        self.keys: list[str] | None = None  # metric names, learnt from the first batch

    def run(self, model: nn.Module, autocast: Any, ema: EMA | None = None) -> dict[str, float]:
        """The `val_*` metrics of `model`; with an EMA, of its averaged weights, and the model's
        own as `val_raw_*` (every rank runs this: it ends in a collective)."""
        raw = self._run(model, autocast)
        if ema is None:
            return raw
        with ema.weights_in():
            averaged = self._run(model, autocast)
        return {**averaged, **{f"val_raw_{k[4:]}": v for k, v in raw.items()}}

    @torch.no_grad()
    def _run(self, model: nn.Module, autocast: Any) -> dict[str, float]:
        model.eval()
        sums: dict[str, torch.Tensor] = {}
        for j, batch in enumerate(self.loader):
            with autocast():
                values = self.task.eval_metrics(model, move_to(batch, self.device))
            if self.keys is None:
                self.keys = self._names(values)
            if j >= self.batches.real:
                continue  # padding: every rank runs as many forwards as the others (fsdp needs it)
            for key, value in values.items():
                value = torch.as_tensor(value).detach().to(self.comm_device, torch.float64)
                sums[key] = sums[key] + value if key in sums else value
        _back_to_training(model)
        zero = torch.zeros((), dtype=torch.float64, device=self.comm_device)
        totals = torch.stack([sums.get(k, zero) for k in self.keys])
        dist.all_reduce(totals)
        total = self._metrics(dict(zip(self.keys, totals.tolist(), strict=True)))
        return {f"val_{k}": v for k, v in total.items()}

    @torch.no_grad()
    def reported(self, model: nn.Module, autocast: Any, ema: EMA | None = None) -> list[str]:
        """The `val_*` names `run` reports, from one batch: a flag's metric is checked before
        training, not after an epoch (every rank runs this: under fsdp the forward gathers)."""
        model.eval()
        with autocast():
            values = self.task.eval_metrics(model, move_to(next(iter(self.loader)), self.device))
        _back_to_training(model)
        averages = self._metrics(dict.fromkeys(self._names(values), 1.0))
        return [f"val_{k}" for k in averages] + [f"val_raw_{k}" for k in averages if ema]

    def _metrics(self, total: dict[str, float]) -> dict[str, float]:
        """Each summed metric of `total` over its count, then task.finalize_metrics."""
        averages = {k: total[k] / max(total.get(f"{k}_count", total.get("count", 0)), 1e-300)
                    for k in total if k != "count" and not k.endswith("_count")}
        finalize = getattr(self.task, "finalize_metrics", None)
        return finalize(averages) if finalize else averages

    @staticmethod
    def _names(values: dict[str, Any]) -> list[str]:
        """Sorted metric names, the same on every rank (an empty share gets them from padding)."""
        if "count" not in values and not any(k.endswith("_count") for k in values):
            raise UsageError("task.eval_metrics must return per-batch sums and a 'count' (or "
                             f"'<metric>_count'); it returned {', '.join(values)}", everywhere=True)
        return sorted(values)


def parse_goal(text: str) -> tuple[str, bool]:
    """'val_accuracy:max' -> ('val_accuracy', True); a loss (lower is better) needs no direction."""
    name, _, direction = text.partition(":")
    name = name if name.startswith("val_") else f"val_{name}"
    if direction not in ("max", "min", ""):
        raise argparse.ArgumentTypeError(f"expected METRIC, METRIC:max or METRIC:min, got {text!r}")
    if not direction and not name.endswith("loss"):
        raise argparse.ArgumentTypeError(f"say whether higher or lower is better: {name}:max or "
                                         f"{name}:min")
    return name, direction == "max"


def goal_flag(text: str) -> str:
    """--keep-best's METRIC[:max|min], checked."""
    parse_goal(text)
    return text


def early_stop_flag(text: str) -> str:
    """--early-stop's METRIC[:max|min]:PATIENCE, checked."""
    goal, _, patience = text.rpartition(":")
    if not goal or not patience.isdigit() or int(patience) < 1:
        raise argparse.ArgumentTypeError(f"expected METRIC[:max|min]:PATIENCE with PATIENCE at "
                                         f"least 1, e.g. val_loss:3, got {text!r}")
    return f"{goal_flag(goal)}:{patience}"


class ModelSelection:
    """--keep-best and --early-stop: the best evaluation so far, and how many came after it. Every
    rank sees the same (all-reduced) metrics and decides the same, without a collective; the state
    goes into checkpoints, so a resumed run compares against the same best."""

    def __init__(self, keep_best: str | None, early_stop: str | None) -> None:
        self.keep = parse_goal(keep_best) if keep_best else None
        goal, _, patience = (early_stop or "").rpartition(":")
        self.stop, self.patience = (parse_goal(goal), int(patience)) if early_stop else (None, 0)
        self.best: dict[str, Any] = {}  # of --keep-best: metric, value, step (once saved)
        self.stop_best: float | None = None
        self.since_best = 0  # evaluations since --early-stop's metric last improved
        self.new_best = False  # the last evaluation is --keep-best's best so far
        self.should_stop = False

    def check(self, reported: list[str]) -> None:
        """Refuse a metric the evaluation does not report (before training, see Evaluator)."""
        for goal, flag in ((self.keep, "--keep-best"), (self.stop, "--early-stop")):
            if goal and goal[0] not in reported:
                raise UsageError(f"{flag} {goal[0]}: the evaluation reports no such metric (it "
                                 f"reports {', '.join(reported)})", everywhere=True)

    def update(self, metrics: dict[str, float], step: int) -> list[str]:
        """Take one evaluation's metrics; returns what to tell the user."""
        notes = []
        self.check(list(metrics))
        if self.keep:
            name, maximize = self.keep
            self.new_best = not self.best or _better(metrics[name], self.best["value"], maximize)
            if self.new_best:
                self.best = {"metric": name, "value": metrics[name], "step": step}
        if self.stop:
            name, maximize = self.stop
            if self.stop_best is None or _better(metrics[name], self.stop_best, maximize):
                self.stop_best, self.since_best = metrics[name], 0
            else:
                self.since_best += 1
            if self.since_best >= self.patience:
                self.should_stop = True
                notes.append(f"early stop: {name} has not improved for {self.since_best} "
                             f"evaluation(s) (best {self.stop_best:.5g})")
        return notes

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "stop_best": self.stop_best, "since_best": self.since_best}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.best, self.stop_best = state["best"], state["stop_best"]
            self.since_best = state["since_best"]


class Evaluation:
    """When to evaluate (each epoch's end, every --eval-every-steps) and what follows: the log,
    --keep-best and --early-stop; --eval-only evaluates the resumed checkpoint, no training."""

    def __init__(self, cfg: Any, evaluator: Evaluator | None, model: nn.Module, autocast: Any,
                 ema: EMA | None, is_main: bool, log: Callable[[dict[str, Any]], None]) -> None:
        # cfg: a Config (config.py imports this module); model: fsdp's wrapper, else the module.
        self.cfg, self.evaluator, self.model, self.autocast = cfg, evaluator, model, autocast
        self.ema, self.is_main, self.log, self.every = ema, is_main, log, cfg.eval_every_steps
        self.selection = ModelSelection(cfg.keep_best, cfg.early_stop)
        self.values, self.at_step = {}, -1  # the last evaluation's metrics, and its step

    def due(self, step: int, last_of_epoch: bool) -> bool:
        """Every --eval-every-steps, but not an epoch's last step (its end is evaluated anyway)."""
        return self.every > 0 and step % self.every == 0 and not last_of_epoch

    def run(self, epoch: int, step: int) -> bool:
        """Evaluate (every rank), log, print; True for a new best that --keep-best keeps."""
        if self.evaluator is None:
            return False
        self.values, self.at_step = self.evaluator.run(self.model, self.autocast, self.ema), step
        self.log({"step": step, "epoch": epoch, **self.values})
        notes = self.selection.update(self.values, step)
        if self.is_main:
            print(f"epoch {epoch} validation: {_shown(self.values)}", *notes, sep="\n", flush=True)
        return self.selection.new_best

    def check(self) -> None:
        """Before anything runs: a flag that needs a validation set, without one."""
        if self.evaluator is None and (problem := without_validation(self.cfg)):
            raise UsageError(problem, everywhere=True)

    def check_metric_names(self) -> None:
        """Before training: a misspelt metric of --keep-best or --early-stop (every rank)."""
        if self.selection.keep or self.selection.stop:
            self.selection.check(self.evaluator.reported(self.model, self.autocast, self.ema))

    def evaluate_only(self, checkpoint: str | None, step: int) -> dict[str, Any]:
        """--eval-only: the resumed checkpoint's metrics, written to eval.json; nothing else."""
        if not checkpoint:
            raise UsageError(f"--eval-only needs a checkpoint, and there is none in "
                             f"--checkpoint-dir {self.cfg.checkpoint_dir}; name one with --resume "
                             "PATH", everywhere=True)
        metrics = self.evaluator.run(self.model, self.autocast, self.ema)
        result = {"checkpoint": checkpoint, "step": step, **metrics}
        if self.is_main:
            print(f"evaluation of {checkpoint} (step {step}): {_shown(metrics)}", flush=True)
            out = Path(self.cfg.output_dir) / "eval.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
        return result

    def restart_selection(self, state: dict[str, Any] | None) -> None:
        """A resumed run's selection: with the checkpoint's best so far, and --keep-best as the
        checkpoint's run had it where the command line leaves it out (resume.keep_retention)."""
        self.selection = ModelSelection(self.cfg.keep_best, self.cfg.early_stop)
        self.selection.load_state_dict(state)

    def summary(self) -> dict[str, Any]:
        """The evaluation's part of summary.json."""
        return {**self.values, "best": self.selection.best or None,
                "early_stopped": self.selection.should_stop}


def without_validation(cfg: Any) -> str | None:
    """What a run without a validation set refuses (the plan too): a flag that needs one."""
    flags = {"--eval-only": cfg.eval_only, "--eval-every-steps": cfg.eval_every_steps,
             "--keep-best": cfg.keep_best, "--early-stop": cfg.early_stop}
    wants = [flag for flag, on in flags.items() if on]
    return (f"{wants[0]} needs a validation set, and task.build_datasets returned none (raise "
            "--val-fraction?)") if wants else None


def _shown(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.5g}" for k, v in metrics.items())


def _better(value: float, than: float, maximize: bool) -> bool:
    return value > than if maximize else value < than


def _back_to_training(model: nn.Module) -> None:
    """Training mode, and fully_shard's modules resharded: a no-grad forward leaves the root's
    weights gathered. Asked by name: importing FSDP (config imports this module) costs a second in
    commands that wrap no model."""
    model.train()
    if hasattr(model, "reshard"):
        model.reshard()
