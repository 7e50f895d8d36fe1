"""Generate a completion for one prompt and print it."""

from __future__ import annotations

import argparse
import json

from memstep.cli.main import add_engine_arguments, config_from_args
from memstep.core.sampling_params import SamplingParams
from memstep.executors.process.inprocess import local_engine
from memstep.replay.recorder import add_record_arguments, open_recorder


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt (a user message unless --raw)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument(
        "--sampling-seed",
        "--request-seed",
        dest="request_seed",
        type=int,
        default=None,
        help="this request's seed (default: drawn from the engine-wide --seed)",
    )
    p.add_argument("--json", action="store_true", help='print {"text": ..., "token_ids": [...]}')
    add_engine_arguments(p)
    add_record_arguments(p)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, max_num_seqs=1)
    recorder = open_recorder(args)
    engine = local_engine(cfg, sinks=[recorder] if recorder else [])
    prompt = args.prompt
    if not args.raw:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.request_seed,
    )
    (done,) = engine.generate([prompt], params)
    engine.shutdown()
    if recorder:
        recorder.close()
    if args.json:
        print(json.dumps({"text": done.text, "token_ids": done.token_ids}))
    else:
        if engine.source.is_random:
            print(f"[{engine.source.label}]")
        print(done.text)
    return 0
