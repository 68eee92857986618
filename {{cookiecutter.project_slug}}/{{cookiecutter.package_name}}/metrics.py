"""Rank 0's record of the run: metrics.jsonl always, TensorBoard when asked, summary.json at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .distributed import SetupError


class MetricsWriter:
    """Writes nothing on ranks other than 0, so callers need not check the rank."""

    def __init__(self, output_dir: str | Path, enabled: bool, tracker: str = "none", append: bool = False) -> None:
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # A resumed run continues the same curve; a fresh run starts a new one.
        self._file = open(self.output_dir / "metrics.jsonl", "a" if append else "w", encoding="utf-8")
        if tracker == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise SetupError("--tracker tensorboard needs the tensorboard package: "
                                 "pip install tensorboard (or use --tracker none)") from None
            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "epoch") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, record["step"])

    def write_summary(self, summary: dict[str, Any]) -> Path | None:
        if not self.enabled:
            return None
        path = self.output_dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
