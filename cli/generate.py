"""Generate a completion for one prompt and print it (streamed with --stream).

Sampling defaults are the model's, as `serve` takes them (`--generation-config auto`: SmolLM2's
card says temperature 0.2, top-p 0.9); a flag given wins, and `--greedy` is temperature 0.  Only
the answer goes to stdout; logs go to stderr from warning up unless `--log-level info`.
Everything that needs no weights (the sampling values, the prompt's length against the model's
context, the log path) is checked before the weights load.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any, TextIO

from memstep.cli.help_format import groups
from memstep.cli.main import add_engine_arguments, config_from_args
from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.generation_config import sampling_defaults
from memstep.core.model_source import model_config, resolve
from memstep.core.prompt_checks import check_prompt
from memstep.core.sampling_params import SamplingParams
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
    """The sampling flags of `generate` and `chat`; those not given take the model's defaults
    (--generation-config), then SamplingParams' (vLLM's)."""
    g.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N", help="at most")
    g.add_argument(
        "--temperature", type=float, metavar="T", help="0: greedy (default: the model's)"
    )
    g.add_argument("--greedy", action="store_true", help="temperature 0: the likeliest tokens")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus mass (default: the model's)")
    g.add_argument("--top-k", type=int, metavar="K", help="0 disables (default: the model's)")
    g.add_argument(
        "--sampling-seed",
        "--request-seed",
        dest="request_seed",
        type=int,
        metavar="N",
        help="this request's seed (default: drawn from the engine-wide --seed)",
    )


def sampling_params(args: argparse.Namespace, defaults: dict[str, Any]) -> SamplingParams:
    """The flags' params over the model's `defaults`; an InvalidRequest (one line, exit 2) for
    a bad value."""
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    if args.greedy:
        given["temperature"] = 0.0
    given |= {"max_tokens": args.max_tokens, "seed": args.request_seed}
    return SamplingParams(**{**defaults, **{k: v for k, v in given.items() if v is not None}})


def model_defaults(cfg: EngineConfig) -> dict[str, Any]:
    """The model's sampling defaults under `--generation-config`, read without its weights."""
    source = resolve(cfg.model, cfg.random_weights_seed, cfg.tokenizer)
    return sampling_defaults(source, cfg.generation_config)


def preflight_tokenizer(cfg: EngineConfig) -> tuple[Tokenizer, int, int]:
    """The model's tokenizer, vocabulary size and context, from its files, without its weights."""
    source = resolve(cfg.model, cfg.random_weights_seed, cfg.tokenizer)
    mc = model_config(source)
    tokenizer = load_tokenizer(source, mc.vocab_size, mc.eos_token_ids)
    return tokenizer, mc.vocab_size, max_model_len(cfg, mc)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, max_num_seqs=1)
    params = sampling_params(args, model_defaults(cfg))
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
    return Answer(engine).run(prompt, params, out)


class Answer:
    """One request run to its end in the engine; with `stoppable`, Ctrl-C (SIGINT) ends the
    answer between two steps, never inside one, instead of the program."""

    def __init__(self, engine: Engine, stoppable: bool = False):
        self.engine = engine
        self.stoppable = stoppable
        self.stopped = False

    def run(
        self, prompt: list[int], params: SamplingParams, out: TextIO | None
    ) -> tuple[str, list[int]]:
        if not self.stoppable:
            return self._run(prompt, params, out)
        before = signal.signal(signal.SIGINT, self._stop)
        try:
            return self._run(prompt, params, out)
        finally:
            signal.signal(signal.SIGINT, before)

    def _stop(self, signum: int, frame: object) -> None:
        self.stopped = True

    def _run(
        self, prompt: list[int], params: SamplingParams, out: TextIO | None
    ) -> tuple[str, list[int]]:
        engine = self.engine
        rid = engine.add_request(prompt, params)
        text, ids, aborted = "", list[int](), False
        while engine.has_work():
            if self.stopped and not aborted:
                engine.abort(rid)
                aborted = True
                continue
            text_now, ids_now = self._step(rid, out)
            text, ids = text + text_now, ids + ids_now
        if out is not None:
            out.write("\n")
        return text, ids

    def _step(self, rid: str, out: TextIO | None) -> tuple[str, list[int]]:
        text, ids = "", []
        for step_out in self.engine.step():
            if step_out.request_id != rid:
                continue
            text += step_out.new_text
            ids += step_out.new_token_ids
            if out is not None:
                out.write(step_out.new_text)
                out.flush()
        return text, ids
