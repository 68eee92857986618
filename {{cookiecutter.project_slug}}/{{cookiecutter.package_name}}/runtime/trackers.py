"""Where metrics go (rank 0 only): `MetricsWriter` writes metrics.jsonl, summary.json and
config.json, and logs to an experiment tracker (TensorBoard, Weights & Biases or MLflow): a small
class with `log(record)` and `close()`, and `run_id` where the tracker has runs, saved in every
checkpoint so that a resumed run continues the same tracker run. A tracker's package is imported
only when it is chosen; a missing one is one `error:` line."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from ..failures import UsageError, warn

NOT_SCALARS = ("step", "epoch")
PROJECT = "{{ cookiecutter.project_slug }}"  # the W&B project and MLflow experiment by default


class MetricsWriter:
    def __init__(self, output_dir: str | Path, enabled: bool, tracker: str = "none",
                 append: bool = False, config: dict[str, Any] | None = None,
                 tracker_run_id: str | None = None) -> None:
        self.output_dir, self.enabled, self._file = Path(output_dir), enabled, None
        self.tracker: SafeTracker | None = None
        if not enabled:
            return
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            # A resumed run continues the same curve; a fresh run starts a new one.
            self._file = open(self.output_dir / "metrics.jsonl", "a" if append else "w",
                              encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--output-dir {output_dir}: cannot write there "
                             f"({exc.strerror or exc}); choose a writable folder") from None
        if tracker != "none":
            kind = TRACKERS[tracker]  # continuing the run `tracker_run_id`, if given
            self.tracker = SafeTracker(kind(self.output_dir, config or {}, tracker_run_id))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.tracker is not None:
            self.tracker.log(record)

    def write_json(self, name: str, data: dict[str, Any]) -> Path | None:
        """`name` in the output folder, replaced atomically."""
        if not self.enabled:
            return None
        path = self.output_dir / name
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items()
            if k not in NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _import(module: str, package: str, tracker: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise UsageError(f"--tracker {tracker} needs the {package} package: pip install {package} "
                         "(or use --tracker none)") from None


class TensorBoardTracker:
    run_id = None  # TensorBoard appends to the same folder; there is no run to continue

    def __init__(self, output_dir: Path, config: dict[str, Any], run_id: None = None) -> None:
        module = _import("torch.utils.tensorboard", "tensorboard", "tensorboard")
        self.writer = module.SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        # The TEXT tab shows it; a resumed run adds the configuration it was started with.
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=1, default=str)}\n```")

    def log(self, record: dict[str, Any]) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(f"train/{key}", value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Weights & Biases; with WANDB_MODE=offline, under <output-dir>/wandb/ for `wandb sync`."""

    def __init__(self, output_dir: Path, config: dict[str, Any], run_id: str | None) -> None:
        self.wandb = wandb = _import("wandb", "wandb", "wandb")
        self.run_id = run_id or uuid.uuid4().hex[:12]
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT),
                                  dir=str(output_dir), id=self.run_id, resume="allow",
                                  config=config if run_id is None else None,  # once, at the start
                                  settings=wandb.Settings(console="off", save_code=False))
        except Exception as exc:
            raise UsageError(f"--tracker wandb could not start ({type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc) else ''}); log in "
                             "with `wandb login`, or set WANDB_MODE=offline") from None

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(_scalars(record), step=record["step"], commit=True)

    def close(self) -> None:
        # Training processes end with os._exit: without finish() the run's data is lost.
        self.run.finish()
        self.wandb.teardown()


class MlflowTracker:
    """MLflow (MLFLOW_TRACKING_URI, else <output-dir>/mlflow.db); a resume continues its run."""

    def __init__(self, output_dir: Path, config: dict[str, Any], run_id: str | None) -> None:
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        self.mlflow = mlflow = _import("mlflow", "mlflow-skinny", "mlflow")
        try:
            mlflow.set_tracking_uri(os.environ.get(
                "MLFLOW_TRACKING_URI", f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"))
            if run_id is None:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
                found = mlflow.get_experiment_by_name(name)
                experiment = found.experiment_id if found else mlflow.create_experiment(
                    name, artifact_location=(output_dir / "mlflow-artifacts").resolve().as_uri())
                self.run = mlflow.start_run(experiment_id=experiment)
                mlflow.log_params({k: str(v) for k, v in config.items()})  # once, at the start
            else:
                self.run = mlflow.start_run(run_id=run_id)
        except Exception as exc:
            raise UsageError(f"--tracker mlflow could not start ({type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc) else ''}); check "
                             "MLFLOW_TRACKING_URI") from None
        self.run_id = self.run.info.run_id

    def log(self, record: dict[str, Any]) -> None:
        self.mlflow.log_metrics(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.mlflow.end_run()


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


class SafeTracker:
    """A tracker (a class above) whose failures mid-run are a warning, never the end of the run."""

    def __init__(self, tracker: Any) -> None:
        self.tracker, self.run_id, self.broken = tracker, tracker.run_id, False

    def log(self, record: dict[str, Any]) -> None:
        if self.broken:
            return
        try:
            self.tracker.log(record)
        except Exception as exc:
            self.broken = True
            warn(f"the tracker failed ({exc!r}); metrics.jsonl goes on")

    def close(self) -> None:
        try:
            self.tracker.close()
        except Exception as exc:
            warn(f"closing the tracker failed ({exc!r})")
