"""Preflight check, and the first thing to run when a job hangs.

    python -m {{ cookiecutter.package_name }}.doctor                                   # this machine, one process
    torchrun --standalone --nproc-per-node=2 -m {{ cookiecutter.package_name }}.doctor  # the real world
    srun python -m {{ cookiecutter.package_name }}.doctor                              # under SLURM

Each process prints what it sees (launcher, ranks, backend, devices, rendezvous, relevant variables,
versions), then all of them do an all_reduce and a barrier with a short timeout. Exit 0 and `OK`, or
exit 1 and a `FAIL:` line that says what to fix. It accepts the same flags as train.py.
"""

from __future__ import annotations

import os
import platform
import sys

import torch
import torch.distributed as dist

from .config import build_parser
from .distributed import (
    SetupError,
    assign_devices,
    cleanup,
    ddp_setup,
    is_communication_failure,
    resolve_backend,
    resolve_init_method,
    resolve_world,
)
from .train import rendezvous_dir

ENV_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_", "TORCHELASTIC_",
                "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_JOB_NODELIST",
                "SLURM_STEP_ID", "CUDA_VISIBLE_DEVICES", "NCCL_", "GLOO_", "USE_LIBUV", "OMP_NUM_THREADS")


def versions() -> str:
    nccl = "none"
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return (f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}, "
            f"nccl {nccl}, gloo {'yes' if dist.is_gloo_available() else 'no'}, {platform.system()}")


def check(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.set_defaults(timeout_s=30.0)  # a preflight should fail fast
    cfg = parser.parse_args(argv)
    world = resolve_world(local_rank_flag=cfg.local_rank)
    tag = f"[doctor rank {world.rank}/{world.world_size}]"
    print(f"{tag} {versions()}", flush=True)
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    print(f"{tag} environment: {env or 'no launcher variables'}", flush=True)
    cuda_count = torch.cuda.device_count()
    backend = resolve_backend(cfg.backend, cuda_count, dist.is_nccl_available())
    devices = assign_devices(world.local_rank, world.local_world_size, cuda_count, cfg.model_layout,
                             cfg.stage_devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    url = resolve_init_method(cfg.init_method, world, rendezvous_dir(cfg))
    print(f"{tag} launcher {world.launcher}, local rank {world.local_rank}/{world.local_world_size}, "
          f"backend {backend}, devices {', '.join(map(str, devices))}, visible GPUs {cuda_count}, "
          f"init {url}, master {world.master_addr}:{world.master_port}", flush=True)
    try:
        ddp_setup(world, backend, cfg.init_method, cfg.timeout_s, devices, rendezvous_dir(cfg))
        value = torch.tensor([float(world.rank + 1)], device=devices[0])
        dist.all_reduce(value)
        expected = world.world_size * (world.world_size + 1) / 2
        if value.item() != expected:
            raise SetupError(f"all_reduce gave {value.item()}, expected {expected}: the ranks disagree on who "
                             "is who; check that every process got a different RANK")
        dist.barrier()
    except RuntimeError as exc:
        if not is_communication_failure(exc):
            raise
        raise SetupError(
            f"the {world.world_size} processes could not all meet within --timeout-s={cfg.timeout_s:g} "
            f"({str(exc).strip().splitlines()[0]}). Check that exactly WORLD_SIZE={world.world_size} processes "
            f"were started, that {world.master_addr}:{world.master_port} is reachable from every node "
            "(firewall, MASTER_ADDR set to a name others can resolve), and that no other job uses that port"
        ) from None
    finally:
        cleanup()
    print(f"{tag} OK: all_reduce and barrier across {world.world_size} process(es) over {backend}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return check(argv)
    except SetupError as exc:
        sys.stderr.write(f"FAIL: {exc}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
