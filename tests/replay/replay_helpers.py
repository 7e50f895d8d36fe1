"""Shared by the replay tests: a recorded workload, and `memstep <command>` run in-process."""

from __future__ import annotations

import contextlib
import gc
import io
from pathlib import Path

import attrs

from memstep.cli.main import main
from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.executors.model.weights import _load_gguf
from memstep.executors.process.inprocess import local_engine
from memstep.replay.recorder import open_recorder

TOPICS = [
    "the capital of France",
    "a haiku about the sea",
    "what a hash table is",
    "three prime numbers",
    "who wrote Romeo and Juliet",
    "how to say good morning in Spanish",
    "learning the guitar as an adult",
    "why the sky is blue",
    "the boiling point of water",
    "how bees make honey",
    "the tallest mountain on Earth",
]


def mixed_params(i: int, max_tokens: int) -> SamplingParams:
    """Greedy, temperature/top-p/top-k/min-p, penalties, seeds, stop strings, logit biases and
    min_tokens, by turns."""
    seed = 1000 + i
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, seed=seed),
        dict(temperature=1.0, top_k=20, seed=seed),
        dict(temperature=0.7, min_p=0.05, repetition_penalty=1.3, seed=seed),
        dict(temperature=0.9, presence_penalty=0.6, frequency_penalty=0.4, seed=seed),
        dict(temperature=0.0, stop=[" the", "."]),
        dict(temperature=1.2, top_p=0.95, top_k=50, seed=seed, stop=[","]),
        dict(temperature=0.6, seed=seed, logprobs=2, ignore_eos=True),
        dict(temperature=0.9, seed=seed, logit_bias={"7": 3.0, "11": -50}, min_tokens=2),
    ]
    return SamplingParams(max_tokens=max_tokens, **kinds[i % len(kinds)])


def prompt_for(engine: Engine, i: int) -> list[int]:
    """Short questions; every third one repeats itself, which gives n-gram drafts a chance."""
    topic = TOPICS[i % len(TOPICS)]
    if i % 3 == 0:
        return engine.tokenizer.encode(f"Repeat: {topic}, {topic}, {topic}, {topic},")
    return engine.tokenizer.encode(f"Question {i}: tell me about {topic}" + " please" * (i % 4))


@attrs.define
class Workload:
    num_requests: int = 0
    aborted: list[str] = attrs.Factory(list)


def run_waves(
    engine: Engine, waves: list[int], max_tokens: tuple[int, int] = (4, 8), abort_every: int = 9
) -> Workload:
    """Serve `waves` (request counts) one after another, with aborts.

    A wave arrives once the previous one has dwindled to two live requests, so batches grow
    above and shrink below any speculative threshold; every `abort_every` steps the newest live
    request is aborted.  Every decision depends on step numbers and engine state only.
    """
    lo, hi = max_tokens
    done = Workload()
    pending = list(waves)
    while pending or engine.has_work():
        if pending and len(engine.requests) <= 2:
            for _ in range(pending.pop(0)):
                i = done.num_requests
                params = mixed_params(i, lo + i % (hi - lo + 1))
                engine.add_request(prompt_for(engine, i), params, arrival_time=1e9 + i)
                done.num_requests += 1
        if engine.step_no % abort_every == abort_every - 1 and len(engine.requests) > 1:
            newest = max(engine.requests, key=lambda rid: int(rid.split("-")[1]))
            engine.abort(newest)
            done.aborted.append(newest)
        engine.step()
    return done


def isolate_heap() -> None:
    """Make the process look fresh to the live-bytes meter of the next engine built in it.

    On CPU the meter leaves out every tensor alive when a worker is made (whatever earlier tests
    left alive), so it must not find its own weights among them: the weights cached by an earlier
    engine (executors/model/weights.py shares them between the engines of a process) are
    dropped from the cache.  With them, a second engine would report its live bytes without its
    weights
    (538 MB less for SmolLM2) and replay would differ from recording.
    """
    _load_gguf.cache_clear()
    gc.collect()


def record(path: Path, cfg: EngineConfig, waves: list[int], **kwargs) -> Workload:
    """Record a workload to `path` in this process; the engine is gone when this returns."""
    isolate_heap()
    recorder = open_recorder(path)
    assert recorder is not None
    engine = local_engine(cfg, sinks=[recorder])
    try:
        return run_waves(engine, waves, **kwargs)
    finally:
        engine.shutdown()
        recorder.close()
        del engine
        gc.collect()


def memstep(*argv: str) -> tuple[int, str, str]:
    """`memstep ARGS` run in this process through the real CLI: (exit code, stdout, stderr)."""
    isolate_heap()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()
