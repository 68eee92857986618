"""--model-layout tensor_parallel: each linear layer the task names is split over the `tp` ranks of
a 2-D mesh (data parallel x tensor parallel), then FSDP2 shards the result over `dp`.

- The plan is task.py's `tensor_parallel_plan(model, tp_size)`: {module path: "colwise" or
  "rowwise"}, as torchtitan and Megatron split a transformer: a colwise layer keeps 1/tp of its
  outputs (attention's q, k, v; the MLP's first layer), the rowwise layer after it 1/tp of its
  inputs, and one all-reduce adds the parts (DTensor's ColwiseParallel / RowwiseParallel).
- The `tp` ranks of a group are consecutive (a node's, for the fast links); the mesh is
  (world / tp) x tp. Data is unchanged: each rank still loads --batch-size samples, and a group
  runs its ranks' batches as one (the inputs all-gathered along dim 0 before the model, each rank
  keeping its own rows of the output): samples, steps, seeds and checkpoints count as under fsdp.
- The rest of the model (embeddings, norms) is whole on each rank of a group, sharded over `dp`.
  Checkpoints are DCP folders, as fsdp's: they resume under fsdp and data_parallel, and back.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import Config
from .failures import UsageError
from .runtime.prefetch import apply_to_tensors

STYLES = ("colwise", "rowwise")


def group_size(tp_size: int, world: int) -> int:
    """--tp-size checked against the world; one process splits nothing (`python train.py`)."""
    if world > 1 and world % tp_size:
        raise UsageError(f"--tp-size {tp_size} must divide the {world} ranks (the mesh is world / "
                         "tp data-parallel groups of tp ranks); give a divisor", everywhere=True)
    return tp_size if world > 1 else 1


def task_plan(model: nn.Module, task: Any, tp: int) -> dict[str, str]:
    """task.tensor_parallel_plan(model, tp), checked and resolved: {each nn.Linear layer it names,
    by name, in the model's order: its style}, whose split sizes tp divides (a layer two entries
    name: the first's). One error line for a task without a plan, or a plan that would not train
    the model it names: a layer no entry reaches, a colwise layer no rowwise one follows."""
    if not hasattr(task, "tensor_parallel_plan"):
        raise UsageError("--model-layout tensor_parallel splits the layers task.py names, and it "
                         "names none: define tensor_parallel_plan(model, tp_size) in task.py "
                         "(docs/performance.md), or use --model-layout fsdp", everywhere=True)
    plan = task.tensor_parallel_plan(model, tp)
    if not isinstance(plan, dict) or not plan:
        raise UsageError(f"tensor_parallel_plan returned {plan!r:.60}: return a dict "
                         "{module path: 'colwise' or 'rowwise'}, at least one colwise nn.Linear "
                         "and the rowwise one after it (docs/performance.md)", everywhere=True)
    modules = dict(model.named_modules())
    found: dict[str, str] = {}
    for pattern, style in plan.items():
        for name in plan_entry(pattern, style, modules):
            found.setdefault(name, style)
    layers = {name: found[name] for name in modules if name in found}  # the model's order
    check_pairs(layers, modules)
    for name, style in layers.items():
        size = modules[name].out_features if style == "colwise" else modules[name].in_features
        if size % tp:
            side = "outputs" if style == "colwise" else "inputs"
            raise UsageError(f"tensor_parallel_plan: '{name}' has {size} {side}, which "
                             f"--tp-size {tp} does not divide; give a --tp-size that divides "
                             "it, or change the model's sizes", everywhere=True)
    return layers


def plan_entry(pattern: Any, style: Any, modules: dict[str, nn.Module]) -> list[str]:
    """The nn.Linear layers one entry of the plan names ('*' stands for any part of a path)."""
    linear = [name for name, m in modules.items() if isinstance(m, nn.Linear)]
    example = f" (e.g. '{linear[0]}')" if linear else ""
    if style not in STYLES:
        raise UsageError(f"tensor_parallel_plan: '{pattern}': {style!r} is not a style; write "
                         "'colwise' or 'rowwise' in task.py's plan", everywhere=True)
    names = [name for name in modules
             if isinstance(pattern, str) and fnmatch.fnmatchcase(name, pattern)]
    if not names:
        raise UsageError(f"tensor_parallel_plan: '{pattern}' names no module of the model; write "
                         f"paths as model.named_modules() gives them{example}", everywhere=True)
    for name in names:
        if not isinstance(modules[name], nn.Linear):
            inner = [n for n in linear if n.startswith(f"{name}.")][:1]
            hint = f" (e.g. '{inner[0]}')" if inner else example
            raise UsageError(f"tensor_parallel_plan: '{name}' is a "
                             f"{type(modules[name]).__name__}, and only nn.Linear layers split; "
                             f"name the linear layers themselves{hint}", everywhere=True)
    return names


def check_pairs(layers: dict[str, str], modules: dict[str, nn.Module]) -> None:
    """In the model's order, each run of colwise layers is followed by the rowwise layer that
    takes their split outputs: a colwise layer alone leaves each rank 1/tp of its outputs (a
    loss on part of the logits), a rowwise one alone gets whole inputs where it wants parts."""
    open_group: list[str] = []
    for name, style in layers.items():
        if style == "colwise":
            open_group.append(name)
            continue
        if not open_group:
            raise UsageError(f"tensor_parallel_plan: '{name}' is rowwise with no colwise layer "
                             "before it (in the model's order): a rowwise layer takes the split "
                             "outputs of the colwise layers before it; make the layer before it "
                             f"colwise, or leave '{name}' out", everywhere=True)
        inputs, outputs = modules[name].in_features, [modules[c].out_features for c in open_group]
        if inputs not in outputs:
            raise UsageError(f"tensor_parallel_plan: '{name}' is rowwise with {inputs} inputs, "
                             f"but the colwise layers before it ({', '.join(open_group)}) give "
                             f"{', '.join(map(str, outputs))} outputs: pair each colwise layer "
                             "with the rowwise layer that takes its outputs", everywhere=True)
        open_group = []
    if open_group:
        raise UsageError(f"tensor_parallel_plan: '{open_group[-1]}' is colwise and no rowwise "
                         "layer after it takes its outputs: each rank would keep 1/tp of them "
                         "(the loss would see part of the logits); name the rowwise layer that "
                         "follows it, or leave it out", everywhere=True)


def refuse_unsupported(cfg: Config, task: Any) -> None:
    """What the layout does not do yet: the run and doctor --plan stop on it alike."""
    if cfg.compile or hasattr(task, "train_step"):
        what = "--compile" if cfg.compile else "a train_step of one's own"
        raise UsageError(f"{what} is not yet supported with --model-layout tensor_parallel; "
                         "drop it or use --model-layout fsdp", everywhere=True)


def mesh_and_plan(model: nn.Module, cfg: Config, device: torch.device, task: Any,
                  is_main: bool) -> Any:
    """Split the plan's layers over the `tp` dimension (the model on `device`, the same on every
    rank); returns the `dp` mesh FSDP2 shards over."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    tp = group_size(cfg.tp_size, world)
    refuse_unsupported(cfg, task)
    layers = task_plan(model, task, tp)
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    # Layer by layer: torch 2.6's {path: style} also gives a style to an upper module named as a
    # later part of the path (block "0" for "blocks.*.mlp.0"); later releases fixed it.
    for name, style in layers.items():
        parallelize_module(model.get_submodule(name), mesh["tp"], styles[style]())
    gather_batches(model, mesh["tp"].get_group(), tp, mesh["tp"].get_local_rank())
    if is_main:
        print(f"tensor_parallel: {world // tp} data-parallel group(s) of {tp} rank(s); "
              f"{len(layers)} layers split", flush=True)
    return mesh["dp"]


def gather_batches(model: nn.Module, group: Any, tp: int, me: int) -> None:
    """The tp ranks of a group compute together: the model's tensor inputs are all-gathered along
    dim 0 (every rank the same batch, as the split layers need), and each rank gets back its own
    rows of the output (any output whose dim 0 is a multiple of the batch's: per-sample or
    per-token), so that loss_fn and eval_metrics see this rank's samples only."""
    rows: list[int] = []

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        first = next(t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim())
        if module.training:  # the training batches are the same size on every rank
            rows[:] = [len(first)] * tp
        else:  # validation: the last batches differ
            sizes = torch.tensor([len(first)], device=first.device)
            parts = [torch.empty_like(sizes) for _ in range(tp)]
            dist.all_gather(parts, sizes, group=group)
            rows[:] = [int(p) for p in parts]
        return (tuple(_gather(a, rows, group) for a in args),
                {k: _gather(v, rows, group) for k, v in kwargs.items()})

    def own_rows(out: torch.Tensor) -> torch.Tensor:
        if not out.dim():
            return out
        per_row = len(out) // sum(rows)
        start = sum(rows[:me]) * per_row
        return _OwnRows.apply(out, start, rows[me] * per_row, group, tp)

    def after(module: nn.Module, args: tuple, out: Any) -> Any:
        return apply_to_tensors(out, own_rows)  # the output keeps its type (a ModelOutput)

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after)


def _gather(x: Any, rows: list[int], group: Any) -> Any:
    """x from every rank of the group, concatenated along dim 0 (padded to the longest)."""
    if not torch.is_tensor(x) or not x.dim():
        return x
    longest = max(rows)
    if len(x) < longest:  # all_gather takes tensors of one size
        padded = torch.cat([x, x.new_zeros((longest - len(x), *x.shape[1:]))])
    else:
        padded = x.contiguous()
    parts = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, rows, strict=True)])


class _OwnRows(torch.autograd.Function):
    """Forward: this rank's rows of an output every rank of the group holds whole. Backward: the
    gradient of the whole output, gathered from the group's ranks (each has its own rows' part)
    over tp: each rank's weights then get the gradient of the mean of the group's losses, as under
    data parallel, where each rank's loss is its own batch's mean."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, start: int, length: int, group: Any,
                tp: int) -> torch.Tensor:
        ctx.shape, ctx.start, ctx.group, ctx.tp = out.shape, start, group, tp
        return out[start:start + length].clone()  # not a view: FSDP hooks the output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        whole = grad.new_zeros(ctx.shape)
        whole[ctx.start:ctx.start + len(grad)] = grad
        dist.all_reduce(whole, group=ctx.group)
        return whole / ctx.tp, None, None, None, None


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> None:
    """torch's clip_grad_norm_ over parameters on two device meshes (the split layers on
    (dp, tp), the rest on dp), whose norms it cannot stack, nor scale with one factor: a norm
    per mesh, then their norm; each rank scales its own shards."""
    grads = [p.grad for p in params if p.grad is not None]
    meshes = list(dict.fromkeys(getattr(g, "device_mesh", None) for g in grads))  # rank order
    norms = [torch.nn.utils.get_total_norm([g for g in grads
                                            if getattr(g, "device_mesh", None) == mesh])
             for mesh in meshes]
    total = torch.linalg.vector_norm(torch.stack(
        [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]))
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch's clip_grads_with_norm_
    for g in grads:
        (g.to_local() if hasattr(g, "to_local") else g).mul_(scale)


def shapes_on_rank(model: nn.Module, task: Any, cfg: Config,
                   world: int) -> tuple[dict[int, list[int]], int]:
    """doctor --plan: (each parameter's shape on a rank of a tp group, by id: the plan's layers
    1/tp (colwise: weight and bias rows; rowwise: weight columns), the rest whole; the world / tp
    data-parallel ranks FSDP2 then splits dim 0 over). The run's refusals."""
    refuse_unsupported(cfg, task)
    tp = group_size(cfg.tp_size, world)
    layers, out = task_plan(model, task, tp), {}
    for name, module in model.named_modules():
        style = layers.get(name, "")
        for key, p in module.named_parameters(recurse=False):
            shape = list(p.shape)
            if style == "colwise" or (style == "rowwise" and key == "weight"):
                shape[style == "rowwise"] //= tp
            out[id(p)] = shape
    return out, world // tp
