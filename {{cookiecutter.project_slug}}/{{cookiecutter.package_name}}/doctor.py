"""Preflight check, and the first thing to run when a job hangs.

    python -m {{ cookiecutter.package_name }}.doctor                                   # this machine, one process
    torchrun --standalone --nproc-per-node=2 -m {{ cookiecutter.package_name }}.doctor  # the real world
    srun python -m {{ cookiecutter.package_name }}.doctor                              # under SLURM
    python -m {{ cookiecutter.package_name }}.doctor --plan --world-size 64 --gpu-memory-gb 80   # will it fit?

Each process prints what it sees (launcher, ranks, backend, devices, GPUs, rendezvous, variables,
versions) and known traps, then all do an all_reduce, a barrier and a bandwidth measurement with a
short timeout: exit 0 and `OK`, or 1 and a `FAIL:` line that says what to fix. Same flags as
train.py. --plan starts no process group: it prints what the run needs on each GPU at --world-size
processes, per layout, and every setting that is wrong at that size (plan.py)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout, suppress
from functools import partial

import torch
import torch.distributed as dist

from . import task
from .checkpoint import storage
from .checkpoint.resume import check_resumable, pick_checkpoint
from .config import Config, parse_args
from .failures import ProjectError, RunFailure, UsageError, is_communication_failure, report_error
from .main import load_datasets
from .plan import plan
from .runtime.environments import World, resolve_world
from .runtime.launch import Setup, joined, resolve
from .runtime.rendezvous import collective_device, resolve_backend
from .settings import Parser, build_parser, number

ENV_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_",
                "TORCHELASTIC_", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID",
                "SLURM_JOB_NODELIST", "SLURM_STEP_", "CUDA_VISIBLE_DEVICES", "NCCL_", "TORCH_NCCL_",
                "GLOO_", "USE_LIBUV", "OMP_NUM_THREADS", "PET_")
SHM_WARN_MB = 1024


def versions() -> str:
    nccl = (".".join(map(str, torch.cuda.nccl.version()))
            if torch.cuda.is_available() and dist.is_nccl_available() else "none")
    return (f"python {platform.python_version()}, torch {torch.__version__}, cuda "
            f"{torch.version.cuda}, nccl {nccl}, gloo {'yes' if dist.is_gloo_available() else 'no'}"
            f", {platform.system()}")


def gpus() -> list[str]:
    """One line per visible GPU: name, memory, compute capability, peer access to the others."""
    lines = []
    count = torch.cuda.device_count()
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        peers = [j for j in range(count) if j != i and torch.cuda.can_device_access_peer(i, j)]
        lines.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability "
                     f"{p.major}.{p.minor}, peer access (P2P/NVLink) to "
                     f"{', '.join(f'cuda:{j}' for j in peers) if peers else 'none'}")
    return lines


def processes_per_node(cuda_count: int, layout: str) -> int:
    """Processes train_local.sh starts here: one per GPU (per 2 with model_parallel_2), 2 on CPU."""
    if cuda_count == 0:
        return 2
    return max(1, cuda_count // 2) if layout == "model_parallel_2" else cuda_count


def preflight(argv: list[str], caller: str) -> str:
    """scripts/train_*.sh, before torchrun starts: the flags (read in `caller`), the data and the
    checkpoint to resume, so a mistake is one line, not one per process and restart. Returns the
    processes this node takes, then the flags for them (in the project's folder), for the shell."""
    project = os.getcwd()
    os.chdir(caller)
    cfg = parse_args(argv, getattr(task, "Settings", None), warn=False)  # the run warns
    argv = argv + absolute_paths(cfg)
    os.chdir(project)
    where = cfg.checkpoint_dir if cfg.resume in ("auto", "weights-only") else cfg.resume
    try:
        with open(os.devnull, "w") as null, redirect_stdout(null), redirect_stderr(null):
            load_datasets(cfg)  # (its notes are the run's to print)
            # A checkpoint in a bucket is left to rank 0: it would be downloaded twice.
            path = None if storage.is_url(where) else pick_checkpoint(cfg.resume, where)
            if path is not None:
                check_resumable(cfg, path, task)
    except ProjectError as exc:
        report_error(exc, 0)
        sys.exit(1)
    except Exception:  # e.g. a task.py that needs the process group: the processes will say
        pass
    return shlex.join([str(processes_per_node(torch.cuda.device_count(), cfg.model_layout)), *argv])


def absolute_paths(cfg: Config) -> list[str]:
    """Flags (and `cfg`) with each relative path given made absolute: *_dir settings, PATH
    metavars and --init-method's store file (./rdzv/store, as rendezvous.py tells it from a word
    or URL), but not a metavar's words (--resume auto) nor URLs."""
    flags = []
    for settings, prefix in ((cfg, ""), (cfg.task, "task.")):
        for f in dataclasses.fields(settings):
            metavar = f.metadata.get("flag", {}).get("metavar", "")
            value = getattr(settings, f.name)
            is_path = "PATH" in metavar or f.name.endswith("_dir") or f.name == "init_method" and (
                "://" not in value and ("/" in value or os.sep in value or value.startswith(".")))
            if (is_path and prefix + f.name in cfg.given and value
                    and value not in metavar.strip("{}").split(",") and not storage.is_url(value)):
                setattr(settings, f.name, os.path.abspath(value))
                flags += [f"--{f.name.replace('_', '-')}", getattr(settings, f.name)]
    return flags


def traps(world: World, cuda_count: int, backend: str) -> list[str]:
    """Known ways a job breaks, found in this process's surroundings."""
    found = []
    if backend == "nccl" and world.local_world_size > cuda_count:
        found.append(f"{world.local_world_size} processes on this node but {cuda_count} visible "
                     "GPU(s): NCCL refuses two ranks on one GPU; start one process per GPU")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and cuda_count and sum(map(bool, visible.split(","))) != cuda_count:
        found.append(f"CUDA_VISIBLE_DEVICES={visible} names {len(visible.split(','))} device(s) "
                     f"but {cuda_count} are visible: some ids do not exist on this machine")
    if os.path.isdir("/dev/shm"):
        free_mb = shutil.disk_usage("/dev/shm").free / 2**20
        if free_mb < SHM_WARN_MB:
            found.append(f"/dev/shm has {free_mb:.0f} MB free: DataLoader workers pass batches "
                         "through it (containers default to 64 MB; raise it, e.g. docker "
                         "--shm-size=8g, or train with --num-workers 0)")
    return found


def network(world: World, description: str) -> list[str]:
    """This rank's interface to the head node (`description`: training's choice), and a warning
    where a job of several machines runs on a host whose name resolves to loopback."""
    lines = [f"network: {description or 'loopback or default (one machine)'}"]
    hostname, resolved = socket.gethostname(), ""
    with suppress(OSError):
        resolved = socket.gethostbyname(hostname)
    if world.world_size > world.local_world_size and resolved.startswith("127."):
        lines.append(f"WARNING: host name {hostname} resolves to {resolved}, which other machines "
                     f"cannot reach; the job uses {description or 'no interface of its own'} "
                     "instead (set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to override)")
    return lines


def bandwidth_gb_s(device: torch.device, megabytes: int) -> float:
    """all_reduce bus bandwidth (as nccl-tests reports it): bytes x 2(n-1)/n per second."""
    data = torch.ones(megabytes * 2**20 // 4, device=device)
    for rounds in (1, 5):  # a warm-up, then the rounds measured
        start = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(data)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / rounds
    n = dist.get_world_size()
    return data.numel() * 4 * (2 * (n - 1) / n if n > 1 else 1) / seconds / 1e9


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--plan: before renting machines (starts no process group)")
    g.add_argument("--plan", action="store_true",
                   help="print per layout the memory on each GPU of this run at --world-size "
                        "processes, and every setting that is wrong at that size; exit 0 when "
                        "--model-layout fits and nothing is wrong, else 1")
    g.add_argument("--world-size", type=number("int", 1), default=None, metavar="N",
                   help="--plan: the run's number of processes")
    g.add_argument("--gpu-memory-gb", type=number("float", 0, above=True), default=80.0,
                   metavar="GB", help="--plan: memory of each GPU (80: an 80 GB A100 or H100)")
    g.add_argument("--nproc-per-node", type=number("int", 1), default=8, metavar="N",
                   help="--plan: processes per node (fsdp's --shard-group-size 0 takes a node)")


def check(argv: list[str] | None = None) -> int:
    parser = build_parser(Config, getattr(task, "Settings", None))  # the same flags as train.py
    parser.help_command = f"python -m {__package__}.doctor --help"
    parser.description = ("Preflight: what each process sees, then an all_reduce and a barrier; "
                          "with --plan, whether the run fits at --world-size processes.")
    parser.epilog = ("Exit codes: 0 OK; 1 a check failed (the FAIL: line says what to fix), or "
                     "with --plan: --model-layout does not fit or a setting is wrong at "
                     "--world-size; 2 a bad flag.")
    add_plan_flags(parser)
    parser.set_defaults(timeout_s=30.0)  # a preflight should fail fast
    cfg = parser.parse_args(argv)
    if cfg.plan or cfg.world_size is not None:
        if not cfg.plan:
            parser.fail("--world-size goes with --plan (python -m "
                        f"{__package__}.doctor --plan --world-size N)")
        if cfg.world_size is None:
            parser.fail("--plan needs --world-size N, the number of processes of the run to plan")
        # The other flags, without --plan's, parsed as train.py parses them (plan.py).
        plan_flags = Parser(add_help=False, allow_abbrev=False)
        add_plan_flags(plan_flags)
        rest = plan_flags.parse_known_args(sys.argv[1:] if argv is None else argv)[1]
        return plan(parse_args(rest, getattr(task, "Settings", None)), cfg.world_size,
                    cfg.gpu_memory_gb, cfg.nproc_per_node)
    world, say = describe(cfg)
    setup = resolve(cfg, world)
    cuda_count = torch.cuda.device_count()
    say(f"backend {setup.backend}, devices {', '.join(map(str, setup.devices))}, visible GPUs "
        f"{cuda_count}, rendezvous {setup.rdzv}")
    say(f"this machine takes {processes_per_node(cuda_count, cfg.model_layout)} process(es) "
        f"({'one per GPU' if cuda_count else 'no GPU: CPU processes over gloo'}): "
        "scripts/train_local.sh starts that many")
    for line in network(world, setup.network):
        say(line)
    speed = meet(cfg, world, setup)
    say(f"all_reduce bandwidth over {setup.backend}: {speed:.2f} GB/s")
    say(f"OK: all_reduce and barrier across {world.world_size} process(es) over {setup.backend}")
    return 0


def describe(cfg: argparse.Namespace) -> tuple[World, Callable[[str], None]]:
    """Print what this process sees (versions, launcher variables, world) before the world is
    checked, then its GPUs and traps. Returns the world and a `say` with this rank's tag."""
    seen = resolve_world(local_rank_flag=cfg.local_rank, check=False)
    say = partial(print, f"[doctor rank {seen.rank}/{seen.world_size}]", flush=True)
    say(versions())
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    say(f"environment: {env or 'no launcher variables'}")
    say(f"resolved: launcher {seen.launcher}, rank {seen.rank}, local rank {seen.local_rank}/"
        f"{seen.local_world_size}, world {seen.world_size}, master {seen.master_addr}:"
        f"{seen.master_port}")
    resolve_world(local_rank_flag=cfg.local_rank)  # now with the consistency checks
    cuda_count = torch.cuda.device_count()
    for line in gpus():
        say(line)
    for trap in traps(seen, cuda_count, resolve_backend(cfg.backend, cuda_count,
                                                        dist.is_nccl_available())):
        say(f"WARNING: {trap}")
    return seen, say


def meet(cfg: argparse.Namespace, world: World, setup: Setup) -> float:
    """Join the group as training does, then an all_reduce that checks the ranks, a bandwidth
    measurement and a barrier; returns the bandwidth in GB/s."""
    try:
        with joined(cfg, world, setup):
            device = collective_device(setup.backend, setup.devices[0])
            value = torch.tensor([float(world.rank + 1)], device=device)
            dist.all_reduce(value)
            expected = world.world_size * (world.world_size + 1) / 2
            if value.item() != expected:
                raise UsageError(f"all_reduce gave {value.item()}, expected {expected}: the "
                                 "ranks disagree on who is who; check that every process got its "
                                 "own RANK")
            speed = bandwidth_gb_s(device, 64 if device.type == "cuda" else 16)
            dist.barrier()
    except RuntimeError as exc:
        if not is_communication_failure(exc):
            raise
        raise RunFailure(
            f"the {world.world_size} processes could not all meet within --timeout-s="
            f"{cfg.timeout_s:g} ({str(exc).strip().splitlines()[0]}). Check that exactly "
            f"WORLD_SIZE={world.world_size} processes were started, that {world.master_addr}:"
            f"{world.master_port} is reachable from every node (firewall, MASTER_ADDR set to a "
            "name others can resolve), and that no other job uses that port") from None
    return speed


def main(argv: list[str] | None = None) -> int:
    try:
        return check(argv)
    except ProjectError as exc:
        sys.stderr.write(f"FAIL: {exc}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
