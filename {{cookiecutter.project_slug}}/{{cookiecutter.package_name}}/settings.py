"""`setting`: one declaration per setting, for `Config` (config.py) and task.py's `Settings`.

config.py builds a --flag, a --config file key and a check from each declaration.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default: Any, help: str, low: float | None = None, unused_with: str | None = None,
            *, high: float | None = None, group: str | None = None, in_file: bool = True,
            **flag: Any) -> Any:
    """One setting, declared once: its default; the one-line help of its --flag; for numbers the
    lowest (and highest) value it accepts; the Config field (e.g. "data") that makes it do
    nothing: set both, and the run starts with a warning. Config's own settings also name their
    section of --help (a key of GROUPS), whether a --config file may set them, and any other
    argparse details of the flag (type, choices, metavar, action, flags)."""
    meta = {"help": help, "low": low, "high": high, "unused_with": unused_with, "group": group,
            "in_file": in_file, "flag": flag}
    if isinstance(default, list):  # a list of its own for every Config
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
