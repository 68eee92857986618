"""Ray Train (launcher=ray): `python scripts/train_ray.py --workers N [--max-restarts R] [flags]`.

The driver checks the flags, the data and the checkpoint first (doctor.preflight, as
scripts/train_local.sh does), then the Ray cluster, then runs `main` in each worker of Ray Train's
TorchTrainer. Ray starts the workers, sets torchrun's variables and makes the process group; the
run takes that group as its own (RayEnvironment; rendezvous.ddp_setup makes no second one).
Checkpoints stay the project's: a group Ray restarts resumes from `--checkpoint-dir`.

A mistake a worker finds is its `error:` line and exit code 1, returned, not raised: Ray retries
every raised error and every dead worker, and no restart cures a mistake. A worker that dies
(SIGKILL, a lost node, a deadline of --timeout-s) is Ray's to restart, up to --max-restarts.

Ctrl-C or SIGTERM to the driver saves, as under torchrun (ray_stop.py)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shlex
import signal
import socket
import sys
import threading
from collections.abc import Mapping
from typing import Any

from .. import doctor, metrics, task
from ..checkpoint.resume import pick_checkpoint
from ..config import parse_args
from ..main import main as train_main
from . import environments, launch
from .environments import TorchrunEnvironment, World
from .ray_stop import RayLifeline, Stop, Unsaved, fit_in_thread, said, stop_when_told

START = "start one with `ray start --head` (or set RAY_ADDRESS to a running cluster's address)"
# The driver's variables its workers get (Ray starts them in the environment `ray start` had):
# those the project and its docs name, and each --env NAME. RAY_* and CUDA_VISIBLE_DEVICES: Ray's.
PASSED = ("AWS_", "WANDB_", "MLFLOW_", "NCCL_", "GLOO_", "TORCH_", "OMP_NUM_THREADS",
          "TOKENIZERS_PARALLELISM")


class RayEnvironment:
    """A Ray Train V2 worker: torchrun's variables, and NODE_RANK and ACCELERATE_TORCH_DEVICE,
    which Ray Train sets too. Its process group exists already (Ray made it)."""

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return all(name in env for name in ("RANK", "NODE_RANK", "ACCELERATE_TORCH_DEVICE"))

    @staticmethod
    def world(env: Mapping[str, str], local_rank_flag: int | None, check: bool = True) -> World:
        world = TorchrunEnvironment.world(env, local_rank_flag, check)
        # Ray picks a new port for every start of the group: a new run id per restart.
        return dataclasses.replace(world, launcher="ray", run_id=f"ray-{world.master_addr}-"
                                   f"{world.master_port}")


def worker(config: dict[str, Any]) -> int:
    """One Ray Train worker: train.py's `main` with the driver's flags, in the driver's folder
    (where relative paths point). Returns the exit code; rank 0's is the driver's."""
    import ray.train

    if os.path.isdir(config["cwd"]):
        os.chdir(config["cwd"])
    if os.environ.get("RANK") == "0" and config["env"]:
        got = [name for name in config["env"] if name in os.environ]
        print(f"ray: the workers have {', '.join(got) or 'none'} of the driver's "
              f"{', '.join(config['env'])}", flush=True)
    if RayEnvironment not in environments.ENVIRONMENTS:
        environments.ENVIRONMENTS = (RayEnvironment, *environments.ENVIRONMENTS)
    # Every rank reports the same metrics line (rank 0's): ray.train.report waits for all.
    metrics.EVERY_RANK[:] = [lambda record: ray.train.report(record)]
    launch.Lifeline = RayLifeline  # the run's lifeline (launch.setup makes it), told a signal
    launch.crash_hint = functools.partial(driver_only, config["driver_env"])
    threading.Thread(target=stop_when_told, args=(config["stop"],), daemon=True).start()
    return train_main(config["argv"])


def driver_only(names: list[str], exc: Exception) -> str | None:
    """A KeyError of a variable the driver has (`names`) and this worker lacks: task.py read it
    in a worker, which starts in the cluster's environment, not the driver's."""
    name = exc.args[0] if isinstance(exc, KeyError) and exc.args else None
    if name not in names or name in os.environ:
        return None
    return (f"KeyError {name!r}: {name} is set where scripts/train_ray.py runs, not in Ray's "
            f"workers (they start in the cluster's environment); pass it: --env {name}")


def workers_flag(text: str) -> int | tuple[int, int]:
    """--workers N, or MIN:MAX (Ray's elastic worker count)."""
    low, _, high = text.partition(":")
    try:
        counts = (int(low), int(high)) if high else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or MIN:MAX") from None
    if not 1 <= counts[0] <= counts[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 <= MIN <= MAX")
    return counts if high else counts[0]


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as train.py's flags
        print(f"error: {message} (scripts/train_ray.py --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def own_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """--workers and --max-restarts, and the rest (train.py's flags)."""
    parser = Parser(prog="scripts/train_ray.py", add_help=False,
                    epilog="Every other flag is train.py's (python train.py --help).")
    parser.add_argument("--workers", type=workers_flag, default=2, metavar="N|MIN:MAX",
                        help="Ray Train workers (processes); MIN:MAX lets Ray choose (elastic)")
    parser.add_argument("--max-restarts", type=int, default=3, metavar="R",
                        help="how often Ray restarts the group after a worker died")
    parser.add_argument("--env", action="append", default=[], metavar="NAME",
                        help="pass this variable of yours to the workers too (one a flag; "
                             f"{', '.join(PASSED)}... always go)")
    parser.add_argument("-h", "--help", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if args.help:
        parser.print_help()
        print()
        parse_args(["--help"], getattr(task, "Settings", None))  # train.py's flags; exits
    if args.max_restarts < 0:
        parser.error("--max-restarts: expected 0 or more")
    for name in args.env:
        if "=" in name:  # a value given here would land in the command line and its logs
            parser.error(f"--env {name}: --env takes a variable's name, whose value goes from "
                         f"here: export {name}, then --env {name.partition('=')[0]}")
        if name.startswith("RAY_") or name == "CUDA_VISIBLE_DEVICES":
            parser.error(f"--env {name}: Ray's own, which Ray sets in each worker (its devices, "
                         "its cluster); leave it out")
        if name not in os.environ:
            parser.error(f"--env {name}: no such variable here to pass to the workers")
    return args, rest


def reachable(address: str) -> bool:
    """Whether a HOST:PORT address answers (ray.init would retry an unreachable one for a
    minute); other forms (auto, ray://) are left to ray.init."""
    host, _, port = address.rpartition(":")
    if "://" in address or not port.isdigit():
        return True
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        return True
    except OSError:
        return False


def connect(workers: int | tuple[int, int], env: dict[str, str], timeout_s: float) -> str | None:
    """Join the Ray cluster, giving this job's workers `env`; None, or why it cannot run
    `workers` workers (a GPU each where the cluster has GPUs, else a CPU each). An address that
    answers but is not Ray's: one error line and exit 1 after `timeout_s` (ray.init retries it
    for ever, and ray.shutdown would wait on it)."""
    import ray

    address = os.environ.get("RAY_ADDRESS", "auto")
    if address.startswith(("http://", "https://")):  # the dashboard's (Ray Jobs'), often 8265
        return (f"RAY_ADDRESS={address} is a dashboard's address; give the cluster's, HOST:PORT "
                "as `ray start --head` printed it (port 6379 by default)")
    if not reachable(address):
        return f"no Ray cluster answers at RAY_ADDRESS={address}; {START}"

    def give_up() -> None:  # ray.init is stuck in this thread: neither it nor ray.shutdown returns
        print(f"error: no Ray cluster answered at RAY_ADDRESS={address} within --timeout-s "
              f"{timeout_s:g} (something listens there, but not Ray's GCS); give the cluster's "
              "address, HOST:PORT as `ray start --head` printed it", file=sys.stderr, flush=True)
        os._exit(1)

    watchdog = threading.Timer(timeout_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        ray.init(address=address, logging_level="WARNING", runtime_env={"env_vars": env})
    except (ConnectionError, RuntimeError, ValueError) as exc:  # ValueError: a malformed address
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "ray[client]" in first:  # ray://: Ray Client, whose packages the ray extra has not
            return (f"RAY_ADDRESS={address} is a Ray Client address, which needs pip install "
                    "\"ray[client]\" here; or run this on the cluster with its HOST:PORT")
        return f"no Ray cluster to join at RAY_ADDRESS={address} ({first}); {START}"
    finally:
        watchdog.cancel()
    needed = workers if isinstance(workers, int) else workers[0]
    kind = "GPU" if ray.cluster_resources().get("GPU") else "CPU"
    slots = int(ray.cluster_resources().get(kind, 0))
    if slots < needed:
        return (f"--workers {needed} needs {needed} {kind}s but the Ray cluster has {slots}; add "
                f"nodes (`ray start --address ...`), `ray start --head --num-{kind.lower()}s "
                f"{needed}`, or ask for fewer workers")
    return None


def storage_path(output_dir: str) -> str:
    """Where Ray Train keeps its run's records: <output-dir>/ray, a bucket's too."""
    if "://" in output_dir:
        return f"{output_dir.rstrip('/')}/ray"
    return os.path.abspath(os.path.join(output_dir, "ray"))


def newest(checkpoint_dir: str) -> str:
    """The checkpoint the same command resumes from (--resume auto's), for the last line."""
    found = pick_checkpoint("auto", checkpoint_dir)
    return (f"the newest checkpoint is {found}, which the same command resumes from" if found
            else "no checkpoint was saved yet: the same command starts over")


def main(argv: list[str] | None = None) -> int:
    """The driver: check, connect, fit. Returns the exit code."""
    args, rest = own_flags(sys.argv[1:] if argv is None else argv)
    # The flags, the data and the checkpoint, once (exit 2 for a flag, 1 for the rest); paths
    # made absolute from here, and the workers start here too.
    flags = shlex.split(doctor.preflight(rest, caller=os.getcwd()))[1:]
    cfg = parse_args(flags, getattr(task, "Settings", None), warn=False)
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
        from ray.train.torch import TorchTrainer
    except ImportError as exc:
        print(f"error: scripts/train_ray.py needs Ray Train ({exc}); pip install -e \".[ray]\"",
              file=sys.stderr, flush=True)
        return 1
    # Ray Train would send every print of the workers through its logger too: each line twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    env = {name: value for name, value in os.environ.items()
           if name.startswith(PASSED) or name in args.env}
    if problem := connect(args.workers, env, cfg.timeout_s):
        print(f"error: {problem}", file=sys.stderr, flush=True)
        ray.shutdown()
        return 1
    if env:  # names only: values may be secrets
        print(f"ray: passing {', '.join(sorted(env))} to the workers (docs/launching.md)",
              flush=True)
    stop = ray.remote(num_cpus=0)(Stop).remote()
    trainer = TorchTrainer(
        worker, train_loop_config={"argv": flags, "cwd": os.getcwd(), "env": sorted(env),
                                   "driver_env": sorted(os.environ), "stop": stop},  # names only
        scaling_config=ScalingConfig(num_workers=args.workers,
                                     use_gpu=bool(ray.cluster_resources().get("GPU"))),
        run_config=RunConfig(storage_path=storage_path(cfg.output_dir),
                             failure_config=FailureConfig(max_failures=args.max_restarts)))
    try:
        result = fit_in_thread(trainer, stop)
    except TrainingFailedError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"error: Ray Train stopped after {args.max_restarts} restart(s): {first}; see the "
              "workers' output above", file=sys.stderr, flush=True)
        return 1
    except (KeyboardInterrupt, Unsaved) as stopped:  # twice, or no save in time
        signum = getattr(stopped, "signum", signal.SIGINT)
        print(f"stopped by {said(signum)}, without a save; {newest(cfg.checkpoint_dir)}",
              file=sys.stderr, flush=True)
        # fit's thread is in Ray still: an exit beside it can SIGSEGV. Ray ends the job's workers.
        sys.stdout.flush()
        os._exit(128 + signum)
    except Exception as exc:  # Ray's own: the cluster went away (its head killed), not the run
        print(f"error: the Ray cluster stopped answering ({type(exc).__name__}); "
              f"{newest(cfg.checkpoint_dir)}; start the cluster again first (ray start)",
              file=sys.stderr, flush=True)
        return 1
    finally:
        with contextlib.suppress(Exception):  # a cluster gone: nothing left to disconnect from
            ray.shutdown()
    return result.return_value if isinstance(result.return_value, int) else 1
