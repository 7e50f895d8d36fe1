"""`--config FILE.yaml`: a command's flags from a file, as vLLM's `--config`.

The file is a YAML map whose keys are the command's flags, spelled as on the command line without
the dashes (`max-num-seqs: 8`) or with underscores (`max_num_seqs: 8`); an on/off switch takes
true or false (`no-http: true`, or `enable_prefix_caching: false`).  The file's values become the
parser's defaults, so a flag given on the command line wins.  Its content is kept on the parsed
arguments (`config_file`) and recorded in the event log's header.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from memstep.cli.errors import UsageError

NOT_FROM_FILE = ("help", "help_all", "version", "config")


def add_config_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="flags from a YAML file; the command line wins (default: none)",
    )


def config_path(argv: list[str]) -> Path | None:
    """The path after `--config` (or in `--config=PATH`) in `argv`, None when not given."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--config="):
            return Path(arg.partition("=")[2])
    return None


def load(path: Path) -> dict[str, Any]:
    """The file's map; a UsageError (one line) for a file that is not a YAML map."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML ({exc.__class__.__name__})") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a map of flag names to values")
    return {str(k): v for k, v in data.items()}


def apply(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """Set `parser`'s defaults from the file at `path`; its content, for the log header."""
    data = load(path)
    parser.set_defaults(**dict(_default(parser, path, k, v) for k, v in data.items()))
    return data


def _default(parser: argparse.ArgumentParser, path: Path, key: str, value: Any) -> tuple[str, Any]:
    """(dest, value) that a flag on the command line would have set; a required flag that the
    file gives is required no more."""
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    action = by_option.get("--" + key.replace("_", "-"))
    if action is not None and action.nargs == 0:  # a switch named as given: true gives it
        _require(isinstance(value, bool), f"{path}: {key} takes true or false")
        return action.dest, action.const if value else action.default
    if action is None:  # a switch named by what it sets: enable_prefix_caching: false
        action = next((a for a in parser._actions if a.dest == key.replace("-", "_")), None)
    _require(action is not None and action.dest not in NOT_FROM_FILE, f"{path}: no flag {key!r}")
    assert action is not None
    action.required = False
    return action.dest, _converted(action, path, key, value)


def _converted(action: argparse.Action, path: Path, key: str, value: Any) -> Any:
    if action.nargs == 0:
        _require(isinstance(value, bool), f"{path}: {key} takes true or false")
        return value
    try:
        if callable(action.type) and value is not None and not isinstance(value, bool):
            value = action.type(value) if isinstance(value, str) else _number(action, value)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise UsageError(f"{path}: {key}: {exc}") from exc
    choices = action.choices
    _require(not choices or value in choices, f"{path}: {key} must be one of {choices}")
    return value


def _number(action: argparse.Action, value: Any) -> Any:
    """A YAML number for an int or float flag (an int is a float's value too); else as given."""
    if action.type is float and isinstance(value, int):
        return float(value)
    if action.type in (int, float) and not isinstance(value, action.type):  # type: ignore[arg-type]
        raise ValueError(f"expected {action.type.__name__}, got {value!r}")  # type: ignore[union-attr]
    return value


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise UsageError(msg)
