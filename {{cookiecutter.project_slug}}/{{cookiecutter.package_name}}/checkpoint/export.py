"""Exports: any checkpoint (file, folder, URL) as one file that loads with `weights_only=True`;
for a task.py with `save_pretrained(model_state, cfg, folder)` (hf_causal_lm's), as the folder it
writes, unless OUT ends in .pt; for a task.py with `save_adapter` too, a LoRA run's adapters alone
(its flag: export --help).

    python -m {{ cookiecutter.package_name }}.checkpoint export SRC OUT.pt"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from .. import task
from ..config import Config
from ..ema import model_state
from ..failures import ProjectError, UsageError
from ..settings import Parser
from . import storage
from .files import CHECKPOINT_NAME, load_checkpoint, missing, read_meta, unreadable, write_file
from .storage import AnyPath, RemotePath


def export(source: AnyPath, output: AnyPath, raw_weights: bool = False,
           adapter_only: bool = False) -> None:
    """`source` as one file that loads with `weights_only=True`: `model` (the EMA's weights if the
    run kept one, unless `raw_weights`), `weights` (which), epoch, step, world_size and config."""
    target = output.resolve()  # a link to a checkpoint is that checkpoint
    if target == source.resolve() or any(map(CHECKPOINT_NAME.match, Path(str(target)).parts)):
        raise UsageError(f"{output}: an export may not replace its source or a checkpoint "
                         "(ckpt_step...); write it to another file, such as model.pt")
    model, meta = model_and_meta(source, raw_weights)
    if adapter_only or (hasattr(task, "save_pretrained") and not str(output).endswith(".pt")):
        export_folder(model, meta, output, adapter_only)
        return
    keep = ("epoch", "step", "world_size", "config", "weights")
    write_file({"model": model, **{k: meta[k] for k in keep if k in meta}}, output)


def export_folder(model: dict, meta: dict, output: AnyPath, adapter_only: bool = False) -> None:
    """task.save_pretrained (task.save_adapter with `adapter_only`): the model as a folder of the
    task's own format (a Hugging Face model's), with the settings of the run that saved the
    checkpoint."""
    if isinstance(output, RemotePath):
        raise UsageError(f"{output}: the model's folder is written on this machine: give a "
                         "local folder (and copy it to the bucket), or OUT.pt for one file")
    if output.is_file() or (output.is_dir() and any(output.iterdir())
                            and not (output / "config.json").is_file()):
        raise UsageError(f"{output}: the export writes a folder, and this is a file or a folder "
                         "of other files: give a new folder, or OUT.pt for one file")
    cfg = Config.from_dict(meta.get("config", {}), getattr(task, "Settings", None))
    (task.save_adapter if adapter_only else task.save_pretrained)(model, cfg, output)


def model_and_meta(source: AnyPath, raw_weights: bool = False) -> tuple[dict, dict]:
    """The plain model state_dict of any checkpoint (file, folder or export), the EMA's weights if
    it has one unless `raw_weights`, and its metadata (with `weights`: "ema" or "raw")."""
    try:
        found = source.exists()
    except OSError as exc:  # object storage: credentials, endpoint
        raise UsageError(f"{source}: {storage.diagnosis(str(source), exc)}") from None
    if not found:
        raise UsageError(f"{source}: {missing(source)}")
    if why := unreadable(source):
        raise UsageError(f"{source}: cannot load it ({why})")
    if source.is_dir():  # whole tensors, without a process group
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(storage.local_copy(source)), str(Path(tmp) / "whole.pt"))
            state, meta = load_checkpoint(Path(tmp) / "whole.pt"), read_meta(source)
    else:
        state = meta = load_checkpoint(source)
    averaged = bool(state.get("ema")) and not raw_weights
    return model_state(state, raw_weights), {**meta, "weights": "ema" if averaged else
                                             meta.get("weights", "raw")}


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog=f"python -m {__package__}", allow_abbrev=False)  # one `error:` line
    parser.help_command = f"python -m {__package__} export --help"
    parser.add_argument("command", choices=["export"],
                        help="export: write any checkpoint as one weights_only file (or, for a "
                        "task.py with save_pretrained, as the folder it writes)")
    parser.add_argument("source", help="a checkpoint file or folder: a path or a URL")
    parser.add_argument("output", help="the file to write: a path or a URL; for a task.py with "
                        "save_pretrained, a folder, unless it ends in .pt")
    parser.add_argument("--raw-weights", action="store_true",
                        help="the model's own weights, not the EMA's (for a run with --ema-decay)")
    if hasattr(task, "save_adapter"):  # hf_causal_lm's task.py
        parser.add_argument("--adapter-only", action="store_true",
                            help="a LoRA run's adapters alone (a folder peft loads), not merged "
                            "into the model")
    args = parser.parse_args(argv)
    try:
        export(storage.given(args.source), storage.given(args.output), args.raw_weights,
               getattr(args, "adapter_only", False))
    except ProjectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(args.output)
    return 0
