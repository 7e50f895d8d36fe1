"""`memstep` command line: one sub-command per module, each with `add_arguments` and `run`.

Bad input (a missing model, a prompt that is too long) ends with a one-line error and exit
code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import attrs

from memstep.core.config import ConfigError, EngineConfig
from memstep.core.logging import setup_logging
from memstep.core.model_source import ModelError
from memstep.core.sampling_params import InvalidRequest

COMMANDS = {
    "generate": "memstep.core.generate_cmd",
    "serve": "memstep.core.serve_cmd",
    "bench": "memstep.core.bench_cmd",
    "scenario": "memstep.core.scenario_cmd",
    "replay": "memstep.replay.replay_cmd",
    "inspect": "memstep.replay.inspect_cmd",
    "plot": "memstep.replay.plot_cmd",
}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that map onto EngineConfig fields (defaults come from EngineConfig)."""
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="smollm2, a .gguf file, an HF folder, random:<preset>")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    g.add_argument("--memory-utilization", type=float, default=d.memory_utilization)
    g.add_argument("--speculative-method", choices=["ngram", "draft"], default=None)
    g.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens)
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=None)
    g.add_argument("--draft-layers", type=int, default=d.draft_layers)
    g.add_argument("--draft-model", default=None)
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--seed", type=int, default=d.seed, help="seed of random: weights")


def config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    names = {f.name for f in attrs.fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return EngineConfig(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memstep", description=__doc__)
    parser.add_argument("--log-format", choices=["console", "json"], default="console")
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    try:
        return int(args.run(args) or 0)
    except (ModelError, ConfigError, InvalidRequest, FileNotFoundError, MemoryError) as exc:
        print(f"memstep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
