"""The model. Put your own network here; `build_model` is the only function the rest calls."""

from __future__ import annotations

import torch
from torch import nn

from .data import IN_FEATURES


class MLP(nn.Module):
    """A small multi-layer perceptron for regression: IN_FEATURES inputs, one output."""

    def __init__(self, hidden_size: int = 64, num_layers: int = 2, batch_norm: bool = False,
                 in_features: int = IN_FEATURES) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(num_layers):
            layers.append(nn.Linear(width, hidden_size))
            if batch_norm:
                layers.append(nn.BatchNorm1d(hidden_size))
            layers.append(nn.GELU())
            width = hidden_size
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TwoStageMLP(MLP):
    """The same MLP (same parameter names, so checkpoints move between layouts) split over two devices.

    The first half of the layers lives on `devices[0]`, the rest on `devices[1]`; the forward moves the
    activations across. DDP wraps it without `device_ids`, since it spans devices.
    """

    def __init__(self, devices: list[torch.device], hidden_size: int = 64, num_layers: int = 2,
                 batch_norm: bool = False) -> None:
        super().__init__(hidden_size, num_layers, batch_norm)
        self.devices = devices
        # Split after the first half of the hidden blocks. The layers stay in `self.net` (not in new
        # submodules) so the state_dict keys are exactly MLP's.
        per_block = 3 if batch_norm else 2
        self.split = per_block * ((num_layers + 1) // 2)
        for i, layer in enumerate(self.net):
            layer.to(devices[0] if i < self.split else devices[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.devices[0])
        for i, layer in enumerate(self.net):
            if i == self.split:
                x = x.to(self.devices[1])
            x = layer(x)
        return x


def build_model(layout: str, devices: list[torch.device], hidden_size: int, num_layers: int,
                batch_norm: bool = False) -> nn.Module:
    if layout == "model_parallel_2":
        return TwoStageMLP(devices, hidden_size, num_layers, batch_norm)
    return MLP(hidden_size, num_layers, batch_norm).to(devices[0])
