"""Command-line flags and the run configuration.

The template answers this project was generated with are the constants just below: edit them to
change a default, or pass the matching flag to override it for one run.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

# Answers given when this project was generated.
DEFAULT_BACKEND = "{{ cookiecutter.backend }}"
DEFAULT_INIT_METHOD = "{{ cookiecutter.init_method }}"
DEFAULT_MODEL_LAYOUT = "{{ cookiecutter.model_layout }}"
DEFAULT_TRACKER = "{{ cookiecutter.tracker }}"


@dataclass
class Config:
    """Everything a run needs to know. Built by `parse_args`, saved (as plain types) in checkpoints."""

    epochs: int = 3
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    dataset_size: int = 2048
    data: str | None = None
    val_fraction: float = 0.1
    deterministic: bool = False
    hidden_size: int = 64
    num_layers: int = 2
    batch_norm: bool = False
    sync_bn: bool = False
    num_workers: int = 0
    backend: str = DEFAULT_BACKEND
    init_method: str = DEFAULT_INIT_METHOD
    timeout_s: float = 300.0
    checkpoint_dir: str = "checkpoints"
    save_every: int = 1
    save_every_steps: int = 0
    keep_last: int = 3
    resume: str = "auto"
    precision: str = "fp32"
    grad_accum: int = 1
    clip_grad: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    max_steps: int = 0
    log_every: int = 10
    output_dir: str = "runs/latest"
    step_times: str | None = None
    nprocs: int = 1
    progress: bool = True
    compile: bool = False
    find_unused_parameters: bool = False
    local_rank: int | None = None
    model_layout: str = DEFAULT_MODEL_LAYOUT
    stage_devices: list[str] = field(default_factory=list)
    tracker: str = DEFAULT_TRACKER

    def to_dict(self) -> dict:
        """Plain types only, so a checkpoint loads with `weights_only=True`."""
        return dataclasses.asdict(self)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def _device_list(text: str) -> list[str]:
    devices = [part.strip() for part in text.split(",") if part.strip()]
    if len(devices) != 2:
        raise argparse.ArgumentTypeError(f"expected two devices like cuda:0,cuda:1, got {text!r}")
    return devices


def build_parser() -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(
        description="Train a model with PyTorch DistributedDataParallel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=_positive_int, default=d.epochs, help="passes over the data")
    g.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help="samples per process per step")
    g.add_argument("--lr", type=_positive_float, default=d.lr, help="peak learning rate (AdamW)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    g.add_argument("--lr-schedule", choices=["constant", "cosine"], default=d.lr_schedule,
                   help="constant, or cosine decay to 0 after the warm-up")
    g.add_argument("--warmup-steps", type=_non_negative_int, default=d.warmup_steps, help="linear warm-up steps")
    g.add_argument("--seed", type=int, default=d.seed, help="seeds data, model init and every rank")
    g.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=d.precision,
                   help="autocast dtype; fp16 needs CUDA (it uses a GradScaler)")
    g.add_argument("--grad-accum", type=_positive_int, default=d.grad_accum,
                   help="micro-batches per optimizer step")
    g.add_argument("--clip-grad", type=float, default=d.clip_grad, help="max gradient norm, 0 = off")
    g.add_argument("--max-steps", type=_non_negative_int, default=d.max_steps,
                   help="stop after this many optimizer steps in total, 0 = no limit")
    g.add_argument("--deterministic", action="store_true",
                   help="PyTorch's deterministic algorithms only (slower on GPU; an error names any op without one)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--find-unused-parameters", action="store_true",
                   help="DDP find_unused_parameters (only for models with unused branches; slower)")

    g = p.add_argument_group("data and model")
    g.add_argument("--dataset-size", type=_positive_int, default=d.dataset_size,
                   help="samples in the synthetic data set")
    g.add_argument("--data", default=d.data, metavar="PATH",
                   help="a tensor file holding {'x': inputs, 'y': targets} instead of synthetic data")
    g.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help="share of the data held out and evaluated after every epoch, 0 = none")
    g.add_argument("--num-workers", type=_non_negative_int, default=d.num_workers,
                   help="DataLoader worker processes per rank")
    g.add_argument("--hidden-size", type=_positive_int, default=d.hidden_size, help="MLP width")
    g.add_argument("--num-layers", type=_positive_int, default=d.num_layers, help="hidden layers of the MLP")
    g.add_argument("--batch-norm", action="store_true", help="BatchNorm after each hidden layer of the MLP")
    g.add_argument("--sync-bn", action="store_true",
                   help="convert BatchNorm to SyncBatchNorm (CUDA only; ignored with a warning on CPU)")
    g.add_argument("--model-layout", choices=["data_parallel", "model_parallel_2"], default=d.model_layout,
                   help="one device per process, or the model split over two devices per process")
    g.add_argument("--stage-devices", type=_device_list, default=d.stage_devices, metavar="DEV0,DEV1",
                   help="model_parallel_2: the two devices of this process, e.g. cuda:0,cuda:1")

    g = p.add_argument_group("distributed")
    g.add_argument("--backend", choices=["auto", "nccl", "gloo"], default=d.backend,
                   help="auto = nccl when CUDA GPUs are visible, else gloo")
    g.add_argument("--init-method", default=d.init_method, metavar="METHOD",
                   help="env, tcp, file, tcp://HOST:PORT, file:///path or a plain path to a shared file")
    g.add_argument("--timeout-s", type=_positive_float, default=d.timeout_s,
                   help="seconds a collective may wait before the run fails")
    g.add_argument("--nprocs", type=_positive_int, default=d.nprocs,
                   help="start this many processes with mp.spawn (only without a launcher)")
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None,
                   help="set by the legacy torch.distributed.launch; LOCAL_RANK from the environment wins")

    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint-dir", default=d.checkpoint_dir, help="where rank 0 writes checkpoints")
    g.add_argument("--save-every", type=_non_negative_int, default=d.save_every,
                   help="save every N epochs, 0 = only at the end")
    g.add_argument("--save-every-steps", type=_non_negative_int, default=d.save_every_steps,
                   help="also save every N optimizer steps, 0 = off")
    g.add_argument("--keep-last", type=_non_negative_int, default=d.keep_last,
                   help="checkpoints to keep, 0 = keep all")
    g.add_argument("--resume", default=d.resume, metavar="{auto,never,PATH}",
                   help="auto = newest readable checkpoint in --checkpoint-dir, if any")
    g.add_argument("--output-dir", default=d.output_dir, help="metrics.jsonl and summary.json go here")
    g.add_argument("--log-every", type=_positive_int, default=d.log_every, help="log every N optimizer steps")
    g.add_argument("--step-times", default=d.step_times, metavar="PATH",
                   help="write rank 0's wall-clock time at the end of every optimizer step (on a GPU also "
                        "each step's CUDA-event time) to this JSON file")
    g.add_argument("--tracker", choices=["none", "tensorboard"], default=d.tracker,
                   help="also write metrics to TensorBoard")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse flags into a Config. Bad flags exit with code 2 (argparse)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.data is not None and not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")
    if not 0 <= args.val_fraction < 1:
        parser.error(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    return Config(**vars(args))
