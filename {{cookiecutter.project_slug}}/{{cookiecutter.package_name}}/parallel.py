"""Where the model lives: the layouts of --model-layout (tensor_parallel: its module, where baked).

- data_parallel: the whole model on one device per process, wrapped in DDP.
- model_parallel_2: the second half of the model's blocks on a second device, then DDP.
- fsdp: FSDP2 (`fully_shard`) on each block and on the root: parameters, gradients and optimizer
  state sharded across ranks, gathered block by block. Across nodes, by default, each node's
  ranks share one sharded copy and the nodes replicate it (HSDP, a 2-D mesh).

task.py's `blocks(model)` says where the blocks are (an `nn.Sequential`'s children are)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from .config import SHARDED, Config
from .data import move_to
from .failures import UsageError, warn
from .meters import human_size
from .runtime import torch_private as private


def model_blocks(model: nn.Module, task: Any) -> list[nn.Module] | None:
    """The model's repeated blocks in forward order, from task.blocks, or None if unknown."""
    if hasattr(task, "blocks"):
        found = list(task.blocks(model))
        if not found or not all(isinstance(b, nn.Module) for b in found):
            raise UsageError("task.blocks(model) must return a non-empty list of the model's "
                             "submodules", everywhere=True)
        return found
    return list(model) if isinstance(model, nn.Sequential) and len(model) > 1 else None


def usable_blocks(model: nn.Module, task: Any, cfg: Config) -> list[nn.Module]:
    """model_blocks(...) or [], refused where --activation-checkpointing or --model-layout
    model_parallel_2 needs blocks that task.py does not give."""
    blocks, name = model_blocks(model, task) or [], type(model).__name__
    if cfg.activation_checkpointing and not blocks:
        raise UsageError(f"--activation-checkpointing checkpoints {name} block by block: define "
                         "blocks(model) in task.py, or drop the flag", everywhere=True)
    if cfg.model_layout == "model_parallel_2" and len(blocks) < 2:
        raise UsageError(
            f"model_parallel_2 needs to know where to split {name}: define blocks(model) in "
            "task.py returning its repeated blocks in forward order (at least two), or use "
            "--model-layout data_parallel", everywhere=True)
    return blocks


def second_stage(model: nn.Module, blocks: list[nn.Module]) -> set[nn.Module]:
    """What split_over_two puts on the second device: the second half of the blocks and every
    module registered after the last block."""
    order, last = list(model.modules()), set(blocks[-1].modules())
    return {m for block in blocks[len(blocks) // 2:] for m in block.modules()} | {
        m for m in order[order.index(blocks[-1]) + 1:] if m not in last}


def split_over_two(model: nn.Module, blocks: list[nn.Module], devices: list[torch.device]) -> None:
    """second_stage(...) on devices[1], the rest on devices[0]. A module with weights of its own
    moves its inputs to its device, whatever calls it, and so does a block (before a checkpoint
    keeps the random state of its inputs' devices); the model's output comes to devices[0]."""
    model.to(devices[0])
    for module in second_stage(model, blocks):
        module.to(devices[1])
    for module in model.modules():
        if weights := [*module.parameters(recurse=module in blocks),
                       *module.buffers(recurse=False)]:
            module.register_forward_pre_hook(lambda mod, args, kwargs, to=weights[0].device: (
                move_to(args, to), move_to(kwargs, to)), with_kwargs=True)
    model.register_forward_hook(lambda mod, args, out: move_to(out, devices[0]))


def checkpoint_blocks(blocks: list[nn.Module], compiled: bool = False) -> None:
    """--activation-checkpointing: each block's forward runs under torch.utils.checkpoint, inside
    DDP's and FSDP's hooks. Eager, a BatchNorm's running statistics are put back after the
    second forward (compiled, the second forward updates nothing: compiled_recompute)."""
    for block in blocks:
        norms = private.batch_norms(block)
        if norms and compiled:
            private.compiled_recompute()
        contexts = {"context_fn": functools.partial(_kept_stats, norms)} if (
            norms and not compiled) else {}
        block.forward = functools.partial(_checkpointed, block.forward, **contexts)


def _checkpointed(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    # A function of this project's, not torch's: block.compile() compiles from here (torch's
    # own frames, checkpoint's included, are left to run eagerly).
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _kept_stats(norms: list[nn.Module]) -> tuple[Any, Any]:
    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        stats = [b for m in norms for b in m.buffers()]  # now: .to(device) replaced the tensors
        saved = [t.clone() for t in stats]
        try:
            yield
        finally:  # also when checkpoint stops the second forward early
            with torch.no_grad():
                for t, value in zip(stats, saved, strict=True):
                    t.copy_(value)
    return contextlib.nullcontext(), recompute()


def parallelize(model: nn.Module, cfg: Config, devices: list[torch.device], task: Any,
                is_main: bool, local_world_size: int = 0) -> nn.Module:
    """The model (built on the CPU) placed by --model-layout; returns what the loop calls. The
    optimizer is built after this, on the parameters as placed (and, for fsdp, sharded)."""
    if cfg.sync_bn:
        if devices[0].type == "cuda":
            # Batch statistics over the global batch; only the CUDA kernels support it.
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        elif is_main:
            warn("--sync-bn needs CUDA; keeping per-process BatchNorm on CPU")
    if cfg.compile and not private.compile_supported():
        raise UsageError(f"--compile: torch.compile does not support Python "
                         f"{sys.version.split()[0]} on {sys.platform} with PyTorch "
                         f"{torch.__version__}; run without --compile", everywhere=True)
    blocks = usable_blocks(model, task, cfg)
    if cfg.activation_checkpointing:
        checkpoint_blocks(blocks, cfg.compile)
    if cfg.model_layout in SHARDED:
        return _fully_shard(model, cfg, devices[0], task, blocks, is_main, local_world_size)
    if cfg.model_layout == "model_parallel_2":
        split_over_two(model, blocks, devices)
    else:
        model.to(devices[0])
    # A model spread over two devices (or on the CPU) is wrapped without device_ids.
    single_cuda = len(set(devices)) == 1 and devices[0].type == "cuda"
    # bucket_cap_mb only when given: any value, even DDP's 25, drops its small first bucket.
    buckets = {} if cfg.bucket_cap_mb is None else {"bucket_cap_mb": cfg.bucket_cap_mb}
    # A step of the task's own may leave parameters without gradients (a GAN's critic step never
    # reaches the generator): DDP then finds them after each forward (docs/custom-step.md).
    unused = cfg.find_unused_parameters or hasattr(task, "train_step")
    wrapped: nn.Module = DDP(model, device_ids=[devices[0]] if single_cuda else None,
                             find_unused_parameters=unused, static_graph=cfg.static_graph,
                             gradient_as_bucket_view=cfg.gradient_as_bucket_view, **buckets)
    return torch.compile(wrapped) if cfg.compile else wrapped


def shard_group_size(asked: int, world_size: int, local_world_size: int) -> int:
    """--shard-group-size, with 0 resolved: a node's ranks when the job spans several nodes
    (local_world_size, from the launcher), else every rank."""
    size = asked or (local_world_size if 0 < local_world_size < world_size else world_size)
    if size > world_size or world_size % size:
        raise UsageError(f"--shard-group-size {size} must divide the {world_size} ranks into "
                         "equal groups; give a divisor of the world size (0: one node each)",
                         everywhere=True)
    return size


def rows_on_rank(p: torch.Tensor, shards: int) -> int:
    """Elements of `p` on the fullest rank when FSDP2 splits dim 0 over `shards` ranks (torch.chunk:
    ceil(rows / shards) rows, the last ranks fewer or none; each rank's storage padded to that)."""
    rows = p.shape[0] if p.dim() else 1
    return math.ceil(rows / shards) * (p.numel() // rows) if rows else 0


def padding_note(params: list[torch.Tensor], shards: int) -> str | None:
    """What FSDP2's padding costs over `shards` ranks (each parameter padded to ceil(rows /
    shards) rows a rank) and how many parameters leave a rank an empty shard; None where nothing
    is padded. doctor --plan notes it and an fsdp run prints it at its start, in these words."""
    waste = sum((rows_on_rank(p, shards) * shards - p.numel()) * p.element_size() for p in params)
    if not waste:
        return None
    rows = [p.shape[0] if p.dim() else 1 for p in params]
    # torch.chunk gives fewer pieces than ranks where ceil(n / ceil(n / shards)) < shards.
    empty = sum(n > 0 and math.ceil(n / math.ceil(n / shards)) < shards for n in rows)
    return (f"fsdp: padding each parameter to ceil(rows / {shards}) rows costs "
            f"{human_size(waste)} per {shards} ranks, in parameters and as much in gradients; "
            f"{empty} of {len(rows)} parameters leave some ranks an empty shard")


def _fully_shard(model: nn.Module, cfg: Config, device: torch.device, task: Any,
                 blocks: list[nn.Module], is_main: bool, local_world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if importlib.util.find_spec("numpy") is None:
        raise UsageError(f"--model-layout {cfg.model_layout} needs numpy for its checkpoints "
                         "(torch.distributed.checkpoint): pip install numpy", everywhere=True)
    model.to(device)
    for tensor in (*model.parameters(), *model.buffers()):  # rank 0's, as DDP's wrap does: a
        dist.broadcast(tensor.detach(), src=0)  # rank-seeded init would shard other models' parts
    if cfg.model_layout == "tensor_parallel":  # in the bakes that chose it: FSDP2 over "dp"
        from .tensor_parallel import mesh_and_plan
        mesh = mesh_and_plan(model, cfg, device, task, is_main)
    else:
        shard = shard_group_size(cfg.shard_group_size, dist.get_world_size(), local_world_size)
        replicas = dist.get_world_size() // shard
        # One dimension: plain fsdp. Two: HSDP, fully_shard replicates over the first and shards
        # over the second (each group of `shard` consecutive ranks holds one copy).
        mesh = (init_device_mesh(device.type, (shard,)) if replicas == 1 else init_device_mesh(
            device.type, (replicas, shard), mesh_dim_names=("replicate", "shard")))
        if replicas > 1 and is_main:
            print(f"fsdp: {replicas} replica group(s) of {shard} rank(s) (HSDP)", flush=True)
        padding = padding_note(list(model.parameters()), shard)
        if padding and is_main:  # as doctor --plan notes it
            print(f"note: {padding}", flush=True)
    private.fsdp_on(device, cfg.model_layout)  # once the flags of its mesh were checked
    if dist.get_backend() != "nccl":  # the mesh's new groups: --timeout-s (NCCL's: at step 1)
        private.set_group_timeout(cfg.timeout_s)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if device.type == "cuda" and cfg.precision != "fp32":
        # Compute in bf16/fp16, reduce gradients in fp32 (autocast is not used with fsdp on CUDA).
        dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    inside, custom = {p for b in blocks for p in b.parameters()}, hasattr(task, "train_step")
    # A step may call a child of the model directly: one with weights outside the blocks is a
    # unit of its own, which gathers itself.
    children = {name: child for name, child in model.named_children()
                if custom and child not in blocks and set(child.parameters()) - inside}
    if not blocks and is_main:
        units = f"as one unit per child ({', '.join(children)})" if children else "as one unit"
        print(f"note: fsdp shards {type(model).__name__} {units} (define blocks(model) in "
              "task.py to gather one block at a time and save more memory)", flush=True)
    if custom and cfg.grad_accum > 1 and is_main:
        print(f"note: with --grad-accum {cfg.grad_accum} under fsdp, p.grad is None in train_step "
              "before a group's last batch: FSDP holds the earlier batches' gradients until then "
              "(docs/custom-step.md)", flush=True)
    for block in blocks:
        if cfg.compile:
            block.compile()  # compile each block before sharding it, as torchtitan does
        fully_shard(block, **kwargs)
    for unit in (*children.values(), model):  # the children, then the root
        fully_shard(unit, **kwargs)
    if custom:
        private.fsdp_for_own_step(model, [m for m in model.modules() if isinstance(m, FSDPModule)])
        for name, module in model.named_modules():  # with --compile too (train_step is eager)
            if not isinstance(module, FSDPModule) and list(module.parameters(recurse=False)):
                module.register_forward_pre_hook(functools.partial(_check_gathered, name))
    return model


def _check_gathered(name: str, module: nn.Module, args: Any) -> None:
    """A module inside a unit, called by a step: one line, not a DTensor traceback, if its unit
    is not running (it holds this rank's shard of each weight, not the weight)."""
    if torch.compiler.is_compiling():  # a compiled block's forward: inside its unit, no check
        return
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
        raise UsageError(f"step.module.{name} was called outside its unit (by train_step or the "
                         "model's forward): fsdp gathers its weights only inside that unit; call a "
                         "child of the model or a block (docs/custom-step.md)", everywhere=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside torch.compile and DDP: whose state_dict has no prefixes."""
    model = private.uncompiled(model)
    return model.module if isinstance(model, DDP) else model


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """No gradients exchanged in the backward passes inside: DDP's `no_sync()`; FSDP2's
    `set_requires_gradient_sync(False)`, which also keeps the gradients unsharded until the last
    micro-batch of an accumulation group."""
    inner = private.uncompiled(model)
    if isinstance(inner, DDP):
        with inner.no_sync():
            yield
        return
    inner.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        inner.set_requires_gradient_sync(True)
