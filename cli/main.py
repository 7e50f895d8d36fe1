"""`memstep` command line: one sub-command per module, each with `add_arguments` and `run`.

Bad input (a missing model, a prompt that is too long) ends with a one-line error and exit
code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import attrs

from memstep.cli.help_format import HelpFormatter
from memstep.core.config import KV_CACHE_DTYPES, ConfigError, EngineConfig
from memstep.core.logging import setup_logging
from memstep.core.model_source import ModelError
from memstep.core.sampling_params import InvalidRequest

COMMANDS = {  # name -> (module, one-line help); a module is imported only when its command runs
    "generate": ("memstep.cli.generate", "generate a completion for one prompt"),
    "serve": ("memstep.cli.serve", "serve the ZMQ client API"),
    "bench": ("memstep.cli.bench", "benchmarks: offline, serve"),
    "scenario": ("memstep.cli.scenario", "run a memory-incident scenario"),
    "replay": ("memstep.cli.replay", "replay an event log and compare"),
    "inspect": ("memstep.cli.inspect", "summarise an event log"),
    "plot": ("memstep.cli.plot", "plot memory over steps from an event log"),
}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that map onto EngineConfig fields (defaults come from EngineConfig)."""
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model", default=d.model, help="smollm2, a .gguf file, an HF folder, random:<preset>"
    )
    dtypes = ["auto", "float32", "bfloat16", "float16"]
    g.add_argument("--dtype", default=d.dtype, choices=dtypes, help="weights and activations")
    g.add_argument(
        "--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES, help="KV pages"
    )
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"], help="where")
    g.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="requests in a batch at most"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="tokens in one step at most",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="prompt + output tokens at most; beyond the model's context is an error "
        "(None: the model's, capped at 2048)",
    )
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV page")
    g.add_argument(
        "--num-kv-blocks", type=int, default=d.num_kv_blocks, help="KV pages (None: profiled)"
    )
    g.add_argument(
        "--memory-utilization",
        type=float,
        default=d.memory_utilization,
        help="share of device memory the engine may plan for",
    )
    add_speculation_arguments(g, d)
    g.add_argument(
        "--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run decode eagerly"
    )
    g.add_argument(
        "--no-decode-ahead",
        dest="decode_ahead",
        action="store_false",
        help="do not replay the next decode step's graph while the core records this one",
    )
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (None: torch's)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of random: weights")


SPECULATION_FIELDS = (
    "speculative_method",
    "num_speculative_tokens",
    "speculative_disable_by_batch_size",
    "draft_layers",
    "draft_model",
)


def add_speculation_arguments(g, d: EngineConfig | None) -> None:
    """The flags of SPECULATION_FIELDS; defaults from `d`, or all None when `d` is None (the
    caller keeps its own settings for flags not given)."""
    g.add_argument(
        "--speculative-method", choices=["ngram", "draft"], default=None, help="None: no drafts"
    )
    tokens, layers = (None, None) if d is None else (d.num_speculative_tokens, d.draft_layers)
    g.add_argument("--num-speculative-tokens", type=int, default=tokens, help="drafts per step")
    g.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="no speculation while the batch is this large or larger",
    )
    g.add_argument("--draft-layers", type=int, default=layers, help="layers of the draft model")
    g.add_argument("--draft-model", default=None, help="the draft model (None: the target's)")


def config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    names = {f.name for f in attrs.fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return EngineConfig(**values)


def add_global_arguments(p: argparse.ArgumentParser, defaults: bool) -> None:
    """--log-format and --log-level, before the command (with defaults) or after it (without,
    so that a value given before the command is kept)."""
    p.add_argument(
        "--log-format",
        choices=["console", "json"],
        default="console" if defaults else argparse.SUPPRESS,
        help="console for people, json lines for machines (default: console)",
    )
    p.add_argument(
        "--log-level",
        default="info" if defaults else argparse.SUPPRESS,
        help="debug, info, warning or error (default: info)",
    )


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memstep", description=__doc__)
    add_global_arguments(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        add_global_arguments(p, defaults=False)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)
    args = build_parser(command).parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    try:
        return int(args.run(args) or 0)
    except (
        ModelError,
        ConfigError,
        InvalidRequest,
        FileNotFoundError,
        MemoryError,
        ConnectionError,
    ) as exc:
        print(f"memstep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # piped into a reader that stopped early (`| head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet exit-time flush
        return 141


if __name__ == "__main__":
    sys.exit(main())
