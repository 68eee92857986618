"""What task.py's Hugging Face model needs from transformers, beyond the model itself: loading a
folder with one line for what is missing, LoRA adapters (peft), the tensor-parallel plan its config
carries, checking a shard set against its tokenizer, and writing a checkpoint back as a folder
transformers (or peft, for an adapter) loads.
Only the task=hf_causal_lm bake has this file; task.py calls it."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import storage
from .failures import UsageError
from .shards import TOKENIZER


def pretrained(kind: str, name: str, **kwargs: Any) -> Any:
    """transformers' `kind`.from_pretrained(name) (AutoConfig, AutoTokenizer, ...), whose messages
    and progress bars only rank 0 shows; a name it cannot find is one line saying how to get it."""
    import transformers
    from transformers.utils import logging

    if dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0") or 0):
        logging.set_verbosity_error()
        logging.disable_progress_bar()
    try:
        return getattr(transformers, kind).from_pretrained(name, **kwargs)
    except (OSError, ValueError) as exc:
        if Path(name).is_dir():  # there, but not a model folder transformers reads
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UsageError(f"--model {name}: cannot load it ({why})", everywhere=True) from None
        if not isinstance(exc, OSError):
            raise
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        hub = ("the Hugging Face hub is off (HF_HUB_OFFLINE=1)" if offline
               else "the Hugging Face hub did not give it")
        raise UsageError(f"--model {name}: no such folder, and {hub}: on a machine with network "
                         f"run `hf download {name} --local-dir DIR`, copy DIR here and pass "
                         "--model DIR", everywhere=True) from None


def with_lora(model: nn.Module, rank: int) -> nn.Module:
    """peft's LoRA adapters of rank `rank` on every linear layer but the output layer (attention's
    and the MLP's projections), scaled by 2 (lora_alpha = 2 * rank); the model's own weights are
    frozen. lora_B starts at zero, so the model starts as the folder's."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UsageError("--lora-rank needs peft: pip install peft", everywhere=True) from None
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                        target_modules="all-linear", task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # transformers' deprecation notes, on every rank
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, config)


def frozen_base(model: nn.Module) -> set[str]:
    """A LoRA model's own weights by state_dict name: every one but the adapters' (lora_A,
    lora_B); none for a model without adapters."""
    if not hasattr(model, "peft_config"):
        return set()
    return {name for name in model.state_dict() if ".lora_" not in name}


def plan_from_config(model: nn.Module, tp_size: int) -> dict[str, str]:
    """The plan in the model's config (transformers' `base_model_tp_plan`): its colwise and
    rowwise entries, under the base model's name ("model.layers.*.mlp.up_proj"); the others
    (transformers' own styles) left out."""
    if hasattr(model, "peft_config"):
        raise UsageError("--lora-rank trains under --model-layout data_parallel or fsdp: "
                         "tensor_parallel has no plan for peft's adapter layers; choose one of "
                         "those, or train without --lora-rank", everywhere=True)
    config = model.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    kv_heads = kv_heads or heads
    if heads % tp_size or kv_heads % tp_size:
        raise UsageError(f"--tp-size {tp_size} must divide the model's {heads} attention heads "
                         f"and {kv_heads} key/value heads (each rank computes whole heads)",
                         everywhere=True)
    prefix = model.base_model_prefix
    base = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    modules = dict(model.named_modules())
    plan = {}
    for pattern, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        names = [n for n in modules if fnmatch.fnmatchcase(n, base + pattern)]
        if style in ("colwise", "rowwise") and names and all(
                isinstance(modules[n], nn.Linear) for n in names):
            plan[base + pattern] = style
    if not plan:
        raise UsageError(f"{type(model).__name__}: its config has no tensor-parallel plan of "
                         "colwise and rowwise linear layers (base_model_tp_plan): write "
                         "tensor_parallel_plan(model, tp_size) in task.py, returning {module "
                         "path: 'colwise' or 'rowwise'} (docs/performance.md)", everywhere=True)
    return plan


def check_shard_set(data: str, index: dict[str, Any], model: str) -> None:
    """A shard set for this model holds token ids of the model's own tokenizer (prepare's
    --tokenizer MODEL): another tokenizer's ids would train the model on the wrong tokens."""
    from tokenizers import Tokenizer

    again = (f"prepare it with the model's tokenizer: python -m {__package__}.shards SOURCE "
             f"DEST --tokenizer {model}")
    if index["kind"] != "tokens":
        raise UsageError(f"--data {storage.redact(data)}: a shard set of {index['kind']}, not of "
                         f"text; {again}", everywhere=True)
    path = storage.local_copy(storage.location(data) / TOKENIZER)
    theirs = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    ours = pretrained("AutoTokenizer", model).get_vocab()
    if theirs != ours:
        raise UsageError(f"--data {storage.redact(data)}: its tokens are another tokenizer's "
                         f"({len(theirs)} tokens) than --model's ({len(ours)}); {again}",
                         everywhere=True)


def save_folder(model_state: dict[str, torch.Tensor], name: str, folder: Path,
                lora_rank: int = 0) -> None:
    """`model_state` as a folder `AutoModelForCausalLM.from_pretrained(folder)` and
    `AutoTokenizer.from_pretrained(folder)` load: the weights as trained (safetensors), the
    `name` folder's config, tokenizer and generation settings. A LoRA run's adapters
    (`lora_rank`) are merged into the `name` folder's weights."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = pretrained("AutoConfig", name)
    if lora_rank:
        model = lora_model(model_state, name, lora_rank).merge_and_unload()
    else:
        with torch.device("meta"):  # no memory until the checkpoint's tensors are assigned
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(model_state, assign=True)
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
    with contextlib.suppress(OSError):  # else transformers' defaults for this config
        model.generation_config = GenerationConfig.from_pretrained(name)
    model.save_pretrained(folder)
    pretrained("AutoTokenizer", name).save_pretrained(folder)


def lora_model(model_state: dict[str, torch.Tensor], name: str, rank: int) -> nn.Module:
    """The `name` folder's model with a LoRA run's adapters (a checkpoint's `model_state`)."""
    model = with_lora(pretrained("AutoModelForCausalLM", name, dtype=torch.float32), rank)
    adapters = set(model.state_dict()) - frozen_base(model)
    if differ := sorted(adapters ^ set(model_state)):
        raise UsageError(f"the checkpoint's adapters do not fit --lora-rank {rank} on --model "
                         f"{name} ('{differ[0]}' is in one of them only)")
    model.load_state_dict(model_state, strict=False)  # the adapters; the rest as --model has it
    return model


def save_adapter_folder(model_state: dict[str, torch.Tensor], name: str, folder: Path,
                        lora_rank: int) -> None:
    """A LoRA run's adapters alone, as a folder `PeftModel.from_pretrained(base, folder)` loads
    (adapter_config.json, adapter_model.safetensors), with the `name` folder's tokenizer."""
    if not lora_rank:
        raise UsageError("--adapter-only: this checkpoint's run had no --lora-rank, so it holds "
                         "the whole model and no adapter; export it without --adapter-only")
    lora_model(model_state, name, lora_rank).save_pretrained(folder)
    pretrained("AutoTokenizer", name).save_pretrained(folder)
