"""vLLM's `serve` flags that memstep's own names do not already cover: each taken with vLLM's
meaning, or refused by name with the reason, so that a command line copied from vLLM's docs
means the same here.

    memstep serve MODEL --host 127.0.0.1 --port 8000 --max-model-len 2048 \\
        --gpu-memory-utilization 0.9 --enable-prefix-caching --served-model-name x --api-key k

`--host`/`--port` are the HTTP server's, as vLLM's (cli/serve.py); the ZMQ API has
`--zmq-host`/`--zmq-port`, and the former `--http-host`/`--http-port` still work, with a
warning.  `--max-model-len`, `--gpu-memory-utilization`, `--served-model-name`, `--api-key`,
`--generation-config`, `--seed`, `--dtype`, `--max-num-seqs`, `--tensor-parallel-size` are
memstep's own flags of the same name and meaning.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import structlog

from memstep.core.config import ConfigError, EngineConfig

UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
MODEL_DEFAULT = EngineConfig().model


class Renamed(argparse.Action):
    """A former flag name: sets the new flag's value, with a warning that names the new one."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kw: Any):
        super().__init__(option_strings, dest, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        message = f"{option_string} is deprecated; use {self.new}"
        warnings.warn(message, DeprecationWarning, 2)
        print(f"memstep: warning: {message}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_arguments(g: Any) -> None:
    """The flags, in `g` (the debugging group: --help-all shows them)."""
    g.add_argument(
        "--http-host",
        dest="http_host",
        action=Renamed,
        new="--host",
        default=argparse.SUPPRESS,
        help="deprecated: --host (the HTTP address)",
    )
    g.add_argument(
        "--http-port",
        dest="http_port",
        action=Renamed,
        new="--port",
        type=int,
        default=argparse.SUPPRESS,
        help="deprecated: --port (the HTTP port)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_true",
        default=argparse.SUPPRESS,
        help="vLLM's: reuse shared prefixes' KV pages (on already)",
    )
    g.add_argument(
        "--enforce-eager",
        dest="cuda_graphs",
        action="store_false",
        default=argparse.SUPPRESS,
        help="vLLM's: no CUDA graphs (as --no-cuda-graphs)",
    )
    g.add_argument(
        "--chat-template",
        metavar="FILE|TEXT",
        help="vLLM's: a Jinja chat template (a file, or the text) instead of the model's",
    )
    g.add_argument(
        "--uvicorn-log-level",
        choices=UVICORN_LEVELS,
        help="vLLM's: the HTTP front's log level (default: --log-level)",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's: no log line per request (the HTTP front logs from warning up)",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="vLLM's: refused, no remote code runs here",
    )


REQUEST_EVENTS = frozenset({"request arrived", "request finished"})  # the core's, per request
REMOTE_CODE = (
    "--trust-remote-code is not supported: no remote code runs here (memstep runs only the "
    "model architectures it implements, from their weights)"
)


def apply(args: argparse.Namespace) -> None:
    """Checks the flags and folds them into memstep's: MODEL into --model, a chat template
    file into its text (the event log records the text), --disable-log-requests into a log
    filter; a ConfigError (one line, exit 2) for what is refused."""
    if args.trust_remote_code:
        raise ConfigError(REMOTE_CODE)
    if args.model_tag is not None:
        if args.model not in (args.model_tag, MODEL_DEFAULT):
            raise ConfigError(f"two models given: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.chat_template is not None:
        path = Path(args.chat_template)
        args.chat_template = path.read_text() if path.is_file() else args.chat_template
    if args.disable_log_requests:
        structlog.configure(processors=[_drop_request_lines, *structlog.get_config()["processors"]])


def front_log_level(args: argparse.Namespace) -> str:
    """The HTTP front's log level: --uvicorn-log-level, else --log-level; from warning up with
    --disable-log-requests (its info lines are one per request)."""
    level = args.uvicorn_log_level or args.log_level
    level = "debug" if level == "trace" else level
    if args.disable_log_requests and level in ("debug", "info"):
        return "warning"
    return str(level)


def _drop_request_lines(logger: Any, name: str, event: MutableMapping[str, Any]) -> Any:
    if event.get("event") in REQUEST_EVENTS:
        raise structlog.DropEvent
    return event
