"""The run's configuration: `Config`, the settings every task shares.

Each is declared once, with `setting` (settings.py builds its --flag and --config key from that);
the task's own are task.py's `Settings`, declared the same way. A default is the first argument of
its `setting(...)` (the template's answers are the DEFAULT_ constants below): edit it to change
the default, or pass the flag to override it for a run. Every value is checked before any work
starts: a bad one is one `error:` line and exit 2."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoint import storage
from .evaluation import early_stop_flag, goal_flag
from .failures import local_rank_from_env
from .failures import warn as print_warning  # parse_args' `warn` flag has the name
from .settings import (  # task.py imports `setting` from .settings too
    decay,
    device_pair,
    folder_name,
    fraction,
    number,
    read_flags,
    setting,
    step_range,
)

# Answers given when this project was generated.
DEFAULT_BACKEND = "{{ cookiecutter.backend }}"
DEFAULT_INIT_METHOD = "{{ cookiecutter.init_method }}"
DEFAULT_MODEL_LAYOUT = "{{ cookiecutter.model_layout }}"
DEFAULT_TRACKER = "{{ cookiecutter.tracker }}"

# model_layout=tensor_parallel bakes its module, its layout and tp_size; other answers none.
TENSOR_PARALLEL = (Path(__file__).parent / "tensor_parallel.py").exists()
LAYOUTS = ["data_parallel", "model_parallel_2", "fsdp"] + (
    ["tensor_parallel"] if TENSOR_PARALLEL else [])
SHARDED = ("fsdp", "tensor_parallel")  # FSDP2's layouts: DCP checkpoints, no DDP
COMM_HOOKS = ["none", "bf16", "fp16", "powersgd"]
TRACKERS = ["none", "tensorboard", "wandb", "mlflow"]
SEED_MAX = 2**31 - 1  # the seed is offset per rank and per worker; keep it a plain 32-bit value


@dataclass
class NoSettings:
    """The settings of a task.py that declares none."""


# ---------------------------------------------------------------------- the settings
@dataclass
class Config:
    """Everything a run needs to know. Built by `parse_args`, saved (as plain types) in
    checkpoints and in <output-dir>/config.json. Each field declared with `setting` is a --flag
    (numbers checked against `low`/`high`, a bool a switch that turns it on) and a key of
    --config files, listed by --help in the order below (its sections: settings.SECTIONS)."""

    epochs: int = setting(3, "passes over the data", low=1)
    batch_size: int = setting(32, "samples per process per step", low=1)
    lr: float = setting(3e-3, "peak learning rate (AdamW)",
                        type=number("float", 0, 10.0, above=True))
    weight_decay: float = setting(0.0, "AdamW weight decay", low=0)
    lr_schedule: str = setting("constant", "after the warm-up: constant, or a cosine or linear "
                               "decay to --min-lr", choices=["constant", "cosine", "linear"])
    min_lr: float = setting(0.0, "where a cosine or linear decay ends (nanoGPT's: --lr / 10)",
                            type=number("float", 0, 10.0))
    warmup_steps: int = setting(0, "linear warm-up steps", low=0)
    seed: int = setting(0, "seeds data, model init and every rank", low=0, high=SEED_MAX)
    precision: str = setting("fp32", "autocast dtype; fp16 needs CUDA (it uses a GradScaler)",
                             choices=["fp32", "bf16", "fp16"])
    grad_accum: int = setting(1, "micro-batches per optimizer step", low=1)
    clip_grad: float = setting(0.0, "max gradient norm, 0 = off", low=0)
    ema_decay: float = setting(0.0, "evaluate, save and export an exponential moving average of "
                               "the weights (after each step: D x average + (1 - D) x weights), "
                               "e.g. 0.999; 0 = off", type=decay, metavar="D")
    max_steps: int = setting(0, "stop after this many optimizer steps in total, 0 = no limit",
                             low=0)
    deterministic: bool = setting(False, "deterministic algorithms only (slower on GPU; an error "
                                  "names any op without one)")
    compile: bool = setting(False, "torch.compile the model")
    activation_checkpointing: bool = setting(False, "each block keeps only its input for the "
                                             "backward pass and runs again there: less memory, "
                                             "about a third more compute")
    find_unused_parameters: bool = setting(False, "DDP find_unused_parameters (only for models "
                                           "with unused branches)")
    check_replicas_every: int = setting(100, "compare the ranks' weights every N steps, as at "
                                        "every save (0: at saves only)", low=0)

    bucket_cap_mb: float | None = setting(None, "size of DDP's gradient buckets, each all-reduced "
                                          "as soon as its gradients are ready (default: DDP's 25, "
                                          "with a first bucket of 1)",
                                          type=number("float", 0, 4096.0, above=True))
    static_graph: bool = setting(False, "DDP static_graph: the same parameters are used in every "
                                 "step")
    gradient_as_bucket_view: bool = setting(True, "gradients live inside DDP's buckets (no copy "
                                            "in and out)", action=argparse.BooleanOptionalAction)
    comm_hook: str = setting("none", "none: all-reduce as is; bf16/fp16: send half the bytes; "
                             "powersgd: low-rank compression", choices=COMM_HOOKS)
    powersgd_rank: int = setting(1, "--comm-hook powersgd: rank of each gradient's "
                                 "approximation", low=1, high=64)
    powersgd_warmup_steps: int = setting(1000, "--comm-hook powersgd: steps of plain all-reduce "
                                         "before compression", low=2)

    data: str | None = setting(None, "your data on disk instead of the synthetic set (task.py "
                               "reads it)", metavar="PATH")
    val_fraction: float = setting(0.1, "share of the data held out and evaluated after every "
                                  "epoch, 0 = none", type=fraction)
    num_workers: int = setting(0, "DataLoader worker processes per rank (0: batches are made "
                               "in-process)", low=0, high=64)
    data_on_device: str = setting("auto", "auto: on a GPU, an in-memory data set that takes at "
                                  "most a quarter of the free memory lives there (no copy per "
                                  "step; --num-workers 0 only)", choices=["auto", "never"])
    shard_cache: str = setting("~/.cache/shards", "--data at a URL: the folder on this machine "
                               "that keeps its shards while they are used", metavar="PATH")
    shard_cache_gb: float = setting(50.0, "the most --shard-cache holds (least recently used "
                                    "shards go)", type=number("float", 0, 1e6, above=True))
    shuffle_window: int = setting(16, "--data a shard set: its samples are shuffled across this "
                                  "many shards at a time (and the shards too)", low=1)
    sync_bn: bool = setting(False, "convert BatchNorm to SyncBatchNorm (CUDA only; a warning on "
                            "CPU)")
    model_layout: str = setting(DEFAULT_MODEL_LAYOUT, "one device per process (DDP), the model "
                                "split over two devices per process, parameters sharded across "
                                "ranks (FSDP2)" + (", or also split (tensor_parallel)"
                                                   if TENSOR_PARALLEL else ""), choices=LAYOUTS)
    stage_devices: list[str] = setting([], "model_parallel_2: the two devices of this process, "
                                       "e.g. cuda:0,cuda:1", type=device_pair, metavar="DEV0,DEV1")
    shard_group_size: int = setting(0, "fsdp: shard the model over groups of N ranks and "
                                    "replicate it across the groups (HSDP); 0 = one node's ranks "
                                    "when the job spans several nodes, else all ranks (plain "
                                    "fsdp)", low=0, metavar="N")
    if TENSOR_PARALLEL:
        tp_size: int = setting(2, "tensor_parallel: ranks that split each layer of task.py's "
                               "plan, consecutive (keep them in a node; one process: 1)", low=1,
                               metavar="N")

    backend: str = setting(DEFAULT_BACKEND, "auto = nccl when CUDA GPUs are visible, else gloo",
                           choices=["auto", "nccl", "gloo"])
    init_method: str = setting(DEFAULT_INIT_METHOD, "env, tcp, file, tcp://HOST:PORT, "
                               "file:///path or a path like ./store", metavar="METHOD")
    timeout_s: float = setting(300.0, "seconds any wait for the other ranks may take before the "
                               "run fails", low=1, high=7 * 24 * 3600)
    nprocs: int = setting(1, "start this many processes with mp.spawn (only without a "
                          "launcher)", low=1, high=1024)
    local_rank: int | None = setting(None, "set by the legacy torch.distributed.launch; "
                                     "LOCAL_RANK from the environment wins", low=0,
                                     flags=["--local-rank", "--local_rank"], in_file=False)

    checkpoint_dir: str = setting("checkpoints", "where checkpoints are written")
    save_every: int = setting(1, "save every N epochs, 0 = only at the end", low=0)
    save_every_steps: int = setting(0, "also save every N optimizer steps, 0 = off", low=0)
    keep_last: int = setting(3, "checkpoints of this run to keep, 0 = keep all", low=0)
    resume: str = setting("auto", "auto = newest complete checkpoint in --checkpoint-dir, if "
                          "any; weights-only = its model and EMA, with fresh optimizers and "
                          "position", metavar="{auto,never,weights-only,PATH}")
    async_save: bool = setting(False, "write checkpoints in the background while training goes on")
    output_dir: str = setting("runs/latest", "metrics.jsonl, summary.json and config.json go here")
    run_name: str | None = setting(None, "outputs in runs/NAME and checkpoints in "
                                   "checkpoints/NAME (unless --output-dir / --checkpoint-dir "
                                   "are given)", type=folder_name)
    eval_every_steps: int = setting(0, "also evaluate every N optimizer steps (0: only at the end "
                                    "of each epoch and of the run)", low=0)
    eval_only: bool = setting(False, "evaluate the --resume checkpoint, write "
                              "<output-dir>/eval.json, change nothing")
    keep_best: str | None = setting(None, "also keep the checkpoint with the best METRIC (e.g. "
                                    "val_accuracy:max), whatever --keep-last says", type=goal_flag,
                                    metavar="METRIC[:max|min]")
    early_stop: str | None = setting(None, "stop when METRIC has not improved for PATIENCE "
                                     "evaluations", type=early_stop_flag,
                                     metavar="METRIC[:max|min]:PATIENCE")
    log_every: int = setting(10, "log every N optimizer steps", low=1)
    step_times: str | None = setting(None, "write rank 0's wall-clock time at the end of every "
                                     "optimizer step (on a GPU also each step's CUDA-event time) "
                                     "to this JSON file", metavar="PATH")
    profile_steps: str | None = setting(None, "record a torch.profiler trace of these optimizer "
                                        "steps on rank 0 into <output-dir>/profile/",
                                        type=step_range, metavar="FIRST:LAST")
    tracker: str = setting(DEFAULT_TRACKER, "where metrics go besides metrics.jsonl (rank 0 only)",
                           choices=TRACKERS)
    progress: bool = setting(True, "no progress bar (default: a bar on rank 0 where tqdm is "
                             "installed)", flags=["--no-progress"], action="store_false")
    config: str | None = setting(None, "a TOML file of flag values (keys like the flags without "
                                 "--); flags given on the command line win", metavar="PATH",
                                 in_file=False)
    task: Any = field(default_factory=NoSettings)  # task.py's Settings
    # Fields set by a flag or the --config file rather than left at their default ("task.x" for a
    # task setting): a resumed run keeps the earlier run's retention unless it is given again.
    given: list[str] = field(default_factory=list)
    total_steps: int = 0  # the run's optimizer steps, set at its start (for a schedule's length)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, so a checkpoint loads with `weights_only=True`."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(saved: dict[str, Any], settings: type | None) -> Config:
        """The Config a checkpoint was saved with (what `to_dict` wrote), with task.py's
        `Settings` (None: it declares none); fields this version does not know are left out,
        missing ones keep their defaults."""
        names = {f.name for f in dataclasses.fields(Config)} - {"task"}
        settings = settings or NoSettings
        task_names = {f.name for f in dataclasses.fields(settings)}
        task = {k: v for k, v in saved.get("task", {}).items() if k in task_names}
        return Config(**{k: v for k, v in saved.items() if k in names}, task=settings(**task))


def parse_args(argv: list[str] | None, settings: type | None, warn: bool = True) -> Config:
    """Flags (and --config) into a Config, with task.py's `Settings` (None: it declares none) in
    `cfg.task`. Bad values exit with code 2 and one `error:` line; `warn`: say what is unused."""
    parser, args, given = read_flags(argv, Config, settings)
    task_values = {key[5:]: args.pop(key) for key in list(args) if key.startswith("task.")}
    if args["run_name"]:  # several runs side by side, each resuming its own checkpoints
        for key, parent in (("output_dir", "runs"), ("checkpoint_dir", "checkpoints")):
            if key not in given:
                args[key] = f"{parent}/{args['run_name']}"
    cfg = Config(**args, task=(settings or NoSettings)(**task_values), given=given)
    for problem in problems(cfg):
        parser.fail(problem)
    if warn and local_rank_from_env() == 0:
        for warning in unused_settings(cfg):
            print_warning(warning)
    return cfg


# Flags that change only DDP, fsdp or --comm-hook powersgd: (flags, whether they act, else why).
ONLY_WITH = (
    (("bucket_cap_mb", "static_graph", "gradient_as_bucket_view", "comm_hook"),
     lambda cfg: cfg.model_layout in ("data_parallel", "model_parallel_2"),
     "with --model-layout {} (FSDP exchanges gradients itself, without DDP)"),
    (("shard_group_size",), lambda cfg: cfg.model_layout == "fsdp", "without --model-layout fsdp"),
    (("tp_size",), lambda cfg: cfg.model_layout == "tensor_parallel",
     "without --model-layout tensor_parallel"),
    (("powersgd_rank", "powersgd_warmup_steps"), lambda cfg: cfg.comm_hook == "powersgd",
     "without --comm-hook powersgd"),
    (("min_lr",), lambda cfg: cfg.lr_schedule != "constant", "with --lr-schedule constant"))


def unused_settings(cfg: Config) -> list[str]:
    """Settings given (or, for the task's, changed from their default) that do nothing with the
    rest of the run."""
    found = [f"--{name.replace('_', '-')} has no effect {why.format(cfg.model_layout)}"
             for names, acts, why in ONLY_WITH
             if not acts(cfg) for name in names if name in cfg.given]
    for f in dataclasses.fields(cfg.task):
        other = f.metadata.get("unused_with")
        value = getattr(cfg.task, f.name)
        if other and getattr(cfg, other) not in (None, False) and value != f.default:
            found.append(f"--{f.name.replace('_', '-')} {value} has no effect with --{other} "
                         f"{getattr(cfg, other)}")
    return found


def problems(cfg: Config) -> list[str]:
    """Combinations of values that cannot work, found before any work starts."""
    found = []
    if "://" in cfg.output_dir:  # as a path it would be a local folder named like the bucket
        return [f"--output-dir {cfg.output_dir.split('://')[0]}://...: metrics are written to a "
                "local folder; give a path (checkpoints take a URL: --checkpoint-dir)"]
    for flag, value in (("--checkpoint-dir", cfg.checkpoint_dir), ("--resume", cfg.resume)):
        if why := storage.url_problem(value):
            return [f"{flag} {storage.redact(value)}: {why}"]
    if cfg.data is not None and (why := storage.url_problem(cfg.data)):
        found.append(f"--data {storage.redact(cfg.data)}: {why}")
    elif cfg.data is not None and not storage.is_url(cfg.data) and not Path(cfg.data).exists():
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
    if cfg.sync_bn and cfg.model_layout in SHARDED:
        found.append(f"--sync-bn does not work with --model-layout {cfg.model_layout}; drop it")
    if cfg.min_lr > cfg.lr:
        found.append(f"--min-lr {cfg.min_lr} is above --lr {cfg.lr}: give at most --lr")
    if (cfg.resume not in ("auto", "never", "weights-only") and not storage.is_url(cfg.resume)
            and not Path(cfg.resume).exists()):
        found.append(f"--resume {cfg.resume}: no such file or folder; use --resume auto or "
                     "--resume never")
    return found
