"""The task: what to learn, from which data, and how to score it. Edit this file, and only this
file, to train your own model on your own data (README.md, "Your model and data").

This example: a Hugging Face transformers causal language model you already have, in a folder as
`save_pretrained` writes it (config.json, safetensors weights, tokenizer): `--model FOLDER`.
Fine-tuned on your text (`--from-scratch`: fresh weights of its config; `--lora-rank R`: LoRA
adapters alone) by next-token cross-entropy, scored by perplexity. `--data` is a text file, a
JSON-lines file (a "text" field a line) or a folder of them, tokenized with the model's tokenizer:
documents joined by its end-of-text token, packed into windows of --seq-len + 1 token ids (int64:
any vocabulary).
Text larger than memory, or in a bucket: a shard set written with the model's tokenizer,
`python -m {{ cookiecutter.package_name }}.shards TEXT SET --tokenizer FOLDER`, then --data SET.
`python -m {{ cookiecutter.package_name }}.checkpoint export CHECKPOINT FOLDER` writes a folder
transformers loads (save_pretrained below; a LoRA run's adapters merged, or alone with
--adapter-only: save_adapter).
All processes run this: print once under `if not dist.is_initialized() or dist.get_rank() == 0`.

The rest of the project relies on:
    build_datasets(cfg) -> (train, val)    map-style Datasets, the same on every rank (val or None)
    build_model(cfg) -> nn.Module          built on the CPU; the project places it on devices;
                                           its optional `rebuilt_weights`, a set of state_dict
                                           names: weights it makes again at every start, left
                                           out of checkpoints (LoRA's frozen base model)
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
    save_pretrained(model_state, cfg, folder)    what the export writes for a folder
    save_adapter(model_state, cfg, folder)       what the export writes with --adapter-only
    configure_optimizer(model, cfg)        an optimizer (default: AdamW), (optimizer, scheduler)
                                           or {name: either} over parts of the model
    train_step(step, batch) -> dict        a step of your own (docs/custom-step.md)
    TEST_FLAGS: list[str]                  flags for a few quick steps in the tests' kill and
                                           resume (default: none, this file's defaults)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .cross_entropy import ChunkedCrossEntropy
from .data import InMemoryDataset, split_for_validation
from .failures import UsageError
from .hf import (
    check_shard_set,
    frozen_base,
    plan_from_config,
    pretrained,
    save_adapter_folder,
    save_folder,
    with_lora,
)
from .settings import setting
from .shards.read import shard_index, shard_parts

if TYPE_CHECKING:  # for the type hints only
    from .config import Config


@dataclass
class Settings:
    """This task's own settings. Each field is a --flag (seq_len: --seq-len) and a key of
    --config files, is saved with the run and its checkpoints, and is read below as
    cfg.task.<name>. Add your own here: nothing else needs to change."""

    model: str | None = setting(None, "the model's folder, as save_pretrained writes it "
                                "(config.json, weights, tokenizer); a hub name where the hub is "
                                "reachable", metavar="PATH")
    from_scratch: bool = setting(False, "the folder's config with fresh weights (seeded by "
                                 "--seed), not its trained weights")
    seq_len: int = setting(128, "tokens of context: a sample is --seq-len + 1 tokens", low=1)
    lora_rank: int = setting(0, "train LoRA adapters of this rank (peft) on the attention and MLP "
                             "projections, not the model: only they train and are saved; 0: "
                             "every weight trains", low=0, metavar="R")


def model_name(cfg: Config) -> str:
    if not cfg.task.model:
        raise UsageError("this task trains a Hugging Face model you have: pass --model PATH, its "
                         "folder as save_pretrained writes it (config.json, weights, tokenizer)",
                         everywhere=True)
    return cfg.task.model


# ---------------------------------------------------------------------- data
def documents(path: Path) -> list[str]:
    """The texts of --data: a text file is one document, each line of a JSON-lines file (*.jsonl)
    one (its "text" field); a folder's *.txt and *.jsonl files in the order of their names."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
        if not files:
            raise UsageError(f"--data {path}: no .txt or .jsonl files in it", everywhere=True)
        return [text for file in files for text in documents(file)]
    if not path.exists():
        raise UsageError(f"--data {path}: no such file or folder", everywhere=True)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--data {path}: cannot read it as UTF-8 text ({exc})",
                         everywhere=True) from None
    return json_lines(path, text) if path.suffix == ".jsonl" else [text]


def json_lines(path: Path, text: str) -> list[str]:
    """The "text" field of each line of a .jsonl file (empty lines left out)."""
    texts: list[Any] = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            texts += [json.loads(line)["text"]] if line.strip() else []
        except (ValueError, TypeError, KeyError, IndexError):  # not JSON, not an object
            texts.append(None)
        if texts and not isinstance(texts[-1], str):
            raise UsageError(f"--data {path}: line {number} is not a JSON object with a "
                             "\"text\" string", everywhere=True)
    return texts


def token_windows(cfg: Config) -> torch.Tensor:
    """--data's documents tokenized, each followed by the end-of-text token, cut into windows of
    seq_len + 1 ids (inputs and next-token targets; a window's last id is the next one's first)."""
    tokenizer, seq_len = pretrained("AutoTokenizer", model_name(cfg)), cfg.task.seq_len
    if tokenizer.eos_token_id is None:
        raise UsageError(f"--model {cfg.task.model}: its tokenizer has no end-of-text token "
                         "(eos_token) to join documents with; set one in its "
                         "tokenizer_config.json", everywhere=True)
    ids = tokenizer(documents(Path(cfg.data)), add_special_tokens=False, verbose=False)
    tokens = torch.cat([torch.tensor([*doc, tokenizer.eos_token_id], dtype=torch.long)
                        for doc in ids["input_ids"]])
    windows = (len(tokens) - 1) // seq_len
    if windows < 2:
        raise UsageError(f"--data {cfg.data}: {len(tokens)} tokens; this model needs at least "
                         f"{2 * seq_len + 1} (two windows of --seq-len {seq_len})",
                         everywhere=True)
    return tokens[:windows * seq_len + 1].unfold(0, seq_len + 1, seq_len).contiguous()


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset | None]:
    """Training and validation windows, the same on every rank: --val-fraction held out."""
    if not cfg.data:
        raise UsageError("this task trains on your text: pass --data PATH, a .txt file, a .jsonl "
                         "file (a \"text\" field a line) or a folder of them", everywhere=True)
    if index := shard_index(cfg.data):  # prepared with --tokenizer MODEL (docs/data.md)
        check_shard_set(cfg.data, index, model_name(cfg))
        return shard_parts(cfg, index, seq_len=cfg.task.seq_len)
    data = InMemoryDataset(token_windows(cfg))
    train, val = split_for_validation(len(data), int(len(data) * cfg.val_fraction), cfg.seed)
    return data.subset(train), data.subset(val) if len(val) else None


# ---------------------------------------------------------------------- model
def build_model(cfg: Config) -> nn.Module:
    """The folder's model in float32 (--precision bf16 computes in bf16 from there); with
    --from-scratch, or on the meta device (doctor --plan: sizes only), built from its config."""
    from transformers import AutoModelForCausalLM

    name = model_name(cfg)
    if cfg.task.lora_rank and cfg.task.from_scratch:
        raise UsageError("--lora-rank adapts the trained weights of --model, and --from-scratch "
                         "has none: drop one of the two", everywhere=True)
    if cfg.task.from_scratch or torch.get_default_device().type == "meta":
        config = pretrained("AutoConfig", name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = pretrained("AutoModelForCausalLM", name, dtype=torch.float32)
    if cfg.task.lora_rank:
        model = with_lora(model, cfg.task.lora_rank)
        # The model's own weights are frozen and read from --model at every start: checkpoints
        # hold the adapters alone (so the --model folder must stay as it is).
        model.rebuilt_weights = frozen_base(model)
    return model


def blocks(model: nn.Module) -> list[nn.Module]:
    """The layers the model names as not to be split (`_no_split_modules`: its decoder layers),
    in forward order; without that list, the longest ModuleList's children."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return [m for m in model.modules() if type(m).__name__ in names] or list(
        max(lists, key=len, default=[]))  # none: one error line (parallel.py)


def tensor_parallel_plan(model: nn.Module, tp_size: int) -> dict[str, str]:
    """The plan the model's config carries (`base_model_tp_plan`: q, k, v, gate and up colwise,
    o and down rowwise); a model without one: write yours here (docs/performance.md)."""
    return plan_from_config(model, tp_size)


def tokens_per_sample(cfg: Config) -> int:
    return cfg.task.seq_len


def flops_per_token(model: nn.Module, cfg: Config) -> float:
    """Training FLOPs per token, as nanoGPT and the PaLM paper count them: 6 per weight that
    multiplies activations (forward 2, backward 4), plus attention's 12 * layers * heads *
    head size * context; 4 per frozen weight (LoRA's base: no gradient of its own). The token
    table is a lookup, unless the output layer shares it."""
    table, output = model.get_input_embeddings(), model.get_output_embeddings()
    lookup = table.weight if output is None or output.weight is not table.weight else None
    weights = [p for p in model.parameters() if p is not lookup]
    trained = sum(p.numel() for p in weights if p.requires_grad)
    frozen = sum(p.numel() for p in weights if not p.requires_grad)  # LoRA: no weight gradient
    c = model.config
    heads, layers = c.num_attention_heads, c.num_hidden_layers
    head_size = getattr(c, "head_dim", None) or c.hidden_size // heads
    return 6 * trained + 4 * frozen + 12 * layers * heads * head_size * cfg.task.seq_len


# ---------------------------------------------------------------------- loss and metrics
def token_losses(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Each next token's cross-entropy, in float32; 16-bit logits through ChunkedCrossEntropy,
    which keeps no float32 copy of them all."""
    logits = model(input_ids=windows[:, :-1], use_cache=False).logits.flatten(0, 1)
    targets = windows[:, 1:].flatten().to(logits.device)
    if logits.dtype == torch.float32:
        return F.cross_entropy(logits, targets, reduction="none")
    return ChunkedCrossEntropy.apply(logits, targets)


def loss_fn(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    return token_losses(model, windows).mean()


def eval_metrics(model: nn.Module, windows: torch.Tensor) -> dict:
    losses = token_losses(model, windows)
    return {"loss": losses.sum(), "count": losses.numel()}


def finalize_metrics(averages: dict[str, float]) -> dict[str, float]:
    """Perplexity is exp(mean loss per token), not a sum over samples: derived here."""
    return {**averages, "perplexity": math.exp(min(averages["loss"], 50.0))}


def predict(model: nn.Module, inputs: list[str], cfg: Config, new_tokens: int = 40) -> list[str]:
    """Prompts -> each continued by up to `new_tokens` tokens of the model's tokenizer, the most
    likely one at a time (scripts/predict.py)."""
    from transformers import GenerationConfig

    tokenizer = pretrained("AutoTokenizer", model_name(cfg))
    first = next(i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None)
    eos = tokenizer.eos_token_id
    greedy = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=eos,
                              eos_token_id=eos)
    lines = []
    for prompt in inputs:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        if not ids.numel():  # '' -> the tokenizer's first token
            ids = torch.tensor([[first]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy)
        lines.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return lines


def save_pretrained(model_state: dict[str, torch.Tensor], cfg: Config, folder: Path) -> None:
    """A checkpoint's model as a folder `AutoModelForCausalLM.from_pretrained(folder)` and
    `AutoTokenizer.from_pretrained(folder)` load: the weights as trained (safetensors), the
    --model folder's config, tokenizer and generation settings."""
    save_folder(model_state, model_name(cfg), folder, cfg.task.lora_rank)


def save_adapter(model_state: dict[str, torch.Tensor], cfg: Config, folder: Path) -> None:
    """A LoRA run's adapters alone (export --adapter-only), as a folder peft loads onto the
    --model folder's model: `PeftModel.from_pretrained(model, folder)`."""
    save_adapter_folder(model_state, model_name(cfg), folder, cfg.task.lora_rank)
