"""Command-line flags, config files, and the run configuration.

`Config` holds what every task shares (launch, data loading, optimizer, precision, checkpoints,
logging). A task's own settings live in task.py, in its `Settings` dataclass. Both declare each
setting once, with `setting`: its default, its help and its check. `build_parser` makes every
declared field a --flag (batch_size: --batch-size); the task reads its own as `cfg.task.<name>`.
The template answers this project was generated with are the constants just below: edit them to
change a default, or pass the matching flag to override it for one run. `--config run.toml` sets
any flag from a file (keys spelled like the flags without `--`); flags on the command line win.
Every value is checked here, before any work starts: a bad one is one `error:` line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from .checkpoint import storage
from .evaluation import parse_goal
from .failures import local_rank_from_env, say_once_per_node
from .settings import setting  # also task.py's: `from .config import setting` works too

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
SEED_MAX = 2**31 - 1  # the seed is offset per rank and per worker; keep it a plain 32-bit value
GROUPS = {  # the sections of --help, in this order
    "training": "training",
    "ddp": "DDP's gradient exchange (docs/performance.md says when to change them)",
    "data": "data and model (task.py reads these)",
    "distributed": "distributed",
    "output": "checkpoints and output",
}


def task_settings() -> type | None:
    """task.py's `Settings` class, if it declares one. (Imported here, not at the top of this
    module, so that importing the configuration does not build the task's imports.)"""
    from . import task

    return getattr(task, "Settings", None)


@dataclass
class NoSettings:
    """The settings of a task.py that declares none."""


# ---------------------------------------------------------------------- value checks
def _int(low: float = -math.inf, high: float = math.inf) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            limit = (f"at least {low}" if high == math.inf else f"at most {high}"
                     if low == -math.inf else f"between {low} and {high}")
            raise argparse.ArgumentTypeError(f"must be {limit}, got {value}")
        return value
    parse.__name__ = "integer"  # what argparse names in "invalid integer value"
    return parse


def _float(low: float, inclusive: bool, high: float = math.inf) -> Callable[[str], float]:
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


def _number(kind: str, low: float | None, high: float | None) -> Callable[[str], Any] | None:
    """The check of an int or float setting: at least `low`, at most `high`, where declared."""
    top = math.inf if high is None else high
    if kind.startswith("int"):
        return _int(-math.inf if low is None else int(low), top)
    if kind.startswith("float"):
        return _float(-math.inf if low is None else low, True, top)
    return None


def _ema_decay(text: str) -> float:
    value = float(text)
    if not (value == 0 or 0 < value < 1):
        raise argparse.ArgumentTypeError(f"must be 0 (off) or between 0 and 1, e.g. 0.999; got "
                                         f"{text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text}")
    return value


_ema_decay.__name__ = _fraction.__name__ = "number"


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


# ---------------------------------------------------------------------- the settings
@dataclass
class Config:
    """Everything a run needs to know. Built by `parse_args`, saved (as plain types) in
    checkpoints and in <output-dir>/config.json. Each field declared with `setting` is a --flag
    (numbers checked against `low`/`high`, a bool a switch that turns it on) and a key of
    --config files, listed by --help in the order below."""

    epochs: int = setting(3, "passes over the data", low=1, group="training")
    batch_size: int = setting(32, "samples per process per step", low=1, group="training")
    lr: float = setting(3e-3, "peak learning rate (AdamW)", type=_float(0, False, 10.0),
                        group="training")
    weight_decay: float = setting(0.0, "AdamW weight decay", low=0, group="training")
    lr_schedule: str = setting("constant", "after the warm-up: constant, or a cosine or linear "
                               "decay to 0", choices=["constant", "cosine", "linear"],
                               group="training")
    warmup_steps: int = setting(0, "linear warm-up steps", low=0, group="training")
    seed: int = setting(0, "seeds data, model init and every rank", low=0, high=SEED_MAX,
                        group="training")
    precision: str = setting("fp32", "autocast dtype; fp16 needs CUDA (it uses a GradScaler)",
                             choices=["fp32", "bf16", "fp16"], group="training")
    grad_accum: int = setting(1, "micro-batches per optimizer step", low=1, group="training")
    clip_grad: float = setting(0.0, "max gradient norm, 0 = off", low=0, group="training")
    ema_decay: float = setting(0.0, "evaluate, save and export an exponential moving average of "
                               "the weights (after each step: D x average + (1 - D) x weights), "
                               "e.g. 0.999; 0 = off", type=_ema_decay, metavar="D",
                               group="training")
    max_steps: int = setting(0, "stop after this many optimizer steps in total, 0 = no limit",
                             low=0, group="training")
    deterministic: bool = setting(False, "deterministic algorithms only (slower on GPU; an error "
                                  "names any op without one)", group="training")
    compile: bool = setting(False, "torch.compile the model", group="training")
    find_unused_parameters: bool = setting(False, "DDP find_unused_parameters (only for models "
                                           "with unused branches)", group="training")

    bucket_cap_mb: float | None = setting(None, "size of DDP's gradient buckets, each all-reduced "
                                          "as soon as its gradients are ready (default: DDP's 25, "
                                          "with a first bucket of 1)",
                                          type=_float(0, False, 4096.0), group="ddp")
    static_graph: bool = setting(False, "DDP static_graph: the same parameters are used in every "
                                 "step", group="ddp")
    gradient_as_bucket_view: bool = setting(True, "gradients live inside DDP's buckets (no copy "
                                            "in and out)",
                                            action=argparse.BooleanOptionalAction, group="ddp")
    comm_hook: str = setting("none", "none: all-reduce as is; bf16/fp16: send half the bytes; "
                             "powersgd: low-rank compression", choices=COMM_HOOKS, group="ddp")
    powersgd_rank: int = setting(1, "--comm-hook powersgd: rank of each gradient's "
                                 "approximation", low=1, high=64, group="ddp")
    powersgd_warmup_steps: int = setting(1000, "--comm-hook powersgd: steps of plain all-reduce "
                                         "before compression", low=2, group="ddp")

    data: str | None = setting(None, "your data on disk instead of the synthetic set (task.py "
                               "reads it)", metavar="PATH", group="data")
    val_fraction: float = setting(0.1, "share of the data held out and evaluated after every "
                                  "epoch, 0 = none", type=_fraction, group="data")
    num_workers: int = setting(0, "DataLoader worker processes per rank (0: batches are made "
                               "in-process)", low=0, high=64, group="data")
    data_on_device: str = setting("auto", "auto: on a GPU, an in-memory data set that takes at "
                                  "most a quarter of the free memory lives there (no copy per "
                                  "step; --num-workers 0 only)", choices=["auto", "never"],
                                  group="data")
    sync_bn: bool = setting(False, "convert BatchNorm to SyncBatchNorm (CUDA only; a warning on "
                            "CPU)", group="data")
    model_layout: str = setting(DEFAULT_MODEL_LAYOUT, "one device per process (DDP), the model "
                                "split over two devices per process, or parameters sharded "
                                "across ranks (FSDP2)", choices=LAYOUTS, group="data")
    stage_devices: list[str] = setting([], "model_parallel_2: the two devices of this process, "
                                       "e.g. cuda:0,cuda:1", type=_device_list,
                                       metavar="DEV0,DEV1", group="data")
    shard_group_size: int = setting(0, "fsdp: shard the model over groups of N ranks and "
                                    "replicate it across the groups (HSDP); 0 = one node's ranks "
                                    "when the job spans several nodes, else all ranks (plain "
                                    "fsdp)", low=0, metavar="N", group="data")

    backend: str = setting(DEFAULT_BACKEND, "auto = nccl when CUDA GPUs are visible, else gloo",
                           choices=["auto", "nccl", "gloo"], group="distributed")
    init_method: str = setting(DEFAULT_INIT_METHOD, "env, tcp, file, tcp://HOST:PORT, "
                               "file:///path or a path like ./store", metavar="METHOD",
                               group="distributed")
    timeout_s: float = setting(300.0, "seconds any wait for the other ranks may take before the "
                               "run fails", low=1, high=7 * 24 * 3600, group="distributed")
    nprocs: int = setting(1, "start this many processes with mp.spawn (only without a "
                          "launcher)", low=1, high=1024, group="distributed")
    local_rank: int | None = setting(None, "set by the legacy torch.distributed.launch; "
                                     "LOCAL_RANK from the environment wins", low=0,
                                     flags=["--local-rank", "--local_rank"], in_file=False,
                                     group="distributed")

    checkpoint_dir: str = setting("checkpoints", "where checkpoints are written", group="output")
    save_every: int = setting(1, "save every N epochs, 0 = only at the end", low=0,
                              group="output")
    save_every_steps: int = setting(0, "also save every N optimizer steps, 0 = off", low=0,
                                    group="output")
    keep_last: int = setting(3, "checkpoints of this run to keep, 0 = keep all", low=0,
                             group="output")
    resume: str = setting("auto", "auto = newest complete checkpoint in --checkpoint-dir, if "
                          "any", metavar="{auto,never,PATH}", group="output")
    async_save: bool = setting(False, "write checkpoints in the background while training goes "
                               "on", group="output")
    output_dir: str = setting("runs/latest", "metrics.jsonl, summary.json and config.json go "
                              "here", group="output")
    run_name: str | None = setting(None, "outputs in runs/NAME and checkpoints in "
                                   "checkpoints/NAME (unless --output-dir / --checkpoint-dir "
                                   "are given)", type=_run_name, group="output")
    eval_every_steps: int = setting(0, "also evaluate every N optimizer steps (0: only at the end "
                                    "of epochs)", low=0, group="output")
    eval_only: bool = setting(False, "evaluate the --resume checkpoint, write "
                              "<output-dir>/eval.json, change nothing", group="output")
    keep_best: str | None = setting(None, "also keep the checkpoint with the best METRIC (e.g. "
                                    "val_accuracy:max), whatever --keep-last says", type=_goal,
                                    metavar="METRIC[:max|min]", group="output")
    early_stop: str | None = setting(None, "stop when METRIC has not improved for PATIENCE "
                                     "evaluations", type=_early_stop,
                                     metavar="METRIC[:max|min]:PATIENCE", group="output")
    log_every: int = setting(10, "log every N optimizer steps", low=1, group="output")
    step_times: str | None = setting(None, "write rank 0's wall-clock time at the end of every "
                                     "optimizer step (on a GPU also each step's CUDA-event time) "
                                     "to this JSON file", metavar="PATH", group="output")
    profile_steps: str | None = setting(None, "record a torch.profiler trace of these optimizer "
                                        "steps on rank 0 into <output-dir>/profile/",
                                        type=_step_range, metavar="FIRST:LAST", group="output")
    tracker: str = setting(DEFAULT_TRACKER, "where metrics go besides metrics.jsonl (rank 0 only)",
                           choices=TRACKERS, group="output")
    progress: bool = setting(True, "no progress bar", flags=["--no-progress"],
                             action="store_false", group="output")
    config: str | None = setting(None, "a TOML file of flag values (keys like the flags without "
                                 "--); flags given on the command line win", metavar="PATH",
                                 in_file=False, group="output")
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


# ---------------------------------------------------------------------- flags
class Parser(argparse.ArgumentParser):
    """argparse, with bad flags as one `error:` line, printed once per node, exit code 2."""

    task_types: dict[str, str]  # dest of each task setting -> its declared type

    def error(self, message: str) -> NoReturn:
        self.fail(f"{message} (python train.py --help lists the flags)")

    def fail(self, message: str) -> NoReturn:
        say_once_per_node(message, local_rank_from_env())
        sys.exit(2)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default at the end of its help, once: not where the help states it itself,
    nor for a list (empty unless a --config file set it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if isinstance(action.default, list) or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser(settings: type | None = None) -> Parser:
    """Every flag: one per `setting` of Config, and one per field of task.py's `Settings` class
    (if it has one)."""
    p = Parser(description="Train a model with PyTorch DistributedDataParallel.",
               formatter_class=_Help)
    p.task_types = {}
    defaults, groups = Config(), {}
    for f in dataclasses.fields(Config):
        name = f.metadata.get("group")
        if name is None:  # task and given: filled in by parse_args
            continue
        if name not in groups:
            groups[name] = p.add_argument_group(GROUPS[name])
        implied = ({"action": "store_true"} if f.type == "bool" else
                   {"type": _number(f.type, f.metadata["low"], f.metadata["high"])})
        _add_flag(groups[name], f, f.name, getattr(defaults, f.name), implied)
    if settings is not None:
        g = p.add_argument_group("task.py's settings (the task reads cfg.task.<name>)")
        for f in dataclasses.fields(settings):
            _add_setting(p, g, f)
    return p


def _add_flag(group: Any, f: dataclasses.Field, dest: str, default: Any,
              implied: dict[str, Any]) -> None:
    """The --flag of one setting: what its declaration says, over what its type implies."""
    kwargs = implied | f.metadata.get("flag", {})
    flags = kwargs.pop("flags", ["--" + f.name.replace("_", "-")])
    group.add_argument(*flags, dest=dest, default=default, help=f.metadata.get("help", ""),
                       **kwargs)


SETTING_TYPES = ("int", "float", "bool", "str", "str | None")


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
    dest = f"task.{f.name}"
    parser.task_types[dest] = kind
    if kind == "bool":  # --name and --no-name: the default may be either
        implied = {"action": argparse.BooleanOptionalAction}
    else:
        check = _number(kind, f.metadata.get("low"), f.metadata.get("high"))
        implied = {"type": check or str, "metavar": kind.split()[0].upper()}
    _add_flag(group, f, dest, f.default, implied)


# ---------------------------------------------------------------------- config files
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
    # Not settable from a file (in_file=False): they describe one launch, not the run.
    launch_only = {f.name for f in dataclasses.fields(Config) if f.metadata.get("in_file") is False}
    types = {f.name: f.type for f in dataclasses.fields(Config)} | parser.task_types
    values: dict[str, Any] = {}
    for key, value in table.items():
        action = actions.get(key)
        if action is None or action.dest in launch_only:
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
    if "://" in cfg.output_dir:  # as a path it would be a local folder named like the bucket
        return [f"--output-dir {cfg.output_dir.split('://')[0]}://...: metrics are written to a "
                "local folder; give a path (checkpoints take a URL: --checkpoint-dir)"]
    for flag, value in (("--checkpoint-dir", cfg.checkpoint_dir), ("--resume", cfg.resume)):
        why = storage.url_problem(value)
        if why:
            return [f"{flag} {storage.redact(value)}: {why}"]
    if cfg.data is not None and not Path(cfg.data).exists():
        found.append(f"--data {cfg.data}: no such file or folder")
    for flag, value in (("--checkpoint-dir", cfg.checkpoint_dir), ("--output-dir", cfg.output_dir)):
        if not storage.is_url(value) and Path(value).exists() and not Path(value).is_dir():
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
    if (cfg.resume not in ("auto", "never") and not storage.is_url(cfg.resume)
            and not Path(cfg.resume).exists()):
        found.append(f"--resume {cfg.resume}: no such file or folder; use --resume auto or "
                     "--resume never")
    return found
