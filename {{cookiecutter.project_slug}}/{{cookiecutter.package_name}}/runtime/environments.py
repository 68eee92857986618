"""Who am I in the job? One small class per launcher turns its environment variables into a World.

`resolve_world` asks each class in ENVIRONMENTS, in order, whether it recognises the environment;
for another cluster, add a class with `detect` and `world` (see `Environment`) to the tuple."""

from __future__ import annotations

import os
import re
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ..failures import UsageError


@dataclass(frozen=True)
class World:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launcher: str
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    run_id: str = ""  # differs between launches (and restarts): names per-launch files

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class Environment(Protocol):
    @staticmethod
    def detect(env: Mapping[str, str]) -> bool: ...

    @staticmethod
    def world(env: Mapping[str, str], local_rank_flag: int | None, check: bool = True) -> World: ...


def _int_var(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise UsageError(f"environment variable {name} is not set; start the job with its "
                         "launcher") from None
    except ValueError:
        raise UsageError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _check_ranks(rank: int, local_rank: int, world_size: int, source: str) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"{source}: rank {rank} is outside a world of {world_size} processes; "
                         "check the process counts given to the launcher")
    if local_rank < 0:
        raise UsageError(f"{source}: local rank {local_rank} is negative")


def find_free_port(host: str = "127.0.0.1") -> int:
    """A free port (the OS picks it), so two jobs on one machine don't collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TorchrunEnvironment:
    """torchrun, `python -m torch.distributed.launch`, or anything exporting RANK and WORLD_SIZE."""

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "RANK" in env and "WORLD_SIZE" in env

    @staticmethod
    def world(env: Mapping[str, str], local_rank_flag: int | None, check: bool = True) -> World:
        rank, world_size = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
        # The legacy launcher passes --local-rank unless --use-env is given; the variable wins.
        if "LOCAL_RANK" in env:
            local_rank = _int_var(env, "LOCAL_RANK")
        elif local_rank_flag is not None:
            local_rank = local_rank_flag
        else:
            raise UsageError(f"RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} are set in "
                             "the environment but LOCAL_RANK is not, so no launcher started this "
                             "process; unset RANK and WORLD_SIZE to train in one process, or "
                             "start it with torchrun, which sets all three")
        if check and "TORCHELASTIC_RUN_ID" not in env and not 0 <= rank < world_size:
            raise UsageError(f"RANK={rank} is outside a world of WORLD_SIZE={world_size} "
                             "processes, and no launcher set them (TORCHELASTIC_RUN_ID is unset): "
                             f"set RANK from 0 to {world_size - 1}, or unset RANK, WORLD_SIZE and "
                             "LOCAL_RANK to train in one process")
        if check:
            _check_ranks(rank, local_rank, world_size, "torchrun")
        local_world_size = (_int_var(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env
                            else world_size)
        # A fixed torchrun --rdzv-id repeats across launches; the restart count and the port do not.
        run_id = "-".join(env.get(name, "0") for name in
                          ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT"))
        return World(rank, local_rank, world_size, local_world_size,
                     "launch" if local_rank_flag is not None else "torchrun",
                     env.get("MASTER_ADDR", "127.0.0.1"),
                     _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else None, run_id)


class KubeflowEnvironment:
    """A Kubeflow PyTorchJob pod running `python train.py` itself (no torchrun in the pod): the
    operator sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE (pods) and RANK (this pod), no LOCAL_RANK.
    With torchrun in the pod
    {%- if cookiecutter.kubernetes %} (what k8s/ does){% endif %}, TorchrunEnvironment applies."""

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return ("KUBERNETES_SERVICE_HOST" in env and "RANK" in env and "WORLD_SIZE" in env
                and "LOCAL_RANK" not in env and "TORCHELASTIC_RUN_ID" not in env)

    @staticmethod
    def world(env: Mapping[str, str], local_rank_flag: int | None, check: bool = True) -> World:
        rank, world_size = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
        if check:
            _check_ranks(rank, 0, world_size, "PyTorchJob (RANK/WORLD_SIZE)")
        return World(rank, 0, world_size, 1, "kubeflow", env.get("MASTER_ADDR", "127.0.0.1"),
                     _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
                     f"kubeflow-{env.get('MASTER_ADDR', '')}-{env.get('HOSTNAME', '')}")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list: 'node[01-03,07],gpu1' -> node01 node02 node03 node07 gpu1."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):  # commas outside brackets
        if not (match := re.match(r"^(.*?)\[([^\]]*)\](.*)$", item)):
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for number in [f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1)] if hi else [lo]:
                hosts.extend(expand_nodelist(f"{prefix}{number}{suffix}"))
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed task counts: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        count, _, repeat = part.partition("(x")
        counts.extend([int(count)] * (int(repeat.rstrip(")")) if repeat else 1))
    return counts


class SlurmEnvironment:
    """`srun python train.py`, one task per device. Counts come from the job *step* (SLURM_STEP_*)
    where srun sets them: `srun -N1 ...` inside a 5-node job is a world of its own."""

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env)

    @staticmethod
    def world(env: Mapping[str, str], local_rank_flag: int | None, check: bool = True) -> World:
        tasks_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        rank, world_size = _int_var(env, "SLURM_PROCID"), _int_var(env, tasks_var)
        in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
        local_rank = _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        node = _int_var(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        per_node_text = (env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
                         or env.get("SLURM_NTASKS_PER_NODE") or str(world_size))
        per_node = expand_tasks_per_node(per_node_text)
        local_world_size = per_node[min(node, len(per_node) - 1)]
        nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                    or env.get("SLURM_NODELIST") or "127.0.0.1")
        job_id = env.get("SLURM_JOB_ID", "0")
        # A port derived from the job id: two jobs sharing a node do not pick the same one.
        port = _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else 15000 + int(job_id) % 20000
        world = World(rank, local_rank, world_size, local_world_size, "slurm",
                      env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0], port,
                      f"slurm-{job_id}.{env.get('SLURM_STEP_ID', '0')}-"
                      f"{env.get('SLURM_RESTART_COUNT', '0')}")
        if not check:
            return world
        if world_size > 1 and not in_step:
            raise UsageError(f"{tasks_var}={world_size} but this process was not started by srun; "
                             "run `srun python train.py` inside the batch script (or use torchrun)")
        _check_ranks(rank, local_rank, world_size, f"SLURM (SLURM_PROCID/{tasks_var})")
        if local_rank >= local_world_size:
            raise UsageError(f"SLURM_LOCALID={local_rank} but only {local_world_size} tasks on "
                             "this node; make --ntasks-per-node match the tasks srun starts")
        if in_step and sum(per_node) != world_size:
            raise UsageError(f"{tasks_var}={world_size} but the tasks per node ({per_node_text}) "
                             f"add up to {sum(per_node)}; use --ntasks-per-node (not --ntasks) so "
                             "every node runs the same number of tasks")
        return world


class SingleProcessEnvironment:
    """`python train.py` with no launcher: a world of one."""

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return True

    @staticmethod
    def world(env: Mapping[str, str], local_rank_flag: int | None, check: bool = True) -> World:
        if check and env.get("PET_NNODES", "1") not in ("", "1"):
            # A Kubeflow Trainer v2 pod gives only torchrun's PET_* variables: without torchrun
            # every pod would train alone, all into the same checkpoints.
            raise UsageError(f"PET_NNODES={env['PET_NNODES']} is set (a Kubeflow Trainer v2 pod) "
                             "but no launcher started this process; run train.py through "
                             "torchrun, which reads the PET_* variables (as Kubeflow's "
                             "torch-distributed runtime does)")
        port = _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else find_free_port()
        return World(0, 0, 1, 1, "none", env.get("MASTER_ADDR", "127.0.0.1"), port,
                     f"single-{uuid.uuid4().hex[:8]}")


ENVIRONMENTS: tuple[type[Environment], ...] = (
    KubeflowEnvironment, TorchrunEnvironment, SlurmEnvironment, SingleProcessEnvironment)


def resolve_world(env: Mapping[str, str] | None = None, local_rank_flag: int | None = None,
                  check: bool = True) -> World:
    """The World of this process, from the first environment class that recognises `env`.
    `check=False` skips the consistency checks: the doctor shows what it finds even if they fail."""
    env = os.environ if env is None else env
    return next(e for e in ENVIRONMENTS if e.detect(env)).world(env, local_rank_flag, check)
