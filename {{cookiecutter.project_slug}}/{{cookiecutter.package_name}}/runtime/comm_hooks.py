"""--comm-hook: how DDP exchanges gradients. `none` is DDP's own all-reduce in the gradients' dtype;
`fp16` and `bf16` halve the bytes sent (cast, summed, cast back); `powersgd` sends a low-rank
approximation of each matrix's gradient (with error feedback) after --powersgd-warmup-steps steps.

PowerSGD's state (each rank's error feedback, the shared low-rank factors) goes into every
checkpoint: a resumed run continues bit for bit. Torch keys it by DDP's bucket, and a new DDP's
first step puts every parameter in one bucket before it settles on its real ones; so it is saved per
parameter and cut into whatever buckets DDP uses, and a resumed run's first step compresses the one
bucket as the saved run's buckets, one by one (the same computation, rounded the same way)."""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import Config
from ..failures import UsageError
from .torch_private import uncompiled


# The hooks' `bucket` is a dist.GradBucket. It is not annotated: DDP compares the annotation with
# that class, and with postponed annotations it would see a string and refuse the hook.
def bf16_compress(process_group: Any, bucket):
    """torch's bf16_compress_hook. Called through this function because DDP refuses that hook by
    its name unless NCCL is there, though gloo sums bf16 tensors too."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def register_comm_hook(model: nn.Module, cfg: Config) -> PowerSGD | None:
    """Register --comm-hook on the DDP in `model` (none in fsdp); the PowerSGD hook, else None."""
    ddp = uncompiled(model)
    if cfg.comm_hook == "none" or not isinstance(ddp, DDP):
        return None
    if cfg.comm_hook in ("fp16", "bf16"):
        hook = default_hooks.fp16_compress_hook if cfg.comm_hook == "fp16" else bf16_compress
        ddp.register_comm_hook(None, hook)
        return None
    if importlib.util.find_spec("numpy") is None:
        raise UsageError("--comm-hook powersgd needs numpy (torch's PowerSGD draws its random "
                         "projections with it): pip install numpy", everywhere=True)
    return PowerSGD(ddp, cfg.powersgd_rank, cfg.powersgd_warmup_steps)


def powersgd_report(params: list[nn.Parameter], rank: int, warmup_steps: int,
                    steps: int | None) -> tuple[str, list[str]]:
    """(a note, problems) of PowerSGD on these parameters in a run of `steps` steps: which
    gradients it compresses (torch's hook's rule: a (rows, rest) matrix whose rank-`rank` factors
    are less than half its size) and whether it compresses anything at all. doctor --plan fails
    on the problems, the run warns of them: in the same words, from here."""
    shapes = [(p.shape[0], p.numel() // p.shape[0]) if p.dim() else (1, 1)
              for p in params if p.requires_grad]
    whole = sum(n * m <= (n + m) * min(n, m, rank) * 2 for n, m in shapes)
    note = (f"--powersgd-rank {rank}: {len(shapes) - whole} of {len(shapes)} gradients "
            f"compressed, {whole} sent whole (vectors, or (rows + cols) x rank x 2 >= rows x cols)")
    problems = []
    if whole == len(shapes):
        problems.append(f"--powersgd-rank {rank}: PowerSGD compresses none of the {whole} "
                        "gradients; drop --comm-hook powersgd")
    if steps is not None and max(2, warmup_steps) >= steps:
        problems.append(f"--powersgd-warmup-steps {warmup_steps} is not shorter than the run "
                        f"({steps} steps): PowerSGD never compresses")
    return note, problems


class PowerSGD:
    """torch's PowerSGD hook, with its state saved and restored per parameter."""

    CHECK_STEPS = 3  # DDP settles its buckets after its first step; check them until then

    def __init__(self, ddp: DDP, rank: int, warmup_steps: int) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        self.torch_hook = powerSGD_hook
        # Error feedback and warm start on (torch's defaults); the warm-up must be at least 2
        # steps, so that DDP's first step (one bucket of everything) is a plain all-reduce.
        self.state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank,
            start_powerSGD_iter=max(2, warmup_steps), random_seed=0)
        self.rank, self.warmup_steps = rank, warmup_steps  # as given (report())
        self.params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.layout: dict[int, tuple[int, ...]] = {}  # bucket index -> parameter indices
        self.owner: dict[int, int] = {}  # parameter index -> its bucket's index
        self.pending: dict[int, dict[str, torch.Tensor]] = {}  # loaded, not yet in a bucket
        self.saved_layout: dict[int, tuple[int, ...]] = {}  # the buckets of the loaded run
        self._steps_checked = 0
        # With gloo, the hook's chained collectives run in gloo's threads, and two buckets in
        # flight at once can issue theirs in another order on each rank: a hang (seen with
        # several buckets). There, a bucket starts once the one before has finished.
        self.one_bucket_at_a_time = dist.get_backend() != "nccl"
        self._previous: torch.futures.Future | None = None
        ddp.register_comm_hook(self.state, self._hook)

    def report(self, steps: int) -> tuple[str, list[str]]:
        """What doctor --plan says of this PowerSGD in a run of `steps` steps (powersgd_report)."""
        return powersgd_report(self.params, self.rank, self.warmup_steps, steps)

    def _hook(self, state: Any, bucket):
        if self._previous is not None:
            self._previous.wait()
            self._previous = None
        future = None
        if self._steps_checked < self.CHECK_STEPS:
            params = tuple(self.index[id(p)] for p in bucket.parameters())
            if self._steps_checked == 0 and (saved := self._saved_buckets_in(params)):
                future = self._as_saved_buckets(saved, params, bucket)
            else:
                self._fit_state_to(bucket.index(), params, bucket.buffer())
            self._steps_checked += bucket.is_last()  # once a step
        if future is None:
            future = self.torch_hook.powerSGD_hook(state, bucket)
        compressing = self.state.iter >= self.state.start_powerSGD_iter
        if self.one_bucket_at_a_time and compressing and not bucket.is_last():
            self._previous = future
        return future

    def _fit_state_to(self, key: int, params: tuple[int, ...], buffer: torch.Tensor) -> None:
        """Give bucket `key` the state of its `params` (DDP rebucketed, or a checkpoint loaded)."""
        if self.layout.get(key) == params:
            return
        if key in self.layout or any(self.owner.get(i, key) != key for i in params):
            # DDP rebucketed: state goes to the parameters, then into each new bucket as it comes.
            self.pending.update(self._per_parameter())
            for kept in (self.state.error_dict, self.state.p_memory_dict,
                         self.state.q_memory_dict, self.layout, self.owner):
                kept.clear()
        self.layout[key] = params
        self.owner.update((i, key) for i in params)
        if params and all(i in self.pending for i in params):
            self._materialize(key, params, buffer)

    def _saved_buckets_in(self, params: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
        """The loaded run's buckets (index, parameters) this bucket holds several of, or in another
        order; none if it is one of them or cuts across them (a resumed run's first step)."""
        if not self.saved_layout or self.state.iter < self.state.start_powerSGD_iter:
            return []
        inside = sorted((k, ps) for k, ps in self.saved_layout.items() if set(ps) <= set(params))
        if params in (ps for _, ps in inside) or sum(len(ps) for _, ps in inside) != len(params):
            return []
        return inside

    def _as_saved_buckets(self, saved: list[tuple[int, tuple[int, ...]]],
                          params: tuple[int, ...], bucket) -> torch.futures.Future:
        """PowerSGD on this bucket's gradients cut into the loaded run's buckets `saved`, one by
        one, each in a buffer laid out as in that run: the same computation as there."""
        grads = dict(zip(params, bucket.gradients(), strict=True))
        for key, members in saved:
            piece = saved_bucket(key, len(self.saved_layout), [grads[i] for i in members])
            self._fit_state_to(key, members, piece.buffer())
            self.torch_hook.powerSGD_hook(self.state, piece).wait()
            for i, grad in zip(members, piece.gradients(), strict=True):
                grads[i].copy_(grad)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    def _shapes(self, params: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """(parameter, rows, rank) of each matrix PowerSGD compresses in a bucket, in the order
        its hook packs their factors: grouped by shape, shapes in order of appearance."""
        by_shape: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
        for i in params:
            n = self.params[i].shape[0]  # the hook views each gradient as (rows, rest)
            m = self.params[i].numel() // n
            r = min(n, m, self.state.matrix_approximation_rank)
            # PowerSGDState's rule: compressed when that shrinks it more than min_compression_rate.
            if (n + m) * r * self.state.min_compression_rate < n * m:
                by_shape[(n, m)].append((i, n, r))
        return [matrix for matrices in by_shape.values() for matrix in matrices]

    def _per_parameter(self) -> dict[int, dict[str, torch.Tensor]]:
        """The state of every bucket cut into the parameters' pieces."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for key, params in self.layout.items():
            error, q, offset = self.state.error_dict.get(key), self.state.q_memory_dict.get(key), 0
            for i in params:
                n = self.params[i].numel()
                out[i] = {} if error is None else {"error": error[offset:offset + n].clone()}
                offset += n
            offset = 0
            for i, rows, r in self._shapes(params):
                cols = self.params[i].numel() // rows * r
                if q is not None:
                    out[i]["q"] = q[offset:offset + cols].clone()
                offset += cols
        return out

    def _materialize(self, key: int, params: tuple[int, ...], buffer: torch.Tensor) -> None:
        pieces = {i: self.pending.pop(i) for i in params}  # each parameter's, now the bucket's
        if all("error" in piece for piece in pieces.values()):
            self.state.error_dict[key] = torch.cat(
                [piece["error"] for piece in pieces.values()]).to(buffer.device, buffer.dtype)
        shapes = self._shapes(params)
        if shapes and all("q" in pieces[i] for i, _, _ in shapes):
            self.state.q_memory_dict[key] = torch.cat(
                [pieces[i]["q"] for i, _, _ in shapes]).to(buffer.device, buffer.dtype)
            # P is only written into (from the gradient and Q): its size is what matters.
            self.state.p_memory_dict[key] = torch.empty(sum(rows * r for _, rows, r in shapes),
                                                        device=buffer.device, dtype=buffer.dtype)

    def state_dict(self, comm_device: torch.device) -> dict[str, Any] | None:
        """Every rank's state on rank 0 (a collective), as tensors and plain types; None elsewhere.
        Error feedback is per rank: a checkpoint holds world size x the gradients."""
        pieces = {**self.pending, **self._per_parameter()}
        names = sorted((i, kind) for i, piece in pieces.items() for kind in piece)
        mine = (torch.cat([pieces[i][kind] for i, kind in names]).to(comm_device) if names
                else torch.zeros(0, device=comm_device))
        main = dist.get_rank() == 0
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())] if main else None
        if names:  # the same on every rank: the same buckets
            dist.gather(mine, gathered, dst=0)
        if not main:
            return None
        _, keys, pos, has_gauss, gauss = self.state.rng.get_state()
        return {"iter": self.state.iter, "rank": self.state.matrix_approximation_rank,
                "layout": [[key, list(params)] for key, params in sorted(self.layout.items())],
                "rng": [torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                        float(gauss)],
                "pieces": [[i, kind, pieces[i][kind].numel()] for i, kind in names],
                "values": torch.stack([g.cpu() for g in gathered])}

    def load_state_dict(self, saved: dict[str, Any], rank: int, world_size: int) -> str | None:
        """This rank's part of a checkpoint's state; a note where some is unusable: another world
        size (other ranks' error feedback) or --powersgd-rank (factors of another shape)."""
        if saved["values"].shape[0] != world_size:
            return (f"PowerSGD starts afresh: the checkpoint's state is of "
                    f"{saved['values'].shape[0]} processes")
        import numpy as np
        keys, pos, has_gauss, gauss = saved["rng"]
        self.state.rng.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        self.state.iter = saved["iter"]
        same_rank = saved["rank"] == self.state.matrix_approximation_rank
        values, offset, self.pending = saved["values"][rank], 0, {}
        for i, kind, n in saved["pieces"]:
            if kind == "error" or same_rank:
                self.pending.setdefault(i, {})[kind] = values[offset:offset + n].clone()
            offset += n
        # Emulating the saved buckets needs every piece of them; with new factors, not.
        self.saved_layout = ({key: tuple(params) for key, params in saved["layout"]}
                             if same_rank else {})
        for kept in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict,
                     self.layout, self.owner):
            kept.clear()
        self._steps_checked = 0
        return None if same_rank else ("PowerSGD keeps its error feedback and starts new factors: "
                                       f"the checkpoint used --powersgd-rank {saved['rank']}")


def saved_bucket(index: int, count: int, grads: list[torch.Tensor]) -> SimpleNamespace:
    """Bucket `index` of `count` of an earlier DDP, as PowerSGD reads one (the GradBucket methods
    it calls): its gradients in one buffer."""
    buffer = torch.cat([g.reshape(-1) for g in grads])
    views = [part.view_as(g) for part, g in
             zip(buffer.split([g.numel() for g in grads]), grads, strict=True)]
    return SimpleNamespace(index=lambda: index, is_last=lambda: index == count - 1,
                           buffer=lambda: buffer, gradients=lambda: views)
