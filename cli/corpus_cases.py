"""The leak corpus's cases: clean traffic shapes, which must give no leak report, and planted
leaks, each of which must be caught (`memstep scenario corpus`, cli/corpus.py runs them).

Each case is a traffic shape (bursts of requests, their prompts and sampling parameters) over an
engine config, small enough that the whole CPU corpus runs in about a minute, and long enough for
the detector's windows to judge it: a clean case's figures get the chance to step up (a new
largest batch, a long prompt, a first structured output, an executor restarted) and stay, which
must read as a high-water mark, never as a leak.
"""

from __future__ import annotations

import attrs

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
GUIDES = (
    {"guided_json": SCHEMA},
    {"guided_regex": r"[a-z]{3,8}( [a-z]{3,8}){2}"},
    {"guided_choice": ["yes", "no", "maybe"]},
)


@attrs.frozen
class Traffic:
    """`num_bursts` bursts of `burst` requests, one burst every `every` engine steps (sooner
    when the engine runs dry), each prompt about `prompt_words` words long."""

    burst: int = 4
    num_bursts: int = 6
    every: int = 16
    prompt_words: int = 12
    max_tokens: int = 16
    params: dict = attrs.Factory(dict)  # further SamplingParams fields
    guided: bool = False  # cycle through GUIDES, one constraint a request


@attrs.frozen
class Case:
    name: str
    traffic: Traffic
    config: dict = attrs.Factory(dict)  # EngineConfig fields over BASE
    plant: str | None = None  # states/planted.py's name; None: clean traffic
    expect: str | None = None  # the report a plant must cause (LeakSuspected.what)
    device: str = "any"  # "cuda": the CUDA half only


BASE = {"dtype": "float32", "max_num_seqs": 16, "max_num_batched_tokens": 256}
EAGLE = {
    "speculative_method": "eagle",
    "num_speculative_tokens": 3,
    "speculative_disable_by_batch_size": 3,
}
STEADY = Traffic(burst=4, num_bursts=5, every=16, max_tokens=16)

CLEAN = (
    Case("bursts-of-16", Traffic(burst=16, num_bursts=4, every=20, max_tokens=12)),
    Case("long-prompts", Traffic(burst=2, num_bursts=5, every=8, prompt_words=500, max_tokens=8)),
    Case(
        "echo-logprobs",
        Traffic(
            burst=4,
            num_bursts=6,
            every=8,
            prompt_words=60,
            max_tokens=8,
            params={"prompt_logprobs": 1, "logprobs": 2},
        ),
    ),
    Case("structured", Traffic(burst=3, num_bursts=5, every=12, max_tokens=16, guided=True)),
    Case(
        "preemption",
        Traffic(burst=6, num_bursts=2, every=30, max_tokens=24),
        {"num_kv_blocks": 24},
    ),
    Case("speculation-on", Traffic(burst=2, num_bursts=5, every=14, max_tokens=24), EAGLE),
    Case("speculation-off", Traffic(burst=2, num_bursts=5, every=14, max_tokens=24)),
    Case("executor-restart", STEADY, {"debug_kill_executor_at": (30,)}),
)
PLANTED = (
    Case("no-spec-hidden-states", STEADY, plant="no_spec_hidden_states", expect="live_growth"),
    Case(
        "spec-holder-hidden-states",
        Traffic(burst=4, num_bursts=3, every=16, max_tokens=24),
        EAGLE,
        plant="spec_holder_hidden_states",
        expect="live_growth",
    ),
    Case("sampler-scratch", STEADY, plant="sampler_scratch", expect="live_growth"),
    Case(
        "tensor-every-100-steps",
        Traffic(burst=2, num_bursts=1, every=1, max_tokens=360),
        plant="tensor_every_100_steps",
        expect="live_growth",
    ),
    Case(
        "fragmenting-scratch",
        STEADY,
        plant="fragmenting_scratch",
        expect="fragmentation",
        device="cuda",
    ),
    Case(
        "host-bytes-4MiB",
        Traffic(burst=4, num_bursts=12, every=6, max_tokens=8),
        plant="executor_host_bytes",
        expect="host_growth",
    ),
    Case(
        "host-bytes-256KiB",
        # 14 bursts: past the host rule's 24 warm-up steps, three rises of a window each on a
        # device that takes a burst in about 5 steps (7 bursts were 36 steps on an H100: silent)
        Traffic(burst=16, num_bursts=14, every=8, max_tokens=4),
        plant="executor_host_bytes_slow",
        expect="host_growth",
    ),
    Case(
        "python-objects",
        Traffic(burst=4, num_bursts=12, every=6, max_tokens=8),
        plant="executor_python_objects",
        expect="host_growth",
    ),
)
CASES = CLEAN + PLANTED
