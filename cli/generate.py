"""Generate a completion for one prompt and print it (streamed with --stream).

Sampling defaults are vLLM's, as everywhere in memstep (temperature 1.0); `--greedy` is
temperature 0.  Everything that needs no model (the sampling values, the prompt's length against
the model's context, the log path) is checked before the model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from memstep.cli.help_format import groups
from memstep.cli.main import add_engine_arguments, config_from_args
from memstep.core.config import EngineConfig
from memstep.core.engine import Engine, check_prompt
from memstep.core.model_source import model_config, resolve
from memstep.core.sampling_params import DEFAULT_TEMPERATURE, SamplingParams
from memstep.core.shapes import max_model_len
from memstep.core.tokenizer import Tokenizer, load_tokenizer
from memstep.replay.recorder import add_record_arguments, open_recorder

EXAMPLES = """examples:
  memstep generate --prompt "What is the capital of France?" --greedy
  memstep generate --prompt "Once upon a time" --raw --stream --max-tokens 200
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    common = groups(p)["common"]
    common.add_argument("--prompt", required=True, help="the prompt (a user message unless --raw)")
    common.add_argument("--raw", action="store_true", help="do not apply the chat template")
    common.add_argument("--stream", action="store_true", help="print the text as it comes")
    common.add_argument("--json", action="store_true", help='print {"text", "token_ids"}')
    add_sampling_arguments(common, max_tokens=64)
    add_engine_arguments(p)
    add_record_arguments(p, more=groups(p)["debugging"])


def add_sampling_arguments(g, max_tokens: int) -> None:
    """The sampling flags of `generate` and `chat`; defaults are SamplingParams' (vLLM's)."""
    g.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N", help="at most")
    g.add_argument(
        "--temperature", type=float, default=DEFAULT_TEMPERATURE, metavar="T", help="0: greedy"
    )
    g.add_argument("--greedy", action="store_true", help="temperature 0: the likeliest tokens")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="0 disables")
    g.add_argument(
        "--sampling-seed", "--request-seed", dest="request_seed", type=int, metavar="N",
        help="this request's seed (default: drawn from the engine-wide --seed)",
    )  # fmt: skip


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The flags' params; an InvalidRequest (one line, exit 2) for a bad value."""
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0 if args.greedy else args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.request_seed,
    )


def preflight_tokenizer(cfg: EngineConfig) -> tuple[Tokenizer, int, int]:
    """The model's tokenizer, vocabulary size and context, from its files, without its weights."""
    source = resolve(cfg.model, cfg.random_weights_seed, cfg.tokenizer)
    mc = model_config(source)
    tokenizer = load_tokenizer(source, mc.vocab_size, mc.eos_token_ids)
    return tokenizer, mc.vocab_size, max_model_len(cfg, mc)


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    cfg = config_from_args(args, max_num_seqs=1)
    tokenizer, vocab, max_len = preflight_tokenizer(cfg)
    messages = [{"role": "user", "content": args.prompt}]
    prompt = tokenizer.encode(args.prompt) if args.raw else tokenizer.encode_chat(messages)
    check_prompt(prompt, params, vocab, max_len)
    recorder = open_recorder(args)
    engine = in_process_engine(cfg, recorder)
    try:
        if engine.source.is_random and not args.json:
            print(f"[{engine.source.label}]")
        out = sys.stdout if args.stream and not args.json else None
        text, ids = stream(engine, prompt, params, out)
    finally:
        engine.shutdown()
        if recorder:
            recorder.close()
    if args.json:
        print(json.dumps({"text": text, "token_ids": ids}))
    elif out is None:
        print(text)
    return 0


def in_process_engine(cfg: EngineConfig, recorder: object) -> Engine:
    """An in-process engine; torch is imported here, after the checks that need no model."""
    from memstep.executors.process.inprocess import local_engine

    return local_engine(cfg, sinks=[recorder] if recorder else [])  # type: ignore[list-item]


def stream(
    engine: Engine, prompt: list[int], params: SamplingParams, out: TextIO | None
) -> tuple[str, list[int]]:
    """Run one request to its end, writing its text to `out` as it comes; (text, token ids)."""
    rid = engine.add_request(prompt, params)
    text, ids = "", []
    while engine.has_work():
        for step_out in engine.step():
            if step_out.request_id != rid:
                continue
            text += step_out.new_text
            ids += step_out.new_token_ids
            if out is not None:
                out.write(step_out.new_text)
                out.flush()
    if out is not None:
        out.write("\n")
    return text, ids
