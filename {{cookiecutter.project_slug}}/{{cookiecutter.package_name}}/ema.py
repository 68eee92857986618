"""--ema-decay: an exponential moving average of the weights, evaluated and exported in their place.

After every optimizer step taken, `ema = decay * ema + (1 - decay) * weights`, in fp32 on each
weight's own device. Each rank averages what it holds: the whole model (data_parallel), both stages
(model_parallel_2), or its own shards (fsdp: the average of a shard is the shard of the average, no
all-gather). Buffers (BatchNorm's running statistics) are the model's own, not averaged, and so are
the weights task.py builds again at every start (a LoRA run's frozen base model)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .checkpoint.files import rebuilt_weights
from .runtime.torch_private import foreach_decay


def local_part(p: torch.Tensor) -> torch.Tensor:
    """A parameter's tensor on this rank: its shard under fsdp (a DTensor), else itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def averaged_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """What the EMA averages: each parameter once, by name, but those task.py builds again at
    every start (doctor --plan counts the same)."""
    rebuilt = rebuilt_weights(model)
    return [(name, p) for name, p in model.named_parameters() if name not in rebuilt]


class EMA:
    def __init__(self, model: nn.Module, decay: float) -> None:
        """model: the unwrapped model (the names of its state_dict)."""
        self.decay = decay
        averaged = averaged_parameters(model)
        self.names = [name for name, _ in averaged]
        self.params = [p for _, p in averaged]
        self.averages = [local_part(p).detach().float().clone() for p in self.params]

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average again from the weights as they are (a checkpoint had none)."""
        for average, p in zip(self.averages, self.params, strict=True):
            average.copy_(local_part(p))

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: fold the new weights in (no host sync, no collective)."""
        foreach_decay(self.averages, [local_part(p).float() for p in self.params], self.decay)

    @contextmanager
    @torch.no_grad()
    def weights_in(self) -> Iterator[None]:
        """The model holds the averages inside the block, its own weights again after it."""
        kept = [local_part(p).clone() for p in self.params]
        for p, average in zip(self.params, self.averages, strict=True):
            local_part(p).copy_(average)
        try:
            yield
        finally:
            for p, own in zip(self.params, kept, strict=True):
                local_part(p).copy_(own)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """name -> average, shaped as the parameter of that name (a DTensor of this rank's shard
        under fsdp, so sharded checkpoints reshard it like the weights)."""
        return {name: _like(p, average)
                for name, p, average in zip(self.names, self.params, self.averages, strict=True)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, p, average in zip(self.names, self.params, self.averages, strict=True):
            saved = state[name]
            if hasattr(p, "to_local") and not hasattr(saved, "to_local"):  # a file's whole tensor
                from torch.distributed.tensor import distribute_tensor
                saved = distribute_tensor(saved.to(average.device), p.device_mesh, p.placements)
            average.copy_(local_part(saved))


def _like(p: torch.Tensor, average: torch.Tensor) -> torch.Tensor:
    if not hasattr(p, "to_local"):
        return average
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(average, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def model_state(state: dict[str, Any], raw_weights: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's model state_dict, with its EMA (if any) as weights unless `raw_weights`."""
    model = dict(state["model"])
    if state.get("ema") and not raw_weights:
        model.update({name: average.to(model[name].dtype)
                      for name, average in state["ema"].items()})
    return model
