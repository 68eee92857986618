"""The Checkpointer: when to save, what a checkpoint holds, and resuming from one.

It decides its own cadence, as torchtitan's checkpointer does: every --save-every epochs at an
epoch's end, every --save-every-steps steps, the step of a new best evaluation (--keep-best), and
the last step of the run. Every rank's random state goes into a checkpoint; rank 0 writes the file
(fsdp: every rank writes its shards), and every rank learns whether that worked before going on."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import SHARDED, Config
from ..ema import local_part
from ..failures import ProjectError, RunFailure, UsageError, agree
from ..optim import Optimization
from ..runtime.comm_hooks import PowerSGD
from ..runtime.environments import World
from ..runtime.lifeline import Lifeline
from . import resume, storage
from .files import checkpoint_path, saved_weights
from .folder import CheckpointDir, Staging


class Checkpointer:
    """Saves and resumes one run. `loop_state`, passed to each save, gives the loop's part of a
    checkpoint; it is not kept (holding the Trainer, and its data workers, can hang the exit)."""

    def __init__(self, cfg: Config, world: World, model: nn.Module, optim: Optimization,
                 device: torch.device, comm_device: torch.device, lifeline: Lifeline,
                 comm_hook: PowerSGD | None = None) -> None:
        self.cfg, self.world, self.model, self.optim = cfg, world, model, optim  # model: unwrapped
        self.device, self.comm_device = device, comm_device
        self.lifeline, self.comm_hook = lifeline, comm_hook
        self.ckpt_dir = (CheckpointDir(cfg.checkpoint_dir, cfg.keep_last, cfg.timeout_s)
                         if world.is_main else None)
        self.dcp = None
        if cfg.model_layout in SHARDED:  # torch.distributed.checkpoint: imported where it is used
            from . import sharded
            self.dcp = sharded.ShardedCheckpoints(self.ckpt_dir, cfg.checkpoint_dir,
                                                  cfg.async_save, comm_device)
        self.staging = Staging() if cfg.async_save else None
        self.keep_next = False  # the next save is --keep-best's best so far: never pruned
        self.resumed_from: str | None = None
        self.saved_step = -1
        self._set_aside = False  # other runs' checkpoints moved out of the folder yet?
        self._stalls_ms: list[float] = []  # how long training stood still for each save

    # ---------------------------------------------------------------- when
    def maybe_save(self, step: int, loop_state: Callable[[], dict[str, Any]],
                   last_of_epoch: bool = False, epoch_end: int | None = None,
                   last: bool = False) -> None:
        """Save if one is due: every --save-every-steps, except at an epoch's last step (its end
        comes next); at the end of epoch `epoch_end` (from 1), every --save-every epochs; `last`:
        unless saved already. A new best evaluation (`keep_next`) is saved at the next of these."""
        if last:
            due = step != self.saved_step
        elif epoch_end is not None:
            due = self.keep_next or (self.cfg.save_every and epoch_end % self.cfg.save_every == 0)
        else:
            due = self.keep_next or (self.cfg.save_every_steps > 0 and not last_of_epoch
                                     and step % self.cfg.save_every_steps == 0)
        if due:
            self.save(step, loop_state())

    # ---------------------------------------------------------------- saving
    def save(self, step: int, loop_state: dict[str, Any]) -> None:
        """Save step `step` now (every rank)."""
        started = time.perf_counter()
        if self.keep_next:  # this step's evaluation is the best so far
            self.keep_next = False
            if self.ckpt_dir is not None:
                self.ckpt_dir.keep_step = step  # beside the newest, never pruned
        rng = resume.gather_rng_states(self.device, self.comm_device)
        meta = {**loop_state, "world_size": self.world.world_size,
                "batch_size": self.cfg.batch_size, "grad_accum": self.cfg.grad_accum,
                "optim": self.optim.state_dict(), "config": self.cfg.to_dict()}
        if self.dcp is not None:
            ema, meta["has_ema"] = self.optim.ema, self.optim.ema is not None
            self.dcp.save(self.model, self.optim.optimizers, rng, meta, step, self._prepare_folder,
                          ema and {"ema": ema.state_dict()})
        else:
            if self.comm_hook is not None:  # every rank's part: a collective
                meta["comm_hook"] = self.comm_hook.state_dict(self.comm_device)
            agree(lambda: self._write_file(rng, meta, step), self.comm_device)
        self.saved_step = step
        self._stalls_ms.append(1000 * (time.perf_counter() - started))

    def _write_file(self, rng: torch.Tensor, meta: dict[str, Any], step: int) -> None:
        self._prepare_folder()
        state = {"model": saved_weights(self.model), "rng": rng, **meta,
                 "optimizer": self.optim.optimizers.state_dict()}
        if self.optim.ema is not None:
            state["ema"] = self.optim.ema.state_dict()
        if self.staging is None:
            self.ckpt_dir.save_file(state, step)
        else:
            self.ckpt_dir.save_file_in_background(state, step, self.staging)

    def _prepare_folder(self) -> None:
        """Rank 0, before this run's first save: other runs' checkpoints move aside."""
        if not self._set_aside:
            if moved := self.ckpt_dir.set_aside(storage.location(self.resumed_from)
                                                if self.resumed_from else None):
                print(f"note: moved checkpoints of another run (or later than the one resumed) "
                      f"to {moved}", flush=True)
            self._set_aside = True

    def finish(self) -> None:
        """Wait for a background save (and learn its outcome) before the process ends."""
        if self.dcp is not None:
            self.dcp.finish()
        elif self.cfg.async_save:
            agree(lambda: self.ckpt_dir.wait(), self.comm_device)

    def close(self) -> None:
        if self.ckpt_dir is not None:
            self.ckpt_dir.close()

    def newest_good(self) -> str:
        """The newest checkpoint of this run, as an error line names it."""
        if self.saved_step < 0:
            return "no checkpoint was saved yet"
        newest = checkpoint_path(self.cfg.checkpoint_dir, self.saved_step,
                                 sharded=self.dcp is not None)
        return f"the newest good checkpoint is {newest}"

    def summary(self) -> dict[str, Any]:
        """The checkpoints' part of summary.json."""
        stalls = sorted(self._stalls_ms)
        return {"checkpoint_stall_ms": round(stalls[len(stalls) // 2], 1) if stalls else None,
                "checkpoint_stall_ms_max": round(stalls[-1], 1) if stalls else None,
                "checkpoint_saves": len(stalls), "async_save": self.cfg.async_save,
                "resumed_from": self.resumed_from,
                "checkpoint_dir": str(storage.location(self.cfg.checkpoint_dir))}

    # ---------------------------------------------------------------- resuming
    def resume(self, batches_per_epoch: int, data: dict[str, Any]) -> dict[str, Any] | None:
        """Apply --resume: rank 0 chooses, every rank loads. Returns the checkpoint's metadata
        with `position`, the (epoch, batch, step) to go on from; None: nothing to resume. `data`:
        the training set's summary (its tokenizer and shuffle window, checked)."""
        with self.lifeline.waiting("rank 0 to open --checkpoint-dir and choose a checkpoint",
                                   "check that rank 0 is alive and its storage answers",
                                   phase="checkpoint I/O"):
            choice = agree(self._open_and_pick, self.comm_device)
        if choice is None:
            return None
        path, fresh = storage.location(choice), self.cfg.resume == "weights-only"
        meta = self._load(path, fresh)
        self._refuse_nonfinite(path, meta["step"])
        if fresh:  # a new run from these weights: its own position, and the folder's
            if self.world.is_main:
                print(f"--resume weights-only: the weights of {path}; the optimizers, their "
                      "schedules and the position start afresh", flush=True)
            return None
        epoch, batch, step = resume.restore_position(meta, self.cfg, self.world.world_size,
                                                     batches_per_epoch, path, self.world.is_main,
                                                     data)
        self.resumed_from, self.saved_step = str(path), step
        for saver in filter(None, (self.ckpt_dir, self.dcp)):  # what an error names as newest
            saver.saved = path
        retention = resume.keep_retention(self.cfg, meta.get("config", {}))  # every rank: same cfg
        if self.ckpt_dir is not None:
            self.ckpt_dir.keep_last = self.cfg.keep_last
            self.ckpt_dir.keep_step = (meta.get("selection") or {}).get("best", {}).get("step")
        if self.world.is_main:
            print(f"resumed from {path} (epoch {epoch}, batch {batch}, step {step})", flush=True)
            if changed := resume.config_differences(meta.get("config", {}), self.cfg.to_dict()):
                print(f"note: settings that differ from the checkpoint's run: {'; '.join(changed)}",
                      flush=True)
            for note in retention:
                print(f"note: {note}", flush=True)
        return {**meta, "position": (epoch, batch, step)}

    def _refuse_nonfinite(self, path: storage.AnyPath, step: int) -> None:
        """Weights with nan or inf (a checkpoint of an older version, or copied in) are not
        trained on: one line naming the newest finite checkpoint before it (rank 0 looks)."""
        bad = sum((~local_part(p).isfinite()).sum().to(self.comm_device)
                  for p in self.model.parameters())
        dist.all_reduce(bad)
        if bad.item():
            def refuse() -> None:
                raise UsageError(f"checkpoint {path} holds nan or inf weights (its run diverged); "
                                 f"{resume.newest_finite(self.cfg.checkpoint_dir, step)}")
            agree(refuse, self.comm_device)

    def _open_and_pick(self) -> str | None:
        self.ckpt_dir.open()
        # The saved weights and AdamW's two moments of the trained ones, 4 bytes each: what one
        # checkpoint needs on disk.
        saved = sum(t.numel() for t in saved_weights(self.model).values())
        moments = 2 * sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.ckpt_dir.check_space(4 * (saved + moments))
        path = resume.pick_checkpoint(self.cfg.resume, self.cfg.checkpoint_dir)
        return None if path is None else str(path)

    def _load(self, path: storage.AnyPath, weights_only: bool) -> dict[str, Any]:
        """Every rank: the checkpoint into the model, EMA and (unless `weights_only`) the rest."""
        note = None
        try:  # a failure here fails again at every restart: `everywhere`, so there is none
            meta = resume.load_into(path, self.model, self.optim, self.world.world_size,
                                    self.world.rank, self.cfg.batch_size, self.device, weights_only)
            if not weights_only:
                self.optim.load_state_dict(meta["optim"])
                if self.comm_hook is not None and meta.get("comm_hook") is not None:
                    note = self.comm_hook.load_state_dict(meta["comm_hook"], self.world.rank,
                                                          self.world.world_size)
        except ProjectError:
            raise
        except Exception as exc:  # its metadata read, but not all loads
            raise RunFailure(f"cannot load checkpoint {path} ({type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc) else ''}); use "
                             "--resume with an older one, --resume weights-only, or --resume "
                             "never", everywhere=True) from exc
        if note and self.world.is_main:
            print(f"note: {note}", flush=True)
        return meta
