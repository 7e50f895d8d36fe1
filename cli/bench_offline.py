"""Offline throughput: memstep against Hugging Face transformers on the same weights and dtype.

Workload (a): one request at a time, 64 new tokens.  Workload (b): real ShareGPT conversations
(vLLM's sample: first turn as prompt, the reply's token count as output length), memstep with
`max_num_seqs` 16 continuous batching, Hugging Face `generate` in left-padded batches of 16.
Both run in this process, one after the other, and the ratio is printed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator

import torch
from tqdm import tqdm

from memstep.cli.datasets import Sample, load_dataset
from memstep.cli.errors import UsageError
from memstep.cli.main import add_engine_arguments, config_from_args
from memstep.cli.progress import Progress, add_progress_argument
from memstep.core.engine import Engine
from memstep.core.model_source import ModelSource, resolve
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import RequestFinished
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime.worker import pick_device, pick_dtype


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-single", type=int, default=4, help="requests for workload (a)")
    p.add_argument(
        "--num-prompts", type=int, default=64, help="conversations for workload (b); 0 skips it"
    )
    p.add_argument("--dataset", default="sharegpt", help="sharegpt, synthetic or a .jsonl file")
    p.add_argument("--batch", type=int, default=16, help="requests run at once")
    p.add_argument("--max-output-len", type=int, default=None, help="cap recorded reply lengths")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--json", default=None, help="write the figures here")
    add_progress_argument(p)
    add_engine_arguments(p)


def hf_model(source: ModelSource, dtype: torch.dtype, quiet: bool):
    if source.kind != "gguf":
        raise UsageError(
            f"bench offline compares against transformers on a GGUF model, not {source.label}; "
            "--skip-hf runs memstep alone"
        )
    import transformers

    assert source.path is not None
    with _gguf_bars_off(quiet):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, dtype=dtype
        )
    return model.eval()


@contextlib.contextmanager
def _gguf_bars_off(quiet: bool) -> Iterator[None]:
    """With --disable-tqdm, no bar from transformers' GGUF conversion either: it calls tqdm
    directly, past transformers' own switch for progress bars."""
    module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    bar = getattr(module, "tqdm", None)
    if not quiet or bar is None:
        yield
        return
    setattr(module, "tqdm", functools.partial(bar, disable=True))  # noqa: B010
    try:
        yield
    finally:
        setattr(module, "tqdm", bar)  # noqa: B010


def hf_generate(model, batch: list[list[int]], new_tokens: int) -> int:
    """Left-padded batch generate, greedy; returns tokens generated per row."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out.shape[1] - width


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextlib.contextmanager
def requests_bar(engine: Engine, total: int, desc: str, quiet: bool) -> Iterator[None]:
    """A bar of the engine's finished requests, on stderr, while the block runs."""
    with Progress(total, desc, "req", RequestFinished, quiet) as bar:
        engine.sinks.append(bar)
        try:
            yield
        finally:
            engine.sinks.remove(bar)


def run_single(
    engine: Engine, model, prompts: list[list[int]], new_tokens: int, quiet: bool
) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate([*prompts[:1]], SamplingParams(temperature=0.0, max_tokens=4))  # warm
    with requests_bar(engine, len(prompts), "(a) memstep", quiet):
        ours = [timed(lambda p=p: engine.generate([p], params)) for p in prompts]
    out = {"memstep_tok_s": new_tokens / statistics.median(ours)}
    if model is not None:
        hf_generate(model, prompts[:1], 4)
        rows = tqdm(prompts, "(a) transformers", unit="req", disable=quiet)
        theirs = [timed(lambda p=p: hf_generate(model, [p], new_tokens)) for p in rows]
        out["hf_tok_s"] = new_tokens / statistics.median(theirs)
        out["ratio"] = out["memstep_tok_s"] / out["hf_tok_s"]
    return out


def run_sharegpt(engine: Engine, model, samples: list[Sample], batch: int, quiet: bool) -> dict:
    tok = engine.tokenizer
    prompts = [tok.encode(s.prompt) for s in samples]
    params = [
        SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True) for s in samples
    ]
    useful = sum(s.output_len for s in samples)
    with requests_bar(engine, len(prompts), "(b) memstep", quiet):
        ours = timed(lambda: engine.generate([*prompts], params))
    out = {"output_tokens": useful, "memstep_s": ours, "memstep_tok_s": useful / ours}
    if model is not None:

        def hf_all() -> None:
            starts = range(0, len(prompts), batch)
            for i in tqdm(starts, "(b) transformers", unit="batch", disable=quiet):
                rows = samples[i : i + batch]
                hf_generate(model, prompts[i : i + batch], max(s.output_len for s in rows))

        theirs = timed(hf_all)
        out.update(hf_s=theirs, hf_tok_s=useful / theirs, ratio=theirs / ours)
    return out


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, max_num_seqs=args.batch)
    dtype = pick_dtype(cfg, pick_device(cfg))
    # Hugging Face first: the engine's CPU memory meter then leaves its tensors out and freezes
    # its objects with the rest of start-up, instead of walking them after every step
    source = resolve(cfg.model, cfg.random_weights_seed)
    model = None if args.skip_hf else hf_model(source, dtype, args.disable_tqdm)
    engine = local_engine(cfg)
    threads = torch.get_num_threads()
    print(f"model {engine.source.label}, dtype {dtype}, {threads} threads, device {cfg.device}")
    tok = engine.tokenizer
    samples = load_dataset(args.dataset, args.num_prompts + args.num_single, tok, seed=0)
    if args.max_output_len:
        cap = args.max_output_len
        samples = [Sample(s.prompt, s.prompt_len, min(s.output_len, cap)) for s in samples]
    singles = [tok.encode(s.prompt) for s in samples[: args.num_single]]
    a = run_single(engine, model, singles, 64, args.disable_tqdm)
    print(f"(a) one at a time, 64 tokens: memstep {a['memstep_tok_s']:.1f} tok/s", end="")
    print(f", HF {a['hf_tok_s']:.1f} tok/s, ratio {a['ratio']:.2f}x" if model else "")
    b = {}
    if args.num_prompts:
        b = run_sharegpt(engine, model, samples[args.num_single :], args.batch, args.disable_tqdm)
        print(
            f"(b) {len(samples) - args.num_single} {args.dataset}, {b['output_tokens']} output "
            "tokens: "
            f"memstep {b['memstep_tok_s']:.1f} tok/s",
            end="",
        )
        print(f", HF {b['hf_tok_s']:.1f} tok/s, ratio {b['ratio']:.2f}x" if model else "")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"single": a, "sharegpt": b}, fh, indent=2)
    if "triton" in sys.modules:
        atexit.register(_quiet_exit)
    return 0


def _quiet_exit() -> None:
    """Silence stderr for the interpreter's teardown, after everything this run has to say.

    triton's nanobind extension (imported by transformers) reports the objects it still holds when
    the interpreter exits ("nanobind: leaked 4 instances! ... leaked 514 functions!"): harmless
    for a module nobody unloads, and alarming at the end of a memory-leak tool's benchmark."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
