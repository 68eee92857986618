"""Validation: task.eval_metrics over the validation set, every sample counted once across ranks.

Each rank sums its share; one all_reduce adds the sums of all ranks, so `val_<name> = sum / count`
is exactly the single-process value (up to rounding), whatever the number of ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .data import FixedBatches, move_to
from .failures import SetupError


class Evaluator:
    def __init__(self, task: Any, loader: Any, batches: FixedBatches, device: torch.device,
                 comm_device: torch.device) -> None:
        self.task, self.loader, self.batches = task, loader, batches
        self.device, self.comm_device = device, comm_device
        self.keys: list[str] | None = None  # metric names, learnt from the first batch

    @torch.no_grad()
    def run(self, model: nn.Module, autocast: Any) -> dict[str, float]:
        """The `val_*` metrics of `model` (every rank runs this: it ends in a collective)."""
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
        model.train()
        if isinstance(model, FSDPModule):
            model.reshard()  # a no-grad forward leaves the root's weights gathered
        keys = self.keys
        zero = torch.zeros((), dtype=torch.float64, device=self.comm_device)
        totals = torch.stack([sums.get(k, zero) for k in keys])
        dist.all_reduce(totals)
        total = dict(zip(keys, totals.tolist(), strict=True))
        averages = {k: total[k] / max(total.get(f"{k}_count", total.get("count", 0)), 1e-300)
                    for k in keys if k != "count" and not k.endswith("_count")}
        if hasattr(self.task, "finalize_metrics"):
            averages = self.task.finalize_metrics(averages)
        return {f"val_{k}": v for k, v in averages.items()}

    @staticmethod
    def _names(values: dict[str, Any]) -> list[str]:
        """The metric names, sorted: the same order on every rank (padding batches count here, so
        a rank whose share is empty knows them too)."""
        if "count" not in values and not any(k.endswith("_count") for k in values):
            raise SetupError("task.eval_metrics must return per-batch sums and a 'count' (or "
                             f"'<metric>_count'); it returned {', '.join(values)}", everywhere=True)
        return sorted(values)
