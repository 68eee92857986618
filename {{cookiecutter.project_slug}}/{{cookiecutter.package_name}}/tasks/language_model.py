"""The task: what to learn, from which data, and how to score it. Edit this file, and only this
file, to train your own model on your own data (README.md, "Your model and data").

This example: a decoder-only transformer that predicts the next token of text, trained with
next-token cross-entropy and scored by perplexity. By default a small character model (one token
per byte value); configs/gpt2-small.toml scales it up to GPT-2 small (docs/performance.md).
Synthetic text by default; `--data FILE` trains on a text file (a .bin: nanoGPT's uint16 token
ids), one window of seq_len + 1 tokens read from disk at a time (`--num-workers N`: in workers).
`--data` may also name a shard set of tokens (a byte-level BPE's), in a folder or a bucket
(docs/data.md): the vocabulary is then the tokenizer's, padded to a multiple of 64.
All processes run this: print once under `if not dist.is_initialized() or dist.get_rank() == 0`.

The rest of the project relies on:
    build_datasets(cfg) -> (train, val)    map-style Datasets, the same on every rank (val or None)
    build_model(cfg) -> nn.Module          built on the CPU; the project places it on devices;
                                           its optional `rebuilt_weights`, a set of state_dict
                                           names: weights it makes again at every start, left
                                           out of checkpoints (a LoRA run's frozen base model)
    loss_fn(model, batch) -> Tensor        the batch's mean loss; batch is already on the device
    eval_metrics(model, batch) -> dict     per-batch sums plus a 'count'; reported as val_<name>
Optional:
    collate(samples) -> batch              how samples become a batch (default: default_collate)
    blocks(model) -> list[nn.Module]       the repeated blocks: fsdp shards each one,
                                           model_parallel_2 splits the model between them
    tensor_parallel_plan(model, tp_size)   {layer: "colwise" or "rowwise"}: what tensor_parallel
                                           splits over tp ranks (docs/performance.md)
    finalize_metrics(averages) -> dict     numbers derived from the averages (perplexity)
    predict(model, inputs, cfg) -> list    one line per input (scripts/predict.py)
    tokens_per_sample(cfg), flops_per_token(model, cfg)    tokens/s and MFU in the metrics
    configure_optimizer(model, cfg)        an optimizer (default: AdamW), (optimizer, scheduler)
                                           or {name: either} over parts of the model
    train_step(step, batch) -> dict        a step of your own (docs/custom-step.md)
    TEST_FLAGS: list[str]                  flags for a few quick steps in the tests' kill and
                                           resume (default: none, this file's defaults)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .checkpoint import storage
from .cross_entropy import ChunkedCrossEntropy
from .data import InMemoryDataset, split_for_validation
from .failures import UsageError, local_rank_from_env, warn
from .settings import setting
from .shards import TOKENIZER
from .shards.read import shard_index, shard_parts
from .text_files import Part, TextWindows

if TYPE_CHECKING:  # for the type hints only
    from .config import Config


@dataclass
class Settings:
    """This task's own settings. Each field is a --flag (hidden_size: --hidden-size) and a key of
    --config files, is saved with the run and its checkpoints, and is read below as
    cfg.task.<name>. Add your own here: nothing else needs to change."""

    dataset_size: int = setting(2048, "text windows in the synthetic data set (without --data)",
                                low=1, unused_with="data")
    hidden_size: int = setting(64, "width of the transformer", low=1)
    num_layers: int = setting(2, "transformer blocks", low=1)
    num_heads: int = setting(4, "attention heads (they split --hidden-size)", low=1)
    seq_len: int = setting(64, "tokens of context", low=1)
    vocab_size: int = setting(256, "tokens the model knows: 256 is one per byte value (the "
                              "data's bytes); more only add unused rows (GPT-2: 50304)", low=256)
    tie_embeddings: bool = setting(False, "the output layer shares the token embedding's "
                                   "weights, as in GPT-2")


# ---------------------------------------------------------------------- data
def synthetic_text(windows: int, seq_len: int, seed: int) -> InMemoryDataset:
    """Sentences of made-up words: a model that learns the spelling and the word boundaries gets
    far below the perplexity of guessing (256). Every rank builds the identical text."""
    g = torch.Generator().manual_seed(seed)
    letters = "etaoinshrdlucmfw"
    words = ["".join(letters[i] for i in torch.randint(len(letters), (int(n),), generator=g))
             for n in torch.randint(2, 7, (24,), generator=g)]
    needed = windows * seq_len + 1
    picks = torch.randint(len(words), (needed // 3 + 1,), generator=g).tolist()
    text = (" ".join(words[i] for i in picks) + ". ").encode()[:needed]
    tokens = torch.tensor(list(text), dtype=torch.long)
    starts = torch.arange(windows) * seq_len
    return InMemoryDataset(tokens[starts[:, None] + torch.arange(seq_len + 1)])


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset | None]:
    """Training and validation windows, identical on every rank. Synthetic: --dataset-size windows
    plus --val-fraction of that as validation. A file: --val-fraction of its windows held out.
    A shard set: --val-fraction of its windows held out, spread over its shards."""
    if index := shard_index(cfg.data):
        return shard_parts(cfg, index, seq_len=cfg.task.seq_len)
    if cfg.data:
        text = TextWindows(cfg.data, cfg.task.seq_len, cfg.task.vocab_size)
        train, val = split_for_validation(len(text), int(len(text) * cfg.val_fraction), cfg.seed)
        return Part(text, train.tolist()), Part(text, val.tolist()) if len(val) else None
    n_val = int(cfg.task.dataset_size * cfg.val_fraction)
    data = synthetic_text(cfg.task.dataset_size + n_val, cfg.task.seq_len, cfg.seed)
    train, val = split_for_validation(len(data), n_val, cfg.seed)
    return data.subset(train), data.subset(val) if n_val else None


# ---------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        y, size = self.norm1(x), c // self.heads  # -1 heads: tensor_parallel keeps 1/tp of them
        q, k, v = (f(y).view(b, t, -1, size).transpose(1, 2) for f in (self.q, self.k, self.v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, width: int = 64, depth: int = 2, heads: int = 4, seq_len: int = 64,
                 vocab: int = 256, tie: bool = False) -> None:
        super().__init__()
        if width % heads:
            raise UsageError(f"--hidden-size {width} must be a multiple of --num-heads {heads}",
                             everywhere=True)
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq_len, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tie:
            # The output layer reads this table: at PyTorch's N(0, 1) the first logits would be
            # huge (loss ~770 at width 768); GPT-2 starts it at 0.02.
            nn.init.normal_(self.embed.weight, std=0.02)
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits; with `targets`, each token's loss instead (inside forward, so that
        --compile compiles the loss with the model)."""
        x = self.embed(tokens) + self.position[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return token_losses(logits.flatten(0, 1), targets.flatten().to(logits.device))


def build_model(cfg: Config) -> nn.Module:
    t = cfg.task
    if t.tie_embeddings and cfg.model_layout == "model_parallel_2":
        raise UsageError("--tie-embeddings: model_parallel_2 puts the embedding and the output "
                         "layer on different devices, so they cannot share weights; drop "
                         "--tie-embeddings", everywhere=True)
    vocab = (-(-index["vocab_size"] // 64) * 64 if (index := shard_index(cfg.data))
             else t.vocab_size)  # a shard set's tokenizer's, padded: faster matrix products
    model = TinyGPT(t.hidden_size, t.num_layers, t.num_heads, t.seq_len, vocab, t.tie_embeddings)
    step = flops_per_token(model, cfg) * t.seq_len * cfg.batch_size * cfg.grad_accum
    if step > 1e13 and not torch.cuda.is_available() and local_rank_from_env() == 0:
        # Else nothing is said until the first step ends: many minutes on a CPU.
        warn(f"a step is {step / 1e12:.0f} TFLOP a process, a GPU's work (configs/gpt2-small.toml "
             "is a GPU preset): on this CPU each takes many minutes; for a CPU run, leave out "
             "--config or make the model and batch smaller")
    return model


def blocks(model: TinyGPT) -> list[nn.Module]:
    return list(model.blocks)


def tensor_parallel_plan(model: TinyGPT, tp_size: int) -> dict[str, str]:
    """--model-layout tensor_parallel: q, k, v (whole heads) and the MLP's first layer keep 1/tp of
    their outputs (colwise), the layers after them 1/tp of their inputs (rowwise)."""
    if (heads := model.blocks[0].heads) % tp_size:
        raise UsageError(f"--tp-size {tp_size} must divide --num-heads {heads} (each rank "
                         "computes whole heads)", everywhere=True)
    return {f"blocks.*.{name}": "colwise" for name in ("q", "k", "v", "mlp.0")} | {
        "blocks.*.proj": "rowwise", "blocks.*.mlp.2": "rowwise"}


def tokens_per_sample(cfg: Config) -> int:
    return cfg.task.seq_len


def flops_per_token(model: TinyGPT, cfg: Config) -> float:
    """Training FLOPs per token, as nanoGPT and the PaLM paper count them: 6 per weight that
    multiplies activations (forward 2, backward 4), plus attention's 12 * layers * width *
    context. Lookups (the position table, and the token table unless the output layer shares it)
    are not multiplications."""
    weights = sum(p.numel() for p in model.parameters()) - model.position.numel()
    if model.head.weight is not model.embed.weight:
        weights -= model.embed.weight.numel()
    t = cfg.task
    return 6 * weights + 12 * t.num_layers * t.hidden_size * t.seq_len


# ---------------------------------------------------------------------- loss and metrics
def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's cross-entropy, in float32. Never a float32 copy of all the 16-bit logits
    (B x T x vocab: 0.2 GB a sequence at GPT-2 small, a third of what the backward pass keeps):
    compiled, inductor fuses the cast into the loss; eager, ChunkedCrossEntropy."""
    if logits.dtype == torch.float32 or torch.compiler.is_compiling():
        return F.cross_entropy(logits.float(), targets, reduction="none")
    return ChunkedCrossEntropy.apply(logits, targets)


def loss_fn(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    return model(windows[:, :-1], windows[:, 1:]).mean()  # the mean of each next token's loss


def eval_metrics(model: nn.Module, windows: torch.Tensor) -> dict:
    losses = model(windows[:, :-1], windows[:, 1:])
    return {"loss": losses.sum(), "count": losses.numel()}


def finalize_metrics(averages: dict[str, float]) -> dict[str, float]:
    """Perplexity is exp(mean loss per token), not a sum over samples: derived here."""
    return {**averages, "perplexity": math.exp(min(averages["loss"], 50.0))}


def load_tokenizer(data: str) -> Any:
    """The shard set's tokenizer (Hugging Face `tokenizers`), kept beside its shards."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(storage.local_copy(storage.location(data) / TOKENIZER)))


def predict(model: nn.Module, inputs: list[str], cfg: Config, new_tokens: int = 40) -> list[str]:
    """Prompts -> each continued by `new_tokens` tokens (bytes, or the shard set's tokenizer's),
    the most likely one at a time (scripts/predict.py)."""
    if str(cfg.data).lower().endswith(".bin"):  # ids of a tokenizer this project does not have
        raise UsageError(f"--data {cfg.data}: the model predicts token ids that only the tokenizer "
                         "that made the .bin file turns into text (nanoGPT's: tiktoken's gpt2)")
    tokenizer = load_tokenizer(cfg.data) if shard_index(cfg.data) else None
    lines = []
    for prompt in inputs:
        ids = tokenizer.encode(prompt).ids if tokenizer else list(prompt.encode())
        tokens = torch.tensor([ids or [10]], dtype=torch.long)  # '' -> '\n'
        for _ in range(new_tokens):
            logits = model(tokens[:, -cfg.task.seq_len:])[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        ids = tokens[0].tolist()
        lines.append(tokenizer.decode(ids) if tokenizer else bytes(ids).decode(errors="replace"))
    return lines
