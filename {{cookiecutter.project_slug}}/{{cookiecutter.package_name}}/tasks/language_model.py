"""The task: what to learn, from which data, and how to score it. Edit this file, and only this
file, to train your own model on your own data (README.md, "Your model and data").

This example: a small decoder-only transformer that predicts the next byte of text (a character
model over the 256 byte values), trained with next-token cross-entropy and scored by perplexity.
Synthetic text by default; `--data FILE` trains on a text file, read one window of SEQ_LEN + 1
bytes at a time from disk (use `--num-workers N` to read in worker processes).

The rest of the project relies on:
    build_datasets(cfg) -> (train, val)    map-style Datasets, the same on every rank (val or None)
    build_model(cfg) -> nn.Module          built on the CPU; the project places it on devices
    loss_fn(model, batch) -> Tensor        the batch's mean loss; batch is already on the device
    eval_metrics(model, batch) -> dict     per-batch sums plus a 'count'; reported as val_<name>
Optional: collate(samples) -> batch, blocks(model) -> the model's repeated blocks (used by
--model-layout model_parallel_2 and fsdp), finalize_metrics(averages) -> what to report,
configure_optimizer(model, cfg) -> optimizer or (optimizer, scheduler) (default: AdamW),
predict(model, inputs, cfg) -> one line per input (scripts/predict.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .config import Config, setting
from .data import InMemoryDataset, split_for_validation
from .failures import SetupError

SEQ_LEN = 64  # bytes of context
VOCAB = 256  # one token per byte value
HEADS = 4


@dataclass
class Settings:
    """This task's own settings. Each field is a --flag (hidden_size: --hidden-size) and a key of
    --config files, is saved with the run and its checkpoints, and is read below as
    cfg.task.<name>. Add your own here: nothing else needs to change."""

    dataset_size: int = setting(2048, "text windows in the synthetic data set (without --data)",
                                low=1, unused_with="data")
    hidden_size: int = setting(64, "width of the transformer", low=1)
    num_layers: int = setting(2, "transformer blocks", low=1)


# ---------------------------------------------------------------------- data
def synthetic_text(windows: int, seed: int) -> InMemoryDataset:
    """Sentences of made-up words: a model that learns the spelling and the word boundaries gets
    far below the perplexity of guessing (256). Every rank builds the identical text."""
    g = torch.Generator().manual_seed(seed)
    letters = "etaoinshrdlucmfw"
    words = ["".join(letters[i] for i in torch.randint(len(letters), (int(n),), generator=g))
             for n in torch.randint(2, 7, (24,), generator=g)]
    needed = windows * SEQ_LEN + 1
    picks = torch.randint(len(words), (needed // 3 + 1,), generator=g).tolist()
    text = (" ".join(words[i] for i in picks) + ". ").encode()[:needed]
    tokens = torch.tensor(list(text), dtype=torch.long)
    starts = torch.arange(windows) * SEQ_LEN
    return InMemoryDataset(tokens[starts[:, None] + torch.arange(SEQ_LEN + 1)])


class TextWindows(Dataset):
    """A text file cut into windows of SEQ_LEN + 1 bytes (inputs and next-byte targets); each
    window is read from disk when asked for."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        self.windows = (size - 1) // SEQ_LEN
        if self.windows < 2:
            raise SetupError(f"--data {path}: {size} bytes; this model needs at least "
                             f"{2 * SEQ_LEN + 1} (two windows of SEQ_LEN={SEQ_LEN})",
                             everywhere=True)

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.path, "rb") as f:
            f.seek(index * SEQ_LEN)
            window = f.read(SEQ_LEN + 1)
        return torch.frombuffer(bytearray(window), dtype=torch.uint8).long()


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset | None]:
    """Training and validation windows, identical on every rank. Synthetic: --dataset-size windows
    plus --val-fraction of that as validation. A file: --val-fraction of its windows held out."""
    if cfg.data:
        text = TextWindows(cfg.data)
        train, val = split_for_validation(len(text), int(len(text) * cfg.val_fraction), cfg.seed)
        return (torch.utils.data.Subset(text, train.tolist()),
                torch.utils.data.Subset(text, val.tolist()) if len(val) else None)
    n_val = int(cfg.task.dataset_size * cfg.val_fraction)
    data = synthetic_text(cfg.task.dataset_size + n_val, cfg.seed)
    train, val = split_for_validation(len(data), n_val, cfg.seed)
    return data.subset(train), data.subset(val) if n_val else None


# ---------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        if width % HEADS:
            raise SetupError(f"--hidden-size {width} must be a multiple of {HEADS} (attention "
                             "heads)", everywhere=True)
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(SEQ_LEN, width))
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(cfg: Config) -> nn.Module:
    return TinyGPT(cfg.task.hidden_size, cfg.task.num_layers)


def blocks(model: TinyGPT) -> list[nn.Module]:
    return list(model.blocks)


# ---------------------------------------------------------------------- loss and metrics
def _next_token_losses(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1]).float()
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none")


def loss_fn(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    return _next_token_losses(model, windows).mean()


def eval_metrics(model: nn.Module, windows: torch.Tensor) -> dict:
    losses = _next_token_losses(model, windows)
    return {"loss": losses.sum(), "count": losses.numel()}


def finalize_metrics(averages: dict[str, float]) -> dict[str, float]:
    """Perplexity is exp(mean loss per token), not a sum over samples: derived here."""
    return {**averages, "perplexity": math.exp(min(averages["loss"], 50.0))}


def predict(model: nn.Module, inputs: list[str], cfg: Config, new_bytes: int = 40) -> list[str]:
    """Prompts -> each continued by `new_bytes` bytes, the most likely one at a time
    (scripts/predict.py)."""
    lines = []
    for prompt in inputs:
        tokens = torch.tensor([list(prompt.encode()) or [10]], dtype=torch.long)  # '' -> '\n'
        for _ in range(new_bytes):
            logits = model(tokens[:, -SEQ_LEN:])[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        lines.append(bytes(tokens[0].tolist()).decode(errors="replace"))
    return lines
