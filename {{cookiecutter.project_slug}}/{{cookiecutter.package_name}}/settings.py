"""Settings, declared once, and the flags built from them.

`setting` declares each setting's default, help and check, for the run's `Config` (config.py) and
task.py's `Settings`; from them alone this module builds every --flag (batch_size: --batch-size),
the --config TOML keys and --help. A bad value, flag or file, is one `error:` line, exit code 2."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import field
from typing import Any, NoReturn

from .failures import local_rank_from_env, say_once_per_node

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a declared dependency there)
    import tomli as tomllib

# The sections of --help, each from its first Config field on (Config declares them in order).
SECTIONS = {
    "epochs": "training",
    "bucket_cap_mb": "DDP's gradient exchange (docs/performance.md says when to change them)",
    "data": "data and model (task.py reads these)", "backend": "distributed",
    "checkpoint_dir": "checkpoints and output"}
SETTING_TYPES = ("int", "float", "bool", "str", "str | None")  # what task.py's Settings may use
_TOML_TYPES = {  # the Python types a --config value may have, by the setting's declared type
    "int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "str | None": (str,),
    "int | None": (int,), "float | None": (int, float), "list[str]": (str, list)}


def setting(default: Any, help: str, low: float | None = None, unused_with: str | None = None,
            *, high: float | None = None, in_file: bool = True, **flag: Any) -> Any:
    """One setting: its default; its --flag's one-line help; for numbers the lowest (and highest)
    value it accepts; the Config field (e.g. "data") that makes it do nothing (set both: a warning).
    Config's own also say whether a --config file may set them, and any other argparse details of
    the flag (type, choices, metavar, action, flags)."""
    meta = {"help": help, "low": low, "high": high, "unused_with": unused_with,
            "in_file": in_file, "flag": flag}
    if isinstance(default, list):  # a list of its own for every Config
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _check(kind: type, ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """A flag's check: the text as `kind`, refused with "must be <rule> <value>" unless `ok`."""
    def parse(text: str) -> Any:
        if not ok(value := kind(text)):
            raise argparse.ArgumentTypeError(f"must be {rule} {value if kind is int else text}")
        return value
    parse.__name__ = "integer" if kind is int else "number"  # argparse: "invalid number value"
    return parse


def number(kind: str, low: float | None = None, high: float | None = None,
           above: bool = False) -> Callable[[str], Any] | None:
    """The check of an int or float setting (None for other kinds): at least `low` (greater than
    it, with `above`) and at most `high`, where given; a float must also be finite."""
    lo, hi = -math.inf if low is None else low, math.inf if high is None else high
    if kind.startswith("int"):
        lo = lo if low is None else int(low)
        limit = (f"at least {lo}" if hi == math.inf else f"at most {hi}" if lo == -math.inf
                 else f"between {lo} and {hi}")
        return _check(int, lambda v: lo <= v <= hi, f"{limit}, got")
    if kind.startswith("float"):
        bound = f"{'greater than' if above else 'at least'} {lo:g}"
        bound += f" and at most {hi:g}" if hi < math.inf else ""
        return _check(float, lambda v: math.isfinite(v) and (v > lo if above else v >= lo)
                      and v <= hi, f"a finite number {bound}, got")
    return None


fraction = _check(float, lambda v: 0 <= v < 1, "at least 0 and below 1, got")
decay = _check(float, lambda v: v == 0 or 0 < v < 1, "0 (off) or between 0 and 1, e.g. 0.999; got")


def folder_name(text: str) -> str:
    if not text or text in (".", "..") or "/" in text or "\\" in text:
        raise argparse.ArgumentTypeError(f"must be a plain folder name (no slashes), got {text!r}")
    return text


def device_pair(text: str) -> list[str]:
    devices = [part.strip() for part in text.split(",") if part.strip()]
    if len(devices) != 2 or not all(d == "cpu" or d.startswith("cuda") for d in devices):
        raise argparse.ArgumentTypeError(f"expected two devices like cuda:0,cuda:1, got {text!r}")
    return devices


def step_range(text: str) -> str:
    first, sep, last = text.partition(":")
    if not (sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise argparse.ArgumentTypeError(f"expected FIRST:LAST optimizer steps like 10:15, got "
                                         f"{text!r}")
    return text


class Parser(argparse.ArgumentParser):
    """argparse, with bad flags as one `error:` line, printed once per node, exit code 2."""

    types: dict[str, str]  # each field's declared type, by dest ("task.<name>": the task's)
    launch_only: set[str]  # dests a --config file may not set: they describe one launch
    help_command = "python train.py --help"  # the doctor's parsers name their own

    def error(self, message: str) -> NoReturn:
        self.fail(f"{message} ({self.help_command} lists the flags)")

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


def build_parser(config: type, settings: type | None) -> Parser:
    """Every flag: one per `setting` of `config` (the run's Config), in its section of --help,
    and one per field of task.py's `Settings` class (None: the task declares none)."""
    p = Parser(description="Train a model with PyTorch DistributedDataParallel.",
               formatter_class=_Help, allow_abbrev=False)  # a flag cut short is refused
    p.types = {f.name: f.type for f in dataclasses.fields(config)}
    p.launch_only = {f.name for f in dataclasses.fields(config)
                     if f.metadata.get("in_file") is False}
    defaults, group = config(), None
    for f in dataclasses.fields(config):
        if "help" not in f.metadata:  # task, given, total_steps: not flags
            continue
        if f.name in SECTIONS:
            group = p.add_argument_group(SECTIONS[f.name])
        implied = ({"action": "store_true"} if f.type == "bool" else
                   {"type": number(f.type, f.metadata["low"], f.metadata["high"])})
        _add_flag(group, f, f.name, getattr(defaults, f.name), implied)
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


def _add_setting(parser: Parser, group: Any, f: dataclasses.Field) -> None:
    """One field of task.py's Settings as a --flag, checked like the project's own flags."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    flag = "--" + f.name.replace("_", "-")
    if f.name in parser.types:
        parser.fail(f"task.py: setting '{f.name}' has the name of a project flag ({flag}); "
                    "rename it in Settings")
    if kind not in SETTING_TYPES:
        parser.fail(f"task.py: setting '{f.name}' is declared as {kind}; task settings are int, "
                    "float, bool, str or str | None")
    if f.default is dataclasses.MISSING:
        parser.fail(f"task.py: setting '{f.name}' has no default; give it one")
    dest = f"task.{f.name}"
    parser.types[dest] = kind
    if kind == "bool":  # --name and --no-name: the default may be either
        implied = {"action": argparse.BooleanOptionalAction}
    else:
        check = number(kind, f.metadata.get("low"), f.metadata.get("high"))
        implied = {"type": check or str, "metavar": kind.split()[0].upper()}
    _add_flag(group, f, dest, f.default, implied)


def config_file_values(path: str, parser: Parser) -> dict[str, Any]:
    """Flag values from a TOML file, converted and checked exactly like command-line flags."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        parser.fail(f"--config {path}: no such file")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        parser.fail(f"--config {path}: not a readable TOML file ({exc})")
    # 'batch-size' -> its action, for every --flag (argparse keeps them only in _actions)
    actions = {option[2:]: action for action in parser._actions
               for option in action.option_strings if option.startswith("--")}
    values: dict[str, Any] = {}
    for key, value in table.items():
        if (action := actions.get(key)) is None or action.dest in parser.launch_only:
            parser.fail(f"--config {path}: unknown key '{key}'; keys are the flags without '--' "
                        "(see --help)")
        dest = action.dest
        expected = _TOML_TYPES[parser.types[dest]]
        if isinstance(value, bool) != (bool in expected) or not isinstance(value, expected):
            kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
                    list: "a string"}
            parser.fail(f"--config {path}: key '{key}' must be {kind[expected[-1]]}, got {value!r}")
        if isinstance(value, bool):
            values[dest] = not value if action.const is False else value  # --no-progress flips
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


def read_flags(argv: list[str] | None, config: type,
               settings: type | None) -> tuple[Parser, dict[str, Any], list[str]]:
    """The parser, every flag's value (the command line's, else the --config file's, else the
    declared default) by dest, and the dests that either of the two set."""
    parser = build_parser(config, settings)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --config, read first
    pre.add_argument("--config")
    config_path = pre.parse_known_args(sys.argv[1:] if argv is None else argv)[0].config
    file_values = config_file_values(config_path, parser) if config_path else {}
    parser.set_defaults(**file_values)
    args = vars(parser.parse_args(argv))
    # What the command line sets: parsed again with a marker for every default.
    unset = object()
    probe = build_parser(config, settings)
    probe.set_defaults(**{a.dest: unset for a in probe._actions if a.dest != "help"})
    given = {key for key, value in vars(probe.parse_args(argv)).items() if value is not unset}
    return parser, args, sorted(set(file_values) | given)
