"""Data-loader worker processes (`--num-workers N`): the DataLoader that runs data.py's fetcher in
them, their start from a forkserver, and the launcher's stop signals held away from them."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from multiprocessing import forkserver, resource_tracker
from typing import Any

import torch
from torch.utils.data import DataLoader

# Stop signals a launcher sends to every process of the job (torchrun and `docker stop` to the
# process group, SLURM to each process of the step) are meant for the training process, which saves
# at its next log step: a data worker, or the forkserver that starts them, ended by one would take
# the batches that step needs with it. Blocked, not ignored: they wait in the kernel; SIGKILL works.
WORKER_BLOCKED = {getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name)}


def worker_loader(fetcher: Any, batches: Any, num_workers: int, pin_memory: bool) -> DataLoader:
    """`fetcher`'s batches, one per item of `batches`, by `num_workers` persistent processes."""
    # A generator of its own: DataLoader draws its workers' base seed from it whenever an iterator
    # starts, else from the global RNG, which dropout would then see differ in a resumed run (its
    # iterator starts at another step). Workers are seeded per batch (data.py), not by this seed.
    return DataLoader(fetcher, batch_sampler=batches, collate_fn=_as_is,
                      num_workers=num_workers, pin_memory=pin_memory, persistent_workers=True,
                      worker_init_fn=worker_init, multiprocessing_context=worker_context(),
                      generator=torch.Generator())


def _as_is(batch: Any) -> Any:
    return batch  # the fetcher already collated (a module-level function: workers pickle it)


def worker_init(worker_id: int) -> None:
    # Workers leave stop signals to the training process, which shuts them down itself.
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # not on Windows, where nothing signals a group
        signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_BLOCKED)
    # A forkserver child inherits the write end of the pipe by which the forkserver learns that
    # the training process is gone: holding it, the workers and the forkserver (their parent) kept
    # each other alive after a SIGKILL of the training process, holding the job's stdout open
    # forever. Closed, the forkserver exits with the training process, and the workers follow.
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def worker_context() -> Any:
    """The forkserver start method (None on Windows, which spawns), its server started now.

    Not a fork of the training process: its gloo and NCCL threads can hold an interpreter lock at
    the moment of a fork, and the worker then waits for it forever (a run that hangs at its first
    batch, now and then). So the data set and `collate` must be picklable (as with spawn on macOS
    and Windows), and a script that starts training needs `if __name__ == "__main__":`. Started
    at launch, the server's import of torch (1-2 s) overlaps joining the peers and building the
    data and the model, instead of holding up the first batch."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    multiprocessing.set_forkserver_preload(["torch"])  # workers start with torch imported
    # The server inherits the blocked stop signals across its exec, and its workers from it: a
    # SIGTERM that reaches it before a worker's worker_init runs is held too. Here they wait
    # only for as long as the server takes to start, then are delivered. The resource tracker
    # too, which the server needs: starting it unblocks SIGTERM, hence the block before each.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_BLOCKED)
    try:
        for server in (resource_tracker, forkserver):
            signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_BLOCKED)
            server.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return multiprocessing.get_context("forkserver")
