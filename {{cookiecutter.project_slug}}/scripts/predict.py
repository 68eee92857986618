"""Predict with a trained model: python scripts/predict.py [--raw-weights] CHECKPOINT INPUT [...]

CHECKPOINT: a checkpoint file or folder (a path, or a URL such as s3://bucket/run/ckpt_step...),
or an export (`python -m
{{ cookiecutter.package_name }}.checkpoint export`). The model is built by task.py with the settings
saved in it, and its weights load with weights_only=True (tensors, never code): the EMA's if the
run kept one (--ema-decay), the model's own with --raw-weights. task.predict turns
the inputs (image files, numbers, a prompt: whatever the task reads) into one line of output each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, installed or not

from {{ cookiecutter.package_name }} import task  # noqa: E402
from {{ cookiecutter.package_name }}.checkpoint import storage  # noqa: E402
from {{ cookiecutter.package_name }}.checkpoint.export import model_and_meta  # noqa: E402
from {{ cookiecutter.package_name }}.checkpoint.files import saved_weights  # noqa: E402
from {{ cookiecutter.package_name }}.config import Config  # noqa: E402
from {{ cookiecutter.package_name }}.failures import ProjectError, UsageError  # noqa: E402


def main(argv: list[str]) -> int:
    raw_weights = "--raw-weights" in argv
    argv = [arg for arg in argv if arg != "--raw-weights"]
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    try:
        if not hasattr(task, "predict"):
            raise UsageError("task.py has no predict(model, inputs, cfg); add one (see the "
                             "example tasks)")
        state, meta = model_and_meta(storage.given(argv[0]), raw_weights)
        cfg = Config.from_dict(meta.get("config", {}), getattr(task, "Settings", None))
        model = task.build_model(cfg)
        unfit = f"{argv[0]} does not fit the model task.py builds now"
        if differ := sorted(set(saved_weights(model)) ^ set(state)):
            raise UsageError(f"{unfit} ('{differ[0]}' is in one of them only); use a checkpoint "
                             "of this model")
        try:  # the weights a checkpoint leaves out (a LoRA run's base model) stay as built
            model.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # task.py changed since: load_state_dict's many lines
            detail = (str(exc).splitlines()[1:] or [str(exc)])[0].strip()
            raise UsageError(f"{unfit} ({detail}); use a checkpoint of this model") from None
        model.eval()
        with torch.no_grad():
            for line in task.predict(model, argv[1:], cfg):
                print(line)
    except ProjectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
