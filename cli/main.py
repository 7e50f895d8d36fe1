"""`memstep` command line: one sub-command per module, each with `add_arguments` and `run`.

Bad input (a missing model, a prompt that is too long, a file that is missing, unreadable, a
directory, not a log, or a malformed dataset) ends with a one-line error and exit code 2, never
a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import attrs
import structlog

from memstep.cli.curve_keys import attach_dashed_keys
from memstep.cli.errors import UsageError
from memstep.cli.help_format import HelpFormatter
from memstep.core.config import (
    KV_CACHE_DTYPES,
    MATMUL_PRECISIONS,
    QUANTIZATIONS,
    ConfigError,
    EngineConfig,
)
from memstep.core.device_limits import Limits, cuda_device_bytes, default_limits
from memstep.core.logging import setup_logging
from memstep.core.model_source import ModelError, model_config, resolve
from memstep.core.sampling_params import InvalidRequest
from memstep.events.log import LogFormatError
from memstep.executors.cpu.threads import prefer_passive_wait

COMMANDS = {  # name -> (module, one-line help); a module is imported only when its command runs
    "generate": ("memstep.cli.generate", "generate a completion for one prompt"),
    "serve": ("memstep.cli.serve", "serve the OpenAI HTTP API and the ZMQ client API"),
    "bench": ("memstep.cli.bench", "benchmarks: offline, serve"),
    "scenario": ("memstep.cli.scenario", "run a memory-incident scenario"),
    "replay": ("memstep.cli.replay", "replay an event log and compare"),
    "inspect": ("memstep.cli.inspect", "summarise an event log"),
    "plot": ("memstep.cli.plot", "plot memory over steps from an event log"),
    "trace": ("memstep.cli.trace", "write an event log as a Chrome trace (Perfetto)"),
    "export-tokenizer": ("memstep.cli.export_tokenizer", "write a GGUF's tokenizer.json"),
    "train-draft": ("memstep.cli.train_draft", "train the EAGLE-style draft head for a model"),
    "executor": ("memstep.cli.executor", "run tensor-parallel ranks for a core on another machine"),
}
USER_ERRORS = (
    ModelError, ConfigError, InvalidRequest, UsageError, LogFormatError, MemoryError,
    ConnectionError,
)  # fmt: skip
# a path that cannot be used (also any OSError that names its file): the user's to fix
PATH_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that map onto EngineConfig fields (defaults come from EngineConfig)."""
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model", default=d.model, help="smollm2, a .gguf file, an HF folder, random:<preset>"
    )
    g.add_argument(
        "--tokenizer", help="a tokenizer.json or .gguf to use instead of the model's own"
    )
    dtypes = ["auto", "float32", "bfloat16", "float16"]
    g.add_argument("--dtype", default=d.dtype, choices=dtypes, help="weights and activations")
    g.add_argument(
        "--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES, help="KV pages"
    )
    g.add_argument(
        "--quantization",
        default=d.quantization,
        help=f"weight-only quantized CPU matmuls, one of {', '.join(QUANTIZATIONS)} "
        "(auto: q4 for a GGUF, none elsewhere); a bad value is a one-line error",
    )
    g.add_argument(
        "--matmul-precision",
        default=d.matmul_precision,
        choices=MATMUL_PRECISIONS,
        help="q4's products: float32, or rows and weights rounded to bfloat16, summed in float32 "
        "(auto: bfloat16 where the CPU has AVX512-BF16 dot products)",
    )
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"], help="where")
    g.add_argument(
        "--max-num-seqs",
        type=int,
        help="requests in a batch at most (default: from the device; CPU 16, CUDA up to 1024)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="tokens in one step at most (default: from the device; CPU 512, CUDA 8192)",
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
    g.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="compute every prompt in full instead of reusing cached KV pages of shared prefixes",
    )
    add_speculation_arguments(g, d)
    g.add_argument(
        "--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run decode eagerly"
    )
    g.add_argument(
        "--no-decode-ahead",
        dest="decode_ahead",
        action="store_false",
        help="do not replay the next decode step's graph while the core records this step",
    )
    g.add_argument(
        "--no-piecewise-graphs",
        dest="piecewise_graphs",
        action="store_false",
        help="run prefill and mixed steps eagerly, without their piecewise CUDA graphs (each "
        "layer's work outside attention, per token bucket)",
    )
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (None: torch's)")
    add_tensor_parallel_arguments(g, d)
    g.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="engine-wide seed: requests without a seed draw theirs from it "
        "(default: drawn from OS entropy and recorded in the event log)",
    )
    g.add_argument(
        "--random-weights-seed", type=int, default=d.random_weights_seed, help="random: weights"
    )
    g.add_argument(
        "--max-executor-restarts",
        type=int,
        default=d.max_executor_restarts,
        help="executor restarts allowed within the window before the engine gives up",
    )
    g.add_argument(
        "--executor-restart-window",
        dest="executor_restart_window_s",
        type=float,
        default=d.executor_restart_window_s,
        help="seconds over which executor restarts are counted",
    )
    g.add_argument(
        "--debug-kill-executor-at",
        type=_steps,
        default=d.debug_kill_executor_at,
        help="test-only: the executor SIGKILLs itself at these steps, e.g. 5,12,20",
    )
    g.add_argument(
        "--debug-kill-restarted-executor",
        action="store_true",
        help="test-only: every restarted executor SIGKILLs itself in warmup (a crash loop)",
    )


def add_tensor_parallel_arguments(g, d: EngineConfig) -> None:
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=d.tensor_parallel_size,
        help="split the model over this many executor ranks (one GPU each; gloo on CPU)",
    )
    g.add_argument(
        "--distributed-init-method",
        default=d.distributed_init_method,
        help="tcp://HOST:PORT where the ranks meet (default: a free loopback port)",
    )
    g.add_argument(
        "--num-local-ranks",
        type=int,
        default=d.num_local_ranks,
        help="ranks started here (default: all); the others run `memstep executor --rank R`",
    )


def _steps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected step numbers like 5,12,20: {text!r}") from exc


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
        "--speculative-method",
        choices=["ngram", "draft", "eagle"],
        default=None,
        help="None: no drafts",
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
    g.add_argument(
        "--draft-model",
        default=None,
        help="draft: a model (None: the target's first layers); eagle: a head's .npz from "
        "train-draft (None: smollm2's own)",
    )


def config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The config of the flags given; batch limits not given are chosen for the device
    (core/device_limits.py) and written into the config, so that the log records them."""
    names = {f.name for f in attrs.fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    if values.get("max_num_seqs") is None or values.get("max_num_batched_tokens") is None:
        chosen = _device_limits(values)
        if values.get("max_num_batched_tokens") is None:
            values["max_num_batched_tokens"] = chosen.max_num_batched_tokens
        if values.get("max_num_seqs") is None:  # a step never has more rows than tokens
            values["max_num_seqs"] = min(chosen.max_num_seqs, values["max_num_batched_tokens"])
    return EngineConfig(**values)


def _device_limits(values: dict) -> Limits:
    device_bytes = cuda_device_bytes(values.get("device", "auto"))
    model = None
    if device_bytes is not None:
        source = resolve(values.get("model", "smollm2"), 0, values.get("tokenizer"))
        model = model_config(source)
    dtype_bytes = 4 if values.get("dtype") == "float32" else 2
    chosen = default_limits(device_bytes, model, dtype_bytes)
    say = structlog.get_logger("memstep.cli")
    (say.info if device_bytes is not None else say.debug)(  # CPU: the defaults, nothing to say
        "batch limits", max_num_seqs=chosen.max_num_seqs,
        max_num_batched_tokens=chosen.max_num_batched_tokens, why=chosen.why,
    )  # fmt: skip
    return chosen


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
    prefer_passive_wait()  # before a sub-command imports torch: an in-process executor runs here
    command = next((a for a in argv if a in COMMANDS), None)
    args = build_parser(command).parse_args(attach_dashed_keys(argv))
    try:
        setup_logging(args.log_format, log_level(args.log_level))
        return int(args.run(args) or 0)
    except BrokenPipeError:  # piped into a reader that stopped early (`| head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet exit-time flush
        return 141
    except USER_ERRORS as exc:  # ConnectionError among them: BrokenPipeError is caught above
        print(f"memstep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        if exc.filename is None and not isinstance(exc, PATH_ERRORS):
            raise
        print(f"memstep: error: {describe_path_error(exc)}", file=sys.stderr)
        return 2


def log_level(name: str) -> str:
    """The level for setup_logging; a UsageError (one line, exit 2) for a name it does not know."""
    if name.lower() not in LOG_LEVELS:
        raise UsageError(f"--log-level {name!r}: expected one of {', '.join(LOG_LEVELS)}")
    return name.lower()


def describe_path_error(exc: OSError) -> str:
    """`PATH: reason` for an error the OS raised about a file; memstep's own message otherwise."""
    if exc.filename is None or exc.strerror is None:
        return str(exc)
    return f"{exc.filename}: {exc.strerror.lower()}"


if __name__ == "__main__":
    sys.exit(main())
