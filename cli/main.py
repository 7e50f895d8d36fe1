"""`memstep` command line: one sub-command per module, each with `add_arguments` and `run`.

Bad input (a missing model, a prompt that is too long, a file that is missing, unreadable, a
directory, not a log, or a malformed dataset) ends with a one-line error and exit code 2, never
a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
import warnings
from collections.abc import Callable

import attrs
import structlog

from memstep.cli import config_file
from memstep.cli.config_file import config_path
from memstep.cli.curve_keys import attach_dashed_keys
from memstep.cli.errors import UsageError
from memstep.cli.help_format import HelpFormatter, Parser, add_help_all, groups
from memstep.core.config import (
    KV_CACHE_DTYPES,
    MATMUL_PRECISIONS,
    PLANTED_LEAKS,
    QUANTIZATIONS,
    ConfigError,
    EngineConfig,
)
from memstep.core.device_limits import Limits, cuda_device_bytes, default_limits
from memstep.core.logging import setup_logging
from memstep.core.model_source import ModelError, model_config, resolve
from memstep.core.sampling_params import InvalidRequest
from memstep.events.log import LogFormatError
from memstep.events.version import VERSION
from memstep.executors.cpu.threads import prefer_passive_wait

TASKS = """Serve, run and debug an LLM whose every engine step is recorded and replayable.

tasks:
  memstep serve                      OpenAI-compatible HTTP API on :8000 and the ZMQ API on :5557
  memstep chat                       talk to the model in the terminal (streams, keeps history)
  memstep generate --prompt "Hi"     one completion (add --stream to see it come)
  memstep bench serve | offline      serving or offline benchmarks
  memstep replay LOG | inspect LOG   replay a recorded event log, or summarise it
  memstep COMMAND --help             a command's everyday flags (--help-all: every flag)
"""
COMMANDS = {  # name -> (module, one-line help); a module is imported only when its command runs
    "generate": ("memstep.cli.generate", "generate a completion for one prompt"),
    "chat": ("memstep.cli.chat", "chat with the model in the terminal"),
    "serve": ("memstep.cli.serve", "serve the OpenAI HTTP API and the ZMQ client API"),
    "bench": ("memstep.cli.bench", "benchmarks: offline, serve"),
    "scenario": ("memstep.cli.scenario", "run a memory-incident scenario"),
    "replay": ("memstep.cli.replay", "replay an event log and compare"),
    "inspect": ("memstep.cli.inspect", "summarise an event log"),
    "plot": ("memstep.cli.plot", "plot memory over steps from an event log"),
    "trace": ("memstep.cli.trace", "write an event log as a Chrome trace (Perfetto)"),
    "export-tokenizer": ("memstep.cli.export_tokenizer", "write a GGUF's tokenizer folder"),
    "train-draft": ("memstep.cli.train_draft", "train the EAGLE-style draft head for a model"),
    "executor": ("memstep.cli.executor", "run tensor-parallel ranks for a core on another machine"),
}
USER_ERRORS = (
    ModelError,
    ConfigError,
    InvalidRequest,
    UsageError,
    LogFormatError,
    MemoryError,
    ConnectionError,
)
# a path that cannot be used (also any OSError that names its file): the user's to fix
PATH_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# one-shot commands print their answer: their logs show from warning up unless --log-level says
QUIET_COMMANDS = {"generate", "chat", "export-tokenizer"}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that map onto EngineConfig fields (defaults come from EngineConfig), by group."""
    d = EngineConfig()
    g = groups(p)
    common, perf = g["common"], g["performance"]
    common.add_argument(
        "--model", default=d.model, help="smollm2, a .gguf, an HF folder, random:<preset>"
    )
    common.add_argument(
        "--tokenizer", metavar="PATH", help="a tokenizer.json or .gguf (default: the model's)"
    )
    common.add_argument(
        "--generation-config",
        default=d.generation_config,
        metavar="MODE",
        help="sampling defaults: auto (model's), vllm, a folder (default: auto)",
    )
    dtypes = ["auto", "float32", "bfloat16", "float16"]
    common.add_argument("--dtype", default=d.dtype, choices=dtypes, help="weights, activations")
    common.add_argument(
        "--device", default=d.device, choices=["auto", "cpu", "cuda"], help="where it runs"
    )
    common.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="prompt + output tokens (default: the model's context, at most 2048)",
    )
    common.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        metavar="N",
        help="seed of requests without one (default: drawn, logged)",
    )
    perf.add_argument(
        "--quantization",
        default=d.quantization,
        metavar="Q",
        help=f"CPU weight-only: {', '.join(QUANTIZATIONS)} (auto: q4 for a GGUF)",
    )
    perf.add_argument(
        "--matmul-precision",
        default=d.matmul_precision,
        choices=MATMUL_PRECISIONS,
        help="q4 products (auto: bfloat16 with AVX512-BF16)",
    )
    perf.add_argument(
        "--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES, help="KV pages"
    )
    perf.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help="requests in a batch at most (default: by device; CPU 16)",
    )
    perf.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help="tokens in one step at most (default: by device; CPU 512)",
    )
    perf.add_argument(
        "--block-size", type=int, default=d.block_size, metavar="N", help="tokens per KV page"
    )
    perf.add_argument("--num-kv-blocks", type=int, metavar="N", help="KV pages (default: sized)")
    perf.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        metavar="F",
        help="share of device memory the engine may plan for",
    )
    perf.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not reuse the KV pages of shared prompt prefixes",
    )
    perf.add_argument("--num-threads", type=int, metavar="N", help="(default: torch's)")
    add_speculation_arguments(perf, d, g["debugging"])
    add_cuda_graph_arguments(perf)
    add_tensor_parallel_arguments(g["distributed"], d)
    add_debugging_arguments(g["debugging"], d)


def add_cuda_graph_arguments(g) -> None:
    g.add_argument(
        "--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run decode eagerly"
    )
    g.add_argument(
        "--no-decode-ahead",
        dest="decode_ahead",
        action="store_false",
        help="CUDA: no decode graph replayed ahead while the core records a step",
    )
    g.add_argument(
        "--no-piecewise-graphs",
        dest="piecewise_graphs",
        action="store_false",
        help="CUDA: prefill and mixed steps eagerly, without piecewise graphs",
    )


def add_debugging_arguments(g, d: EngineConfig) -> None:
    """Flags for tests and post-mortems, shown by --help-all only."""
    g.add_argument(
        "--memory-utilization",
        dest="gpu_memory_utilization",
        type=float,
        metavar="F",
        action=DeprecatedName,
        help="deprecated: --gpu-memory-utilization",
    )
    g.add_argument(
        "--random-weights-seed",
        type=int,
        default=d.random_weights_seed,
        metavar="N",
        help="the weights of random: models",
    )
    g.add_argument(
        "--max-executor-restarts",
        type=int,
        default=d.max_executor_restarts,
        metavar="N",
        help="executor restarts within the window before the engine gives up",
    )
    g.add_argument(
        "--executor-restart-window",
        dest="executor_restart_window_s",
        type=float,
        default=d.executor_restart_window_s,
        metavar="S",
        help="seconds over which executor restarts are counted",
    )
    g.add_argument(
        "--debug-kill-executor-at",
        type=_steps,
        default=d.debug_kill_executor_at,
        metavar="STEPS",
        help="test-only: the executor SIGKILLs itself at these steps (5,12)",
    )
    g.add_argument(
        "--debug-kill-restarted-executor",
        action="store_true",
        help="test-only: every restarted executor SIGKILLs itself in warmup",
    )
    g.add_argument(
        "--debug-plant-leak",
        choices=PLANTED_LEAKS,
        default=d.debug_plant_leak,
        help="test-only: a deliberate leak (states/planted.py), to see the detector fire",
    )


class DeprecatedName(argparse.Action):
    """A flag's former name: sets the new flag's value, with a warning that names the new flag."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        new = "--" + self.dest.replace("_", "-")
        warnings.warn(f"{option_string} is deprecated; use {new}", DeprecationWarning, 2)
        print(f"memstep: warning: {option_string} is deprecated; use {new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_tensor_parallel_arguments(g, d: EngineConfig) -> None:
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=d.tensor_parallel_size,
        metavar="N",
        help="split the model over N ranks (a GPU each)",
    )
    g.add_argument(
        "--distributed-init-method",
        default=d.distributed_init_method,
        metavar="URL",
        help="tcp://HOST:PORT where the ranks meet (default: a free loopback port)",
    )
    g.add_argument(
        "--num-local-ranks",
        type=int,
        default=d.num_local_ranks,
        metavar="N",
        help="ranks started here (default: all); others run `memstep executor`",
    )


def _int_list(example: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated integers, refused with `example` of the form."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected {example}: {text!r}") from exc

    return parse


_steps = _int_list("step numbers like 5,12,20")
_widths = _int_list("tree widths like 3,2,1")


SPECULATION_FIELDS = (
    "speculative_method",
    "num_speculative_tokens",
    "speculative_disable_by_batch_size",
    "speculative_auto_disable",
    "speculative_adaptive_k",
    "draft_layers",
    "draft_model",
    "speculative_tree",
)


def add_speculation_arguments(g, d: EngineConfig | None, more=None) -> None:
    """The flags of SPECULATION_FIELDS; defaults from `d`, or all None when `d` is None (the
    caller keeps its own settings for flags not given). The tuning flags (the automatic
    threshold, adaptive K, trees) go to the group `more` where one is given (--help-all)."""
    more = g if more is None else more
    g.add_argument(
        "--speculative-method", choices=["ngram", "draft", "eagle"], help="(default: no drafts)"
    )
    tokens, layers = (None, None) if d is None else (d.num_speculative_tokens, d.draft_layers)
    g.add_argument(
        "--num-speculative-tokens", type=int, default=tokens, metavar="N", help="drafts per step"
    )
    g.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        metavar="N",
        help="no speculation at N requests or more (default: from step costs)",
    )
    auto, adaptive = (
        (None, None) if d is None else (d.speculative_auto_disable, d.speculative_adaptive_k)
    )
    more.add_argument(
        "--speculative-auto-disable",
        action=argparse.BooleanOptionalAction,
        default=auto,
        help="without --speculative-disable-by-batch-size: stop speculating at the batch sizes "
        "where it measures slower",
    )
    more.add_argument(
        "--speculative-adaptive-k",
        action=argparse.BooleanOptionalAction,
        default=adaptive,
        help="drop a request's drafts per step while they keep failing",
    )
    more.add_argument(
        "--draft-layers", type=int, default=layers, metavar="N", help="layers of the draft model"
    )
    g.add_argument(
        "--draft-model",
        metavar="PATH",
        help="draft: a model (default: the target's first layers); eagle: a head's .npz",
    )
    more.add_argument(
        "--speculative-tree",
        type=_widths,
        default=None if d is None else d.speculative_tree,
        metavar="W,W,...",
        help="eagle: a draft tree, the head's top W candidates at each depth",
    )


def config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The config of the flags given; batch limits not given are chosen for the device
    (core/device_limits.py) and written into the config, so that the log records them."""
    names = {f.name for f in attrs.fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    check_device(values.get("device", "auto"))
    if values.get("max_num_seqs") is None or values.get("max_num_batched_tokens") is None:
        chosen = _device_limits(values)
        if values.get("max_num_batched_tokens") is None:
            values["max_num_batched_tokens"] = chosen.max_num_batched_tokens
        if values.get("max_num_seqs") is None:  # a step never has more rows than tokens
            values["max_num_seqs"] = min(chosen.max_num_seqs, values["max_num_batched_tokens"])
    return EngineConfig(**values)


def check_device(device: str) -> None:
    """`--device cuda` where CUDA cannot run: a ConfigError (one line) now, instead of a
    traceback from the executor once it imports torch."""
    if device != "cuda":
        return
    try:
        build = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("--device cuda: torch is not installed") from None
    if build.endswith("+cpu"):
        raise ConfigError(
            f"--device cuda: this torch ({build}) is a CPU-only build; install a CUDA build "
            "(make test TORCH_SPEC=torch) or use --device cpu"
        )
    if cuda_device_bytes(device) is None:
        raise ConfigError("--device cuda: no GPU found here (nvidia-smi sees none)")


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
        "batch limits",
        max_num_seqs=chosen.max_num_seqs,
        max_num_batched_tokens=chosen.max_num_batched_tokens,
        why=chosen.why,
    )
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
        default=None if defaults else argparse.SUPPRESS,
        help="debug, info, warning, error (default: info; generate/chat: warning)",
    )


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(
        prog="memstep", description=TASKS, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"memstep {VERSION}")
    add_global_arguments(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        if name == command:
            module = importlib.import_module(module_name)
            p.usage = f"memstep {name} [options]"
            p.description = (module.__doc__ or "").strip().split("\n\n")[0]
            p.epilog = getattr(module, "EXAMPLES", None)
            module.add_arguments(p)
            p.set_defaults(run=module.run)
        add_global_arguments(p, defaults=False)
        add_help_all(p)
        config_file.add_config_argument(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prefer_passive_wait()  # before a sub-command imports torch: an in-process executor runs here
    command = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(command)
    argv = attach_dashed_keys(argv)
    try:
        args = parse_with_config(parser, command, argv)
        default = "warning" if command in QUIET_COMMANDS else "info"
        args.log_level = log_level(args.log_level or default)
        setup_logging(args.log_format, args.log_level)
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


def parse_with_config(
    parser: argparse.ArgumentParser, command: str | None, argv: list[str]
) -> argparse.Namespace:
    """The parsed `argv`, with the defaults of `--config FILE.yaml` (cli/config_file.py) set on
    the command's parser first; the file's content as `args.config_file` (None without one)."""
    path = config_path(argv)
    data = None
    if path is not None and command is not None:
        data = config_file.apply(_leaf_parser(parser, command, argv), path)
    args = parser.parse_args(argv)
    args.config_file = None if data is None else {"path": str(path), "values": data}
    return args


def _leaf_parser(
    parser: argparse.ArgumentParser, command: str, argv: list[str]
) -> argparse.ArgumentParser:
    """The parser of `command` (for `bench`, of its mode when one is named in `argv`)."""
    leaf = _subparsers(parser)[command]
    modes = _subparsers(leaf)
    mode = next((a for a in argv if a in modes), None)
    return modes[mode] if mode is not None else leaf


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subs[0].choices) if subs else {}


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
