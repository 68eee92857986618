"""Command-line flags, config files, and the run configuration.

`Config` holds what every task shares (launch, data loading, optimizer, precision, checkpoints,
logging). A task's own settings live in task.py, in its `Settings` dataclass: each field becomes a
--flag too, and the task reads it as `cfg.task.<name>`. The template answers this project was
generated with are the constants just below: edit them to change a default, or pass the matching
flag to override it for one run. `--config run.toml` sets any flag from a file (keys spelled like
the flags without `--`); flags on the command line win. Every value is checked here, before any
work starts: a bad one is one `error:` line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from .evaluation import parse_goal
from .failures import QUIET_EXIT_DELAY_S, leave_for_torchrun, local_rank_from_env

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a declared dependency there)
    import tomli as tomllib

# Answers given when this project was generated.
DEFAULT_BACKEND = "{{ cookiecutter.backend }}"
DEFAULT_INIT_METHOD = "{{ cookiecutter.init_method }}"
DEFAULT_MODEL_LAYOUT = "{{ cookiecutter.model_layout }}"
DEFAULT_TRACKER = "{{ cookiecutter.tracker }}"

LAYOUTS = ["data_parallel", "model_parallel_2", "fsdp"]
COMM_HOOKS = ["none", "bf16", "fp16", "powersgd"]
TRACKERS = ["none", "tensorboard", "wandb", "mlflow"]


def setting(default: Any, help: str, low: float | None = None,
            unused_with: str | None = None) -> Any:
    """One field of task.py's `Settings`: its default, the one-line help of its --flag, for
    numbers the lowest value it accepts, and the Config field (e.g. "data") that makes it do
    nothing: set both, and the run starts with a warning."""
    return field(default=default, metadata={"help": help, "low": low, "unused_with": unused_with})


def task_settings() -> type | None:
    """task.py's `Settings` class, if it declares one. (Imported here, not at the top of this
    module: task.py imports this module.)"""
    from . import task

    return getattr(task, "Settings", None)


@dataclass
class NoSettings:
    """The settings of a task.py that declares none."""


@dataclass
class Config:
    """Everything a run needs to know. Built by `parse_args`, saved (as plain types) in
    checkpoints and in <output-dir>/config.json."""

    epochs: int = 3
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    seed: int = 0
    precision: str = "fp32"
    grad_accum: int = 1
    clip_grad: float = 0.0
    ema_decay: float = 0.0
    max_steps: int = 0
    deterministic: bool = False
    compile: bool = False
    find_unused_parameters: bool = False
    bucket_cap_mb: float | None = None  # DDP's default: 25 MB, and a first bucket of 1 MB
    static_graph: bool = False
    gradient_as_bucket_view: bool = True
    comm_hook: str = "none"
    powersgd_rank: int = 1
    powersgd_warmup_steps: int = 1000
    data: str | None = None
    val_fraction: float = 0.1
    num_workers: int = 0
    data_on_device: str = "auto"
    sync_bn: bool = False
    model_layout: str = DEFAULT_MODEL_LAYOUT
    stage_devices: list[str] = field(default_factory=list)
    shard_group_size: int = 0  # fsdp: 0 = one node when the job spans several, else every rank
    backend: str = DEFAULT_BACKEND
    init_method: str = DEFAULT_INIT_METHOD
    timeout_s: float = 300.0
    nprocs: int = 1
    local_rank: int | None = None
    checkpoint_dir: str = "checkpoints"
    save_every: int = 1
    save_every_steps: int = 0
    keep_last: int = 3
    resume: str = "auto"
    async_save: bool = False
    output_dir: str = "runs/latest"
    run_name: str | None = None
    eval_every_steps: int = 0
    eval_only: bool = False
    keep_best: str | None = None
    early_stop: str | None = None
    log_every: int = 10
    step_times: str | None = None
    profile_steps: str | None = None
    tracker: str = DEFAULT_TRACKER
    progress: bool = True
    config: str | None = None
    task: Any = field(default_factory=NoSettings)  # task.py's Settings
    # Fields set by a flag or the --config file rather than left at their default ("task.x" for a
    # task setting): a resumed run keeps the earlier run's retention unless it is given again.
    given: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, so a checkpoint loads with `weights_only=True`."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(saved: dict[str, Any]) -> Config:
        """The Config a checkpoint was saved with (what `to_dict` wrote); fields this version
        does not know are left out, missing ones keep their defaults."""
        names = {f.name for f in dataclasses.fields(Config)} - {"task"}
        settings = task_settings() or NoSettings
        task_names = {f.name for f in dataclasses.fields(settings)}
        task = {k: v for k, v in saved.get("task", {}).items() if k in task_names}
        return Config(**{k: v for k, v in saved.items() if k in names}, task=settings(**task))

    def profile_range(self) -> tuple[int, int] | None:
        if not self.profile_steps:
            return None
        first, last = self.profile_steps.split(":")
        return int(first), int(last)


# ---------------------------------------------------------------------- value checks
def _int(low: int, high: int | None = None):
    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            limit = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {limit}, got {value}")
        return value
    parse.__name__ = "integer"  # what argparse names in "invalid integer value"
    return parse


def _float(low: float, inclusive: bool, high: float = math.inf):
    def parse(text: str) -> float:
        value = float(text)
        ok = math.isfinite(value) and (value >= low if inclusive else value > low) and value <= high
        if not ok:
            bound = f"{'at least' if inclusive else 'greater than'} {low:g}"
            if high < math.inf:
                bound += f" and at most {high:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value
    parse.__name__ = "number"
    return parse


def _ema_decay(text: str) -> float:
    value = float(text)
    if not (value == 0 or 0 < value < 1):
        raise argparse.ArgumentTypeError(f"must be 0 (off) or between 0 and 1, e.g. 0.999; got "
                                         f"{text}")
    return value


_ema_decay.__name__ = "number"


def _goal(text: str) -> str:
    try:
        parse_goal(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _early_stop(text: str) -> str:
    goal, _, patience = text.rpartition(":")
    if not goal or not patience.isdigit() or int(patience) < 1:
        raise argparse.ArgumentTypeError(f"expected METRIC[:max|min]:PATIENCE with PATIENCE at "
                                         f"least 1, e.g. val_loss:3, got {text!r}")
    return f"{_goal(goal)}:{patience}"


def _run_name(text: str) -> str:
    if not text or text in (".", "..") or "/" in text or "\\" in text:
        raise argparse.ArgumentTypeError(f"must be a plain folder name (no slashes), got {text!r}")
    return text


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text}")
    return value


def _device_list(text: str) -> list[str]:
    devices = [part.strip() for part in text.split(",") if part.strip()]
    if len(devices) != 2 or not all(d == "cpu" or d.startswith("cuda") for d in devices):
        raise argparse.ArgumentTypeError(f"expected two devices like cuda:0,cuda:1, got {text!r}")
    return devices


def _step_range(text: str) -> str:
    first, sep, last = text.partition(":")
    if not (sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise argparse.ArgumentTypeError(f"expected FIRST:LAST optimizer steps like 10:15, got "
                                         f"{text!r}")
    return text


class Parser(argparse.ArgumentParser):
    """argparse, with bad flags as one `error:` line, printed once per node, exit code 2."""

    task_types: dict[str, str]  # dest of each task setting -> its declared type

    def error(self, message: str) -> NoReturn:
        self.fail(f"{message} (python train.py --help lists the flags)")

    def fail(self, message: str) -> NoReturn:
        leave_for_torchrun(message)
        if local_rank_from_env() == 0:
            sys.stderr.write(f"error: {message}\n")
        else:  # the rank that prints may be a moment behind: a launcher stops it when we exit
            time.sleep(QUIET_EXIT_DELAY_S)
        sys.exit(2)


SEED_MAX = 2**31 - 1  # the seed is offset per rank and per worker; keep it a plain 32-bit value


def build_parser(settings: type | None = None) -> Parser:
    """Every flag: the project's, and those of task.py's `Settings` class (if it has one)."""
    d = Config()
    p = Parser(description="Train a model with PyTorch DistributedDataParallel.",
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.task_types = {}
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=_int(1), default=d.epochs, help="passes over the data")
    g.add_argument("--batch-size", type=_int(1), default=d.batch_size,
                   help="samples per process per step")
    g.add_argument("--lr", type=_float(0, False, 10.0), default=d.lr,
                   help="peak learning rate (AdamW)")
    g.add_argument("--weight-decay", type=_float(0, True), default=d.weight_decay,
                   help="AdamW weight decay")
    g.add_argument("--lr-schedule", choices=["constant", "cosine", "linear"],
                   default=d.lr_schedule,
                   help="after the warm-up: constant, or a cosine or linear decay to 0")
    g.add_argument("--warmup-steps", type=_int(0), default=d.warmup_steps,
                   help="linear warm-up steps")
    g.add_argument("--seed", type=_int(0, SEED_MAX), default=d.seed,
                   help="seeds data, model init and every rank")
    g.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=d.precision,
                   help="autocast dtype; fp16 needs CUDA (it uses a GradScaler)")
    g.add_argument("--grad-accum", type=_int(1), default=d.grad_accum,
                   help="micro-batches per optimizer step")
    g.add_argument("--clip-grad", type=_float(0, True), default=d.clip_grad,
                   help="max gradient norm, 0 = off")
    g.add_argument("--ema-decay", type=_ema_decay, default=d.ema_decay, metavar="D",
                   help="evaluate, save and export an exponential moving average of the weights "
                        "(after each step: D x average + (1 - D) x weights), e.g. 0.999; 0 = off")
    g.add_argument("--max-steps", type=_int(0), default=d.max_steps,
                   help="stop after this many optimizer steps in total, 0 = no limit")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms only (slower on GPU; an error names any op "
                        "without one)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--find-unused-parameters", action="store_true",
                   help="DDP find_unused_parameters (only for models with unused branches)")

    g = p.add_argument_group("DDP's gradient exchange (docs/performance.md says when to change "
                             "them)")
    g.add_argument("--bucket-cap-mb", type=_float(0, False, 4096.0), default=d.bucket_cap_mb,
                   help="size of DDP's gradient buckets, each all-reduced as soon as its "
                        "gradients are ready (default: DDP's 25, with a first bucket of 1)")
    g.add_argument("--static-graph", action="store_true",
                   help="DDP static_graph: the same parameters are used in every step")
    g.add_argument("--gradient-as-bucket-view", action=argparse.BooleanOptionalAction,
                   default=d.gradient_as_bucket_view,
                   help="gradients live inside DDP's buckets (no copy in and out)")
    g.add_argument("--comm-hook", choices=COMM_HOOKS, default=d.comm_hook,
                   help="none: all-reduce as is; bf16/fp16: send half the bytes; powersgd: "
                        "low-rank compression")
    g.add_argument("--powersgd-rank", type=_int(1, 64), default=d.powersgd_rank,
                   help="--comm-hook powersgd: rank of each gradient's approximation")
    g.add_argument("--powersgd-warmup-steps", type=_int(2), default=d.powersgd_warmup_steps,
                   help="--comm-hook powersgd: steps of plain all-reduce before compression")

    g = p.add_argument_group("data and model (task.py reads these)")
    g.add_argument("--data", default=d.data, metavar="PATH",
                   help="your data on disk instead of the synthetic set (task.py reads it)")
    g.add_argument("--val-fraction", type=_fraction, default=d.val_fraction,
                   help="share of the data held out and evaluated after every epoch, 0 = none")
    g.add_argument("--num-workers", type=_int(0, 64), default=d.num_workers,
                   help="DataLoader worker processes per rank (0: batches are made in-process)")
    g.add_argument("--data-on-device", choices=["auto", "never"], default=d.data_on_device,
                   help="auto: on a GPU, an in-memory data set that takes at most a quarter of "
                        "the free memory lives there (no copy per step; --num-workers 0 only)")
    g.add_argument("--sync-bn", action="store_true",
                   help="convert BatchNorm to SyncBatchNorm (CUDA only; a warning on CPU)")
    g.add_argument("--model-layout", choices=LAYOUTS, default=d.model_layout,
                   help="one device per process (DDP), the model split over two devices per "
                        "process, or parameters sharded across ranks (FSDP2)")
    g.add_argument("--stage-devices", type=_device_list, default=d.stage_devices,
                   metavar="DEV0,DEV1",
                   help="model_parallel_2: the two devices of this process, e.g. cuda:0,cuda:1")
    g.add_argument("--shard-group-size", type=_int(0), default=d.shard_group_size, metavar="N",
                   help="fsdp: shard the model over groups of N ranks and replicate it across "
                        "the groups (HSDP); 0 = one node's ranks when the job spans several "
                        "nodes, else all ranks (plain fsdp)")

    g = p.add_argument_group("distributed")
    g.add_argument("--backend", choices=["auto", "nccl", "gloo"], default=d.backend,
                   help="auto = nccl when CUDA GPUs are visible, else gloo")
    g.add_argument("--init-method", default=d.init_method, metavar="METHOD",
                   help="env, tcp, file, tcp://HOST:PORT, file:///path or a path like ./store")
    g.add_argument("--timeout-s", type=_float(1, True, 7 * 24 * 3600.0), default=d.timeout_s,
                   help="seconds any wait for the other ranks may take before the run fails")
    g.add_argument("--nprocs", type=_int(1, 1024), default=d.nprocs,
                   help="start this many processes with mp.spawn (only without a launcher)")
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=_int(0), default=None,
                   help="set by the legacy torch.distributed.launch; LOCAL_RANK from the "
                        "environment wins")

    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint-dir", default=d.checkpoint_dir,
                   help="where checkpoints are written")
    g.add_argument("--save-every", type=_int(0), default=d.save_every,
                   help="save every N epochs, 0 = only at the end")
    g.add_argument("--save-every-steps", type=_int(0), default=d.save_every_steps,
                   help="also save every N optimizer steps, 0 = off")
    g.add_argument("--keep-last", type=_int(0), default=d.keep_last,
                   help="checkpoints of this run to keep, 0 = keep all")
    g.add_argument("--resume", default=d.resume, metavar="{auto,never,PATH}",
                   help="auto = newest complete checkpoint in --checkpoint-dir, if any")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training goes on")
    g.add_argument("--output-dir", default=d.output_dir,
                   help="metrics.jsonl, summary.json and config.json go here")
    g.add_argument("--eval-every-steps", type=_int(0), default=d.eval_every_steps,
                   help="also evaluate every N optimizer steps (0: only at the end of epochs)")
    g.add_argument("--eval-only", action="store_true", default=d.eval_only,
                   help="evaluate the --resume checkpoint, write <output-dir>/eval.json, "
                        "change nothing")
    g.add_argument("--keep-best", type=_goal, default=d.keep_best, metavar="METRIC[:max|min]",
                   help="also keep the checkpoint with the best METRIC (e.g. val_accuracy:max), "
                        "whatever --keep-last says")
    g.add_argument("--early-stop", type=_early_stop, default=d.early_stop,
                   metavar="METRIC[:max|min]:PATIENCE",
                   help="stop when METRIC has not improved for PATIENCE evaluations")
    g.add_argument("--run-name", type=_run_name, default=d.run_name,
                   help="outputs in runs/NAME and checkpoints in checkpoints/NAME (unless "
                        "--output-dir / --checkpoint-dir are given)")
    g.add_argument("--log-every", type=_int(1), default=d.log_every,
                   help="log every N optimizer steps")
    g.add_argument("--step-times", default=d.step_times, metavar="PATH",
                   help="write rank 0's wall-clock time at the end of every optimizer step (on a "
                        "GPU also each step's CUDA-event time) to this JSON file")
    g.add_argument("--profile-steps", type=_step_range, default=d.profile_steps,
                   metavar="FIRST:LAST",
                   help="record a torch.profiler trace of these optimizer steps on rank 0 into "
                        "<output-dir>/profile/")
    g.add_argument("--tracker", choices=TRACKERS, default=d.tracker,
                   help="where metrics go besides metrics.jsonl (rank 0 only)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    g.add_argument("--config", default=None, metavar="PATH",
                   help="a TOML file of flag values (keys like the flags without --); flags given "
                        "on the command line win")
    if settings is not None:
        g = p.add_argument_group("task.py's settings (the task reads cfg.task.<name>)")
        for f in dataclasses.fields(settings):
            _add_setting(p, g, f)
    return p


SETTING_TYPES = ("int", "float", "bool", "str", "str | None")


def _any_int(text: str) -> int:
    return int(text)


_any_int.__name__ = "integer"


def _add_setting(parser: Parser, group: Any, f: dataclasses.Field) -> None:
    """One field of task.py's Settings as a --flag, checked like the project's own flags."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    flag = "--" + f.name.replace("_", "-")
    if f.name in {field.name for field in dataclasses.fields(Config)}:
        parser.fail(f"task.py: setting '{f.name}' has the name of a project flag ({flag}); "
                    "rename it in Settings")
    if kind not in SETTING_TYPES:
        parser.fail(f"task.py: setting '{f.name}' is declared as {kind}; task settings are int, "
                    "float, bool, str or str | None")
    if f.default is dataclasses.MISSING:
        parser.fail(f"task.py: setting '{f.name}' has no default; give it one")
    help_text = f.metadata.get("help", "")
    dest = f"task.{f.name}"
    parser.task_types[dest] = kind
    if kind == "bool":
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           dest=dest, help=help_text)
    else:
        low = f.metadata.get("low")
        numbers = {"int": _any_int if low is None else _int(int(low)),
                   "float": _float(-math.inf if low is None else low, True)}
        group.add_argument(flag, type=numbers.get(kind, str), default=f.default, dest=dest,
                           metavar=kind.split()[0].upper(), help=help_text)


# ---------------------------------------------------------------------- config files
# Not settable from a file: they describe one launch, not the run.
_LAUNCH_ONLY = {"config", "local-rank", "local_rank"}
_TOML_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,),
               "str | None": (str,), "int | None": (int,), "float | None": (int, float),
               "list[str]": (str, list)}


def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """'batch-size' -> its action, for every --flag."""
    return {option[2:]: action for action in parser._actions  # argparse keeps them only here
            for option in action.option_strings if option.startswith("--")}


def config_file_values(path: str, parser: Parser) -> dict[str, Any]:
    """Flag values from a TOML file, converted and checked exactly like command-line flags."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        parser.fail(f"--config {path}: no such file")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        parser.fail(f"--config {path}: not a readable TOML file ({exc})")
    actions = _flag_actions(parser)
    types = {f.name: f.type for f in dataclasses.fields(Config)} | parser.task_types
    values: dict[str, Any] = {}
    for key, value in table.items():
        action = actions.get(key)
        if action is None or key in _LAUNCH_ONLY:
            parser.fail(f"--config {path}: unknown key '{key}'; keys are the flags without '--' "
                         "(see --help)")
        dest = action.dest
        expected = _TOML_TYPES[types[dest]]
        if isinstance(value, bool) != (bool in expected) or not isinstance(value, expected):
            kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
                    list: "a string"}
            parser.fail(f"--config {path}: key '{key}' must be {kind[expected[-1]]}, got "
                         f"{value!r}")
        if isinstance(value, bool):
            flipped = action.const is False  # --no-progress
            values[dest] = not value if flipped else value
            continue
        text = ",".join(value) if isinstance(value, list) else str(value)
        try:
            values[dest] = action.type(text) if action.type else text
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.fail(f"--config {path}: key '{key}': {exc}")
        if action.choices and values[dest] not in action.choices:
            parser.fail(f"--config {path}: key '{key}' must be one of "
                         f"{', '.join(map(str, action.choices))}, got {value!r}")
    return values


def parse_args(argv: list[str] | None = None) -> Config:
    """Flags (and --config) into a Config, with task.py's settings in `cfg.task`. Bad values exit
    with code 2 and one `error:` line."""
    settings = task_settings()
    parser = build_parser(settings)
    config_path = _config_path(argv)
    file_values = config_file_values(config_path, parser) if config_path else {}
    parser.set_defaults(**file_values)
    args = vars(parser.parse_args(argv))
    given = sorted(set(file_values) | _given_on_command_line(settings, argv))
    task_values = {key[5:]: args.pop(key) for key in list(args) if key.startswith("task.")}
    if args["run_name"]:  # several runs side by side, each resuming its own checkpoints
        for key, parent in (("output_dir", "runs"), ("checkpoint_dir", "checkpoints")):
            if key not in given:
                args[key] = f"{parent}/{args['run_name']}"
    cfg = Config(**args, task=(settings or NoSettings)(**task_values), given=given)
    for problem in problems(cfg):
        parser.fail(problem)
    if local_rank_from_env() == 0:
        for warning in unused_settings(cfg):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    return cfg


# Flags that only change DDP, and those that only change --comm-hook powersgd.
DDP_ONLY = ("bucket_cap_mb", "static_graph", "gradient_as_bucket_view", "comm_hook")
FSDP_ONLY = ("shard_group_size",)
POWERSGD_ONLY = ("powersgd_rank", "powersgd_warmup_steps")


def unused_settings(cfg: Config) -> list[str]:
    """Settings given (or, for the task's, changed from their default) that do nothing with the
    rest of the run."""
    found = []
    if cfg.model_layout == "fsdp":
        found += [f"--{name.replace('_', '-')} has no effect with --model-layout fsdp (FSDP "
                  "exchanges gradients itself, without DDP)" for name in DDP_ONLY
                  if name in cfg.given]
    else:
        found += [f"--{name.replace('_', '-')} has no effect without --model-layout fsdp"
                  for name in FSDP_ONLY if name in cfg.given]
    if cfg.comm_hook != "powersgd":
        found += [f"--{name.replace('_', '-')} has no effect without --comm-hook powersgd"
                  for name in POWERSGD_ONLY if name in cfg.given]
    for f in dataclasses.fields(cfg.task):
        other = f.metadata.get("unused_with")
        value = getattr(cfg.task, f.name)
        if other and getattr(cfg, other) not in (None, False) and value != f.default:
            found.append(f"--{f.name.replace('_', '-')} {value} has no effect with --{other} "
                         f"{getattr(cfg, other)}")
    return found


def _given_on_command_line(settings: type | None, argv: list[str] | None) -> set[str]:
    """The fields the command line sets: parsed again with a marker for every default."""
    unset = object()
    probe = build_parser(settings)
    probe.set_defaults(**{a.dest: unset for a in probe._actions if a.dest != "help"})
    return {key for key, value in vars(probe.parse_args(argv)).items() if value is not unset}


def _config_path(argv: list[str] | None) -> str | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    return known.config


def problems(cfg: Config) -> list[str]:
    """Combinations of values that cannot work, found before any work starts."""
    found = []
    for flag, value in (("--checkpoint-dir", cfg.checkpoint_dir), ("--resume", cfg.resume),
                        ("--output-dir", cfg.output_dir)):
        if "://" in value:  # as a path it would be a local folder named like the bucket: lost
            return [f"{flag} {value.split('://')[0]}://...: URLs are not supported yet; give a "
                    "local or shared-file-system path"]
    if cfg.data is not None and not Path(cfg.data).exists():
        found.append(f"--data {cfg.data}: no such file or folder")
    for flag, value in (("--checkpoint-dir", cfg.checkpoint_dir), ("--output-dir", cfg.output_dir)):
        if Path(value).exists() and not Path(value).is_dir():
            found.append(f"{flag} {value} is a file, not a folder; pick a folder")
    if cfg.step_times and Path(cfg.step_times).is_dir():
        found.append(f"--step-times {cfg.step_times} is a folder; name a file, e.g. "
                     f"{Path(cfg.step_times) / 'steps.json'}")
    if cfg.stage_devices and cfg.model_layout != "model_parallel_2":
        found.append("--stage-devices only applies to --model-layout model_parallel_2")
    if cfg.static_graph and cfg.grad_accum > 1:
        # DDP's no_sync with static_graph fails (pytorch/pytorch#143580) and, patched past
        # that, stops exchanging gradients: a wrong run, so refused.
        found.append("--static-graph does not work with --grad-accum above 1 (a PyTorch bug in "
                     "DDP's no_sync with static_graph); drop one of them")
    if cfg.sync_bn and cfg.model_layout == "fsdp":
        found.append("--sync-bn does not work with --model-layout fsdp; drop --sync-bn")
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        found.append(f"--resume {cfg.resume}: no such file or folder; use --resume auto or "
                     "--resume never")
    return found
