"""Cross-entropy of 16-bit logits without a float32 copy of them all: the language-model tasks'
loss in eager mode (task.py's token_losses). Generated with task=language_model and
task=hf_causal_lm only."""

from __future__ import annotations

from typing import Any

import torch


class ChunkedCrossEntropy(torch.autograd.Function):
    """Cross-entropy of 16-bit logits computed in float32 a chunk of rows at a time, keeping
    only the 16-bit logits for the backward pass (as llm.c's fused classifier does)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        return torch.cat([-torch.log_softmax(rows.float(), -1).gather(1, t[:, None])[:, 0]
                          for rows, t in zip(*_chunks(logits, targets), strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets = ctx.saved_tensors
        out = torch.empty_like(logits)
        for rows, t, g, o in zip(*_chunks(logits, targets, grad, out), strict=True):
            p = torch.softmax(rows.float(), -1)  # d loss / d logits = softmax - one-hot
            p[torch.arange(len(t), device=t.device), t] -= 1
            o.copy_(p.mul_(g[:, None]))
        return out, None


def _chunks(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    rows = max(1, 2**25 // tensors[0].shape[-1])  # 128 MB of float32 at a time
    return [t.split(rows) for t in tensors]
