"""doctor --plan: does this run fit, and do its settings hold, at --world-size processes? On the
CPU, with no process group. Parameters, gradients and optimizer state are exact (model and optimizer
on the meta device); activations are an estimate (a real forward here, at two small batches)."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import task
from .config import LAYOUTS, SHARDED, Config
from .data import BatchFetcher
from .ema import averaged_parameters
from .evaluation import without_validation
from .failures import ProjectError, UsageError
from .meters import human_size
from .optim import AMP_DTYPES, optimizer_state, schedule
from .parallel import (
    padding_note,
    rows_on_rank,
    second_stage,
    shard_group_size,
    usable_blocks,
)
from .runtime.comm_hooks import powersgd_report

RESERVE_GB = 2.0  # per GPU: the CUDA context, NCCL's buffers, the caching allocator's slack
EXACT = ("parameters", "gradients", "optimizer state")
ROWS = (*EXACT, "EMA weights", "DDP gradient copies", "buffers", "activations (estimate)",
        "fsdp gathered")


def static_memory(cfg: Config, layout: str, world: int,
                  per_node: int = 0) -> tuple[list[dict[str, Any]], str]:
    """(bytes on each GPU of one process, model_parallel_2 two; the optimizer's name) for `layout`
    at `world` processes, `per_node` a node. UsageError where the layout cannot take the model."""
    cfg = dataclasses.replace(cfg, model_layout=layout)
    with torch.device("meta"):
        model = task.build_model(cfg)
    blocks = usable_blocks(model, task, cfg)  # the run's refusals (parallel.parallelize)
    # fsdp shards over groups of --shard-group-size ranks (HSDP; 0: a node when there are several)
    shards = shard_group_size(cfg.shard_group_size, world, per_node) if layout == "fsdp" else 1
    sizes, dp = {}, world  # tensor_parallel: each parameter's elements on a rank; fsdp's ranks
    if layout == "tensor_parallel":
        from .tensor_parallel import shapes_on_rank
        shapes, dp = shapes_on_rank(model, task, cfg, world)  # then FSDP2 over dp, as fsdp
        sizes = {key: rows_on_rank(torch.empty(shape, device="meta"), dp)
                 for key, shape in shapes.items()}
    second = second_stage(model, blocks) if layout == "model_parallel_2" else set()
    owner = {id(t): int(m in second) for m in model.modules()
             for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
    name, state = optimizer_state(model, cfg, getattr(task, "configure_optimizer", None))
    out = [dict.fromkeys(ROWS[:-2], 0) for _ in range(2 if second else 1)]
    # DDP's buckets hold a gradient copy unless they are views; PowerSGD's error feedback one more.
    copies = (not cfg.gradient_as_bucket_view) + (cfg.comm_hook == "powersgd") if (
        shards == 1 and not sizes) else 0
    averaged = {id(p) for _, p in averaged_parameters(model)}  # not LoRA's frozen base model
    for p in model.parameters():  # each shared parameter once
        gpu = out[owner[id(p)]]
        local = sizes[id(p)] if sizes else rows_on_rank(p, shards)
        gpu["parameters"] += local * p.element_size()  # fp32 master weights in every precision
        gpu["gradients"] += local * p.element_size() if p.requires_grad else 0
        gpu["DDP gradient copies"] += copies * local * p.element_size() if p.requires_grad else 0
        # State of the parameter's shape is sharded with it (fsdp: zeros_like of the shard);
        # other state (AdamW's `step`, a factored optimizer's) is counted whole: at most.
        gpu["optimizer state"] += sum((local if t.shape == p.shape else t.numel())
                                      * t.element_size() for t in (state or {}).get(id(p), []))
        gpu["EMA weights"] += local * 4 if cfg.ema_decay and id(p) in averaged else 0  # fp32
    for b in model.buffers():  # not sharded
        out[owner[id(b)]]["buffers"] += b.numel() * b.element_size()
    for gpu in out if state is None else []:
        gpu["optimizer state"] = None
    if layout in SHARDED:
        whole = {id(p): sizes[id(p)] * dp if sizes else p.numel()
                 for p in model.parameters()}  # gathered over fsdp's ranks (tp's stay split)
        units = [sum(whole[id(p)] for p in block.parameters()) for block in blocks]
        root = sum(whole.values()) - sum(units)
        compute = 2 if cfg.precision != "fp32" else 4  # MixedPrecisionPolicy's param_dtype
        # The root unit stays gathered for the step, blocks two at a time (one prefetched), and
        # one unit's gradients wait for their reduce-scatter; with --grad-accum above 1 every
        # gradient stays unsharded, in fp32, until the group's last micro-batch.
        out[0]["fsdp gathered"] = compute * (root + 2 * max(units, default=0) + max(
            [root, *units])) + (4 * (root + sum(units)) if cfg.grad_accum > 1 else 0)
    return out, name


def saved_bytes(model: nn.Module, forward: Callable[[], Any], second: set[nn.Module],
                checkpointed: set[nn.Module] | None = None) -> list[int]:
    """Bytes autograd keeps for the backward pass of `forward()` (each storage once, parameters
    left out) on [the first, the second] stage of model_parallel_2 (the innermost module's), and
    on one device; a `checkpointed` block's input, and the largest one's own (one at a time)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, tuple[int, int, Any, torch.Tensor]] = {}  # each held: no address is reused
    stack, checkpointed = [(0, None)], checkpointed or set()  # (stage, checkpointed block)

    def pack(t: torch.Tensor, outside: bool = False) -> torch.Tensor:
        at, (stage, block) = t.untyped_storage().data_ptr(), stack[-1]
        block = None if outside else block
        if at not in params and (block is None or at not in kept):  # outside blocks: kept
            kept[at] = (t.untyped_storage().nbytes(), stage, block, t)
        return t

    def enter(module: nn.Module, args: tuple) -> None:
        stack.append((int(module in second), module if module in checkpointed else stack[-1][1]))
        if module in checkpointed:  # keeps its input, whatever saves it inside
            [pack(t, outside=True) for t in args if isinstance(t, torch.Tensor)]

    def leave(*_: Any) -> None:  # returns nothing: a value would replace the module's output
        stack.pop()

    def part(i: int, block: Any) -> int:
        return sum(n for n, stage, b, _ in kept.values() if stage == i and b is block)

    hooks = [h for m in model.modules() for h in (
        m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
        top = [max([part(i, b) for b in checkpointed], default=0) for i in (0, 1)]
        out = [part(i, None) for i in (0, 1)]
        return [out[0] + top[0], out[1] + top[1], sum(out) + max(top)]
    finally:
        for h in hooks:
            h.remove()


def activations(cfg: Config, train_set: Any, param_bytes: int) -> tuple[list[int] | None, str]:
    """([first stage, second stage, one device] bytes at --batch-size, how they were found)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    if train_set is None or (ram and 4 * param_bytes > ram // 2):
        return None, f"not measured: {'no data' if train_set is None else 'too large for this RAM'}"
    cfg = dataclasses.replace(cfg, model_layout="data_parallel")
    model = task.build_model(cfg)
    blocks = usable_blocks(model, task, cfg)
    second = second_stage(model, blocks) if len(blocks) > 1 else set()
    fetch = BatchFetcher(train_set, getattr(task, "collate", None))
    dtype = AMP_DTYPES[cfg.precision]

    def at(batch: int) -> list[int]:  # CPU autocast in place of the run's on the GPU
        data = fetch.__getitems__((0, torch.arange(batch) % len(train_set)))
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            return saved_bytes(model, lambda: task.loss_fn(model, data), second,
                               set(blocks) if cfg.activation_checkpointing else None)

    try:
        try:
            a, low = 1, at(1)
        except (RuntimeError, ValueError):  # e.g. BatchNorm1d needs 2 samples
            a, low = 2, at(2)
        high = at(2 * a)
    except Exception as exc:
        return None, f"not measured (task.loss_fn on this CPU: {type(exc).__name__}: {exc})"
    # Linear in the batch; a part that is not (autocast's copies of the weights) stays fixed.
    return [round(max(0, 2 * lo - hi) + (hi - lo) / a * cfg.batch_size)
            for lo, hi in zip(low, high, strict=True)], (
        f"what autograd kept for the backward pass in a real forward on this CPU ({cfg.precision}"
        f"{' autocast' if dtype else ''}) at batch {a} and {2 * a}, fitted as a + b x batch, "
        f"taken at --batch-size {cfg.batch_size}" + "; checkpointed: each block's input, one "
        "block's own at a time" * cfg.activation_checkpointing)


def training_data(cfg: Config) -> tuple[int | None, str, Any, bool]:
    """(training samples or None, where that number comes from, a data set to measure with,
    whether there is a validation set): the run's data sets, built as it builds them."""
    try:
        train_set, val_set = task.build_datasets(cfg)
    except Exception as exc:
        return (None, f"data: not checked (task.build_datasets: {type(exc).__name__}: {exc})",
                None, True)
    source = (f"--data {cfg.data}" if cfg.data else "--dataset-size"
              if hasattr(cfg.task, "dataset_size") else "build_datasets")
    return len(train_set), source, train_set, val_set is not None and len(val_set) > 0


def settings(cfg: Config, world: int, samples: int | None, source: str, model: nn.Module,
             shards: int) -> tuple[list[str], list[str]]:
    """(notes, problems) of the settings at `world` processes, worded as the run words them."""
    notes, problems, ran = [source], [], None
    if samples is not None:
        per_epoch, total, wrong = schedule(cfg, samples, world)  # as the run counts them
        ran = min(total, per_epoch * cfg.epochs)
        batch = cfg.batch_size * world * cfg.grad_accum
        notes = [f"data: {samples:,} training samples ({source}); global batch {cfg.batch_size} x "
                 f"{world} x {cfg.grad_accum} = {batch:,}; {per_epoch:,} optimizer step(s) per "
                 f"epoch, {ran:,} in the run"]
        if hasattr(task, "tokens_per_sample"):
            notes.append(f"tokens per optimizer step: {batch * task.tokens_per_sample(cfg):,}")
        problems += wrong
    if cfg.comm_hook == "powersgd" and cfg.model_layout not in SHARDED:
        note, wrong = powersgd_report(list(model.parameters()), cfg.powersgd_rank,
                                      cfg.powersgd_warmup_steps, ran)
        notes.append(note)
        problems += wrong
    notes += [f"tensor_parallel: the plan's layers split over --tp-size {cfg.tp_size} ranks, then "
              "as fsdp; activations of tp x --batch-size samples (a group's, at most)"
              ] if cfg.model_layout == "tensor_parallel" else []
    padding = padding_note(list(model.parameters()), shards)
    if padding:
        notes.append(padding)
    return notes, problems


def table(cfg: Config, columns: list[tuple[str, str, dict]], gpu_gb: float) -> dict[str, bool]:
    """Print the figures of each layout's GPUs; returns whether each layout fits."""
    def line(label: str, cells: list[str]) -> None:
        print(f"{label:<24}" + "".join(f"{cell:>18}" for cell in cells))
    line("on each GPU", [layout + "*" * (layout == cfg.model_layout) for layout, _, _ in columns])
    line("", [gpu for _, gpu, _ in columns])
    for row in ROWS:
        if any(figures.get(row, 0) != 0 for _, _, figures in columns):
            cells = [figures.get(row, 0) for _, _, figures in columns]
            line(row, ["n/a" if v is None else human_size(v) if v else "" for v in cells])
    totals = [sum(v or 0 for v in figures.values()) for _, _, figures in columns]
    line("total", [human_size(total) for total in totals])
    spare = [(gpu_gb - RESERVE_GB) * 1e9 - total for total in totals]
    line("spare (% of the GPU)", [f"{'-' * (x < 0)}{human_size(abs(x))} "
                                  f"({x / 1e9 / gpu_gb:.0%})" for x in spare])
    line("verdict", ["fits" if x >= 0 else "DOES NOT FIT" for x in spare])
    return {layout: all(x >= 0 for (name, _, _), x in zip(columns, spare, strict=True)
                        if name == layout) for layout in LAYOUTS}


def model_line(model: nn.Module, optimizer: str, unknown_state: bool) -> str:
    """The plan's line on the model: its size, how much of it trains, its optimizer."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = f" ({trainable:,} of them train)" if trainable < total else ""
    unknown = " (n/a: its state not estimated, it does not step on the meta device)"
    return (f"model {type(model).__name__}: {total:,} parameters in {len(params)} tensors"
            f"{frozen}, fp32 (16-bit precisions compute in 16 bits from fp32 master weights); "
            f"optimizer {optimizer}{unknown if unknown_state else ''}")


def plan(cfg: Config, world: int, gpu_gb: float, per_node: int) -> int:
    """Print the plan; 0 when --model-layout fits and no setting is wrong, else 1."""
    try:
        with torch.device("meta"):
            model = task.build_model(cfg)
    except ProjectError:
        raise
    except Exception as exc:  # e.g. weights read from a file, or a value from a tensor
        raise UsageError(f"task.build_model cannot build the model on the meta device, which "
                         f"the plan needs ({type(exc).__name__}: {exc})") from None
    usable_blocks(model, task, cfg)  # what the run refuses for want of blocks, the plan refuses
    params = list(model.parameters())
    samples, source, train_set, validated = training_data(cfg)
    acts, how = activations(cfg, train_set, sum(p.numel() * p.element_size() for p in params))
    columns, errors, optimizer = [], {}, "AdamW"
    for layout in sorted(LAYOUTS):  # data_parallel's column beside fsdp's
        try:
            gpus, optimizer = static_memory(cfg, layout, world, per_node)
        except ProjectError as exc:
            errors[layout] = str(exc)
            continue
        for i, figures in enumerate(gpus):
            tp = cfg.tp_size if layout == "tensor_parallel" and world > 1 else 1  # tp x batch
            figures["activations (estimate)"] = acts and (
                acts[i] if len(gpus) == 2 else acts[2] * tp)
            columns.append((layout, f"GPU {i}" if len(gpus) == 2 else "", figures))
    print(f"plan: {world} processes, {gpu_gb:g} GB per GPU ({RESERVE_GB:g} GB of it kept for "
          f"the CUDA context, NCCL and the allocator), --batch-size {cfg.batch_size} per process, "
          f"--precision {cfg.precision}")
    unknown = any(figures["optimizer state"] is None for _, _, figures in columns)
    print(model_line(model, optimizer, unknown) + "\n")
    fits = table(cfg, columns, gpu_gb)
    for layout, error in errors.items():
        print(f"{layout}: cannot take this model: {error}")
    shards = world if "fsdp" in errors else shard_group_size(cfg.shard_group_size, world, per_node)
    hsdp = (f"; HSDP: {world // shards} replicas, --shard-group-size 0 takes a node of "
            f"--nproc-per-node {per_node}" if shards < world else "")
    print(textwrap.fill(f"* --model-layout, which the exit code follows. Exact: parameters, "
                        "gradients, optimizer state (fsdp: the fullest rank, each parameter's dim 0"
                        f" split into ceil(rows / {shards}) rows as FSDP2 does{hsdp}). Estimates: "
                        f"activations ({how}); fsdp gathered (the root unit and two blocks "
                        "unsharded, one unit's gradients; with --grad-accum above 1 all gradients)."
                        " model_parallel_2: one process on two GPUs, split as parallel.py does.",
                        100, break_on_hyphens=False))
    notes, problems = settings(cfg, world, samples, source, model, shards)
    if not validated and (problem := without_validation(cfg)):  # as the run refuses it
        problems.append(problem)
    if cfg.model_layout in errors or not fits[cfg.model_layout]:
        problems.insert(0, f"--model-layout {cfg.model_layout}: " + errors.get(
            cfg.model_layout, f"does not fit in {gpu_gb:g} GB per GPU (above)"))
    print(f"\nsettings at {world} processes:")
    for text in [*notes, *(f"warning: {p}" for p in problems)]:
        print(textwrap.TextWrapper(100, "  ", "    ", break_on_hyphens=False).fill(text))
    if problems:
        print(f"FAIL: {len(problems)} problem(s) at {world} processes (the warnings above)")
        return 1
    print(f"OK: --model-layout {cfg.model_layout} fits and the settings hold at {world} processes")
    return 0
