"""Every private PyTorch API the project uses, and every check of what one torch release lacks,
only here: callers call plain functions. Each entry names what it reaches into, the releases that
have it, and what a torch without it gets: a fallback that keeps the result right (said in a
`note:` line) or one `error:` line naming the feature, the torch found and the first release with
it. Run on every minor release from 2.6.0 to 2.14.1 (the template's `make torch-range`,
2026-12-04: docs/configuration.md), and each entry without its attribute (test_torch_private)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..failures import UsageError


def missing(feature: str, what: str, first: str = "") -> UsageError:
    since = f"torch {first} or later" if first else "a torch of docs/configuration.md's versions"
    return UsageError(f"{feature} needs {what}, which torch {torch.__version__} lacks; install "
                      f"{since}", everywhere=True)


def note(what: str) -> bool:
    print(f"note: torch {torch.__version__} has no {what}", file=sys.stderr, flush=True)
    return False


def set_group_timeout(timeout_s: float) -> None:
    """Every group's timeout changed once made: the default group's (NCCL: long for start-up and
    the first step, then --timeout-s) and a 2-D mesh's (torch's default: 30 minutes; NCCL: 10):
    distributed_c10d._set_pg_timeout over _world.pg_map, PyTorch's only way (#115453). Missing: a
    note; those timeouts stay (a hang is noticed later)."""
    c10d = dist.distributed_c10d
    if hasattr(c10d, "_set_pg_timeout") and hasattr(getattr(c10d, "_world", None), "pg_map"):
        for group in list(c10d._world.pg_map):
            c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
    else:
        note("distributed_c10d._set_pg_timeout: the groups' first timeouts stay")


def default_store(launcher: str) -> dist.Store:
    """The store of the process group `launcher` made (distributed_c10d._get_default_store).
    Missing: an error line naming that launcher."""
    if not hasattr(dist.distributed_c10d, "_get_default_store"):
        raise missing(f"a process group made by {launcher}", "distributed_c10d._get_default_store")
    return dist.distributed_c10d._get_default_store()


def wrap_agent_monitor(wrap: Callable[[Callable, Any, Any], Any]) -> None:
    """torchrun's agent calls `wrap(monitor, agent, group)` for each check of its workers
    (LocalElasticAgent._monitor_workers). Missing: a note; it restarts whatever failed."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    if callable(monitor := vars(LocalElasticAgent).get("_monitor_workers")):  # not the base's
        LocalElasticAgent._monitor_workers = lambda agent, group: wrap(monitor, agent, group)
    else:
        note("LocalElasticAgent._monitor_workers: a mistake is retried at each restart")


def stop_restarts(agent: Any) -> bool:
    """No more restarts for torchrun's `agent` (SimpleElasticAgent._remaining_restarts). Missing:
    a note, and False: it restarts."""
    if not isinstance(getattr(agent, "_remaining_restarts", None), int):
        return note("SimpleElasticAgent._remaining_restarts: a mistake is retried at each restart")
    agent._remaining_restarts = 0
    return True


def uncompiled(model: nn.Module) -> nn.Module:
    """The module in torch.compile's wrapper (OptimizedModule._orig_mod), else `model`. Missing:
    an error line naming --compile."""
    if type(model).__name__ != "OptimizedModule":
        return model
    if not isinstance(inner := dict(model.named_children()).get("_orig_mod"), nn.Module):
        raise missing("--compile", "OptimizedModule._orig_mod (the module torch.compile wraps)")
    return inner


def compile_supported() -> bool:
    """Whether torch.compile runs on this Python and platform (torch._dynamo.is_dynamo_supported).
    Missing: True, and torch.compile's own error says so when it does not."""
    return getattr(torch._dynamo, "is_dynamo_supported", lambda: True)()


def compiled_recompute() -> None:
    """torch.compile's activation checkpointing recomputes a block without updating BatchNorm's
    running statistics from torch 2.9 on; 2.6 to 2.8 update them again (each batch counted twice).
    A release check, since no attribute tells: one error line."""
    if torch.__version__ < "2.9":  # torch.torch_version.TorchVersion compares as a version
        raise missing("--activation-checkpointing with --compile and BatchNorm",
                      "a compiled recompute that leaves the running statistics alone", "2.9")


def library_floor(library: str, first: str, feature: str, then: str) -> None:
    """`library` requires torch `first` (the fault_tolerance answer's, in its 0.2 releases: 2.7),
    and no attribute shows what an older torch lacks of it. A release check: one error line below
    `first`, naming `feature`, and `then`: what to run once torch is upgraded."""
    if torch.__version__ < first:  # torch.torch_version.TorchVersion compares as a version
        raise UsageError(f"{feature} needs torch {first} or later ({library} requires it), not "
                         f"torch {torch.__version__}: upgrade torch, then {then}", everywhere=True)


def batch_norms(module: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers in `module`: instances of nn.modules.batchnorm._BatchNorm (2.6 to
    2.14), the base of BatchNorm1d to 3d, their lazy forms, SyncBatchNorm and one's own. Missing:
    instances of torch's public BatchNorm classes, which are then all there are."""
    norm = getattr(nn.modules.batchnorm, "_BatchNorm", None) or (
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
        nn.LazyBatchNorm3d, nn.SyncBatchNorm)
    return [m for m in module.modules() if isinstance(m, norm)]


def ddp_backward(ddp: nn.Module) -> Callable[[torch.Tensor], None]:
    """What readies DDP's reducer from a loss as its forward does, for Step.backward
    (Reducer._rebuild_buckets, then prepare_for_backward). Checked once, here, not at every step.
    Missing: an error line (every DDP step uses it)."""
    if not all(hasattr(getattr(ddp, "reducer", None), f)
               for f in ("_rebuild_buckets", "prepare_for_backward")):
        raise missing("a step under DDP", "DistributedDataParallel's reducer.prepare_for_backward")

    def ready(loss: torch.Tensor) -> None:
        ddp.reducer._rebuild_buckets()  # (once, at the second step) as DDP's forward does
        ddp.reducer.prepare_for_backward(
            [loss] if ddp.find_unused_parameters and not ddp.static_graph else [])
    return ready


def fsdp_on(device: torch.device, layout: str) -> None:
    """FSDP2 on a CPU (gloo) averages gradients over the ranks from torch 2.9: 2.7 and 2.8 sum
    them (plain SGD ends elsewhere than DDP; HSDP on 2.7: gloo has no ReduceOp.AVG), and 2.6's
    CPU streams lack record_event (pytorch#145935). A release check: one error line before 2.9."""
    if device.type == "cpu" and torch.__version__ < "2.9":
        raise missing(f"--model-layout {layout} on a CPU", "FSDP2's gradients averaged over gloo",
                      "2.9")


def reusable_stager(device: torch.device) -> Any:
    """A stager for dcp.async_save that reuses its CPU copy of the state across saves: else it
    allocates one at every save, on the training thread (about 2 s for 2.7 GB from an H100, most
    of the stall). Safe: the next save first waits for the previous, which reads it. Missing
    (DefaultStager, from torch 2.9): None, and async_save stages a new copy each time."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    gpu = device.type == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=gpu))


def fsdp_for_own_step(model: nn.Module, units: list[nn.Module]) -> None:
    """A train_step of one's own under fsdp: the root unit initialised first (FSDPState._lazy_init);
    each unit's FSDPParamGroup.post_backward keeps its weights gathered after a backward building a
    graph (a gradient penalty's create_graph), for the backward through it. The groups are
    FSDPState._fsdp_param_groups from torch 2.12, one _fsdp_param_group (or None) in 2.6 to 2.11.
    Missing: an error line."""
    states = [getattr(unit, "_get_fsdp_state", lambda: None)() for unit in units]
    found = [s._fsdp_param_groups if hasattr(s, "_fsdp_param_groups")
             else [getattr(s, "_fsdp_param_group", 0)] for s in states]  # [0]: neither
    groups = [g for each in found for g in each if g]
    if not (all(hasattr(s, "_lazy_init") for s in states) and [0] not in found
            and all(hasattr(g, "post_backward") and hasattr(g, "reshard_after_backward")
                    for g in groups)):
        raise missing("a train_step of one's own under --model-layout fsdp",
                      "FSDP2's FSDPState._lazy_init and its parameter groups")
    model._get_fsdp_state()._lazy_init()  # the root is root, whichever unit runs first
    for group in groups:
        group.post_backward = _keep_gathered_for_graph(group, group.post_backward)


def _keep_gathered_for_graph(group: Any, post_backward: Callable) -> Callable:
    def run(*args: Any) -> None:
        keep = group.reshard_after_backward
        group.reshard_after_backward = keep and not torch.is_grad_enabled()
        post_backward(*args)
        group.reshard_after_backward = keep
    return run


def foreach_decay(averages: list[torch.Tensor], new: list[torch.Tensor], decay: float) -> None:
    """averages = averages * decay + new * (1 - decay), one kernel each (torch._foreach_mul_,
    _foreach_add_). Missing: per tensor, the same operations."""
    if hasattr(torch, "_foreach_mul_") and hasattr(torch, "_foreach_add_"):
        torch._foreach_mul_(averages, decay)
        torch._foreach_add_(averages, new, alpha=1.0 - decay)
    else:
        for average, value in zip(averages, new, strict=True):
            average.mul_(decay).add_(value, alpha=1.0 - decay)
