"""The two production incidents as runnable scenarios, and the per-kind memory verdict.

* `spec-disable`: speculation (EAGLE on smollm2, as in the incident: drafts from the target's
  hidden states) on with `speculative_disable_by_batch_size=2`; traffic keeps at
  least 4 requests running for a long stretch (so steps run as `no_spec`), then drops to one
  (`spec`) and rises again.  Live bytes and the arena ledger at the end of every `no_spec`
  stretch must equal those at its start, to the byte.
* `sampler-rise`: random temperatures and top-p, the batch climbing from 1 to `max_num_seqs`
  after warm-up and capture.  Live memory must not grow at all after the first serving step.

The verdict is computed from the engine's records alone, so a recorded log gives the same table.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events.stretches import stretches
from memstep.events.types import LeakSuspected
from memstep.executors.process.inprocess import local_engine

PROMPTS = [
    "Tell me a long story about a lighthouse keeper and the sea.",
    "Describe, step by step, how bread is made, from flour to loaf.",
    "Write a detailed essay about the history of the printing press.",
    "Explain how a steam engine works, part by part, in great detail.",
    "Give a long list of tips for a first trip to the mountains, with reasons.",
]


@attrs.frozen
class KindVerdict:
    kind: str
    stretches: int
    steps: int
    live_start: int
    live_end: int
    growth: int  # the largest growth within one stretch
    leaks: int
    verdict: str


def verdicts(records: list[object]) -> list[KindVerdict]:
    parts = stretches(records)
    leaks = [r for r in records if isinstance(r, LeakSuspected) and r.is_leak]
    out = []
    for kind in sorted({s.kind for s in parts}):
        mine = [s for s in parts if s.kind == kind]
        n_leaks = sum(1 for leak in leaks if leak.kind == kind)
        clean = all(s.is_clean for s in mine) and n_leaks == 0
        out.append(
            KindVerdict(
                kind,
                len(mine),
                sum(s.num_steps for s in mine),
                mine[0].live_start,
                mine[-1].live_end,
                max(s.growth for s in mine),
                n_leaks,
                "ok" if clean else "LEAK",
            )
        )
    return out


def format_table(rows: list[KindVerdict], leaks: list[LeakSuspected]) -> str:
    head = f"{'kind':<8} {'stretches':>9} {'steps':>6} {'live start':>12} {'live end':>12} "
    head += f"{'growth':>10} {'leaks':>5}  verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.kind:<8} {r.stretches:>9} {r.steps:>6} {r.live_start:>12} {r.live_end:>12} "
            f"{r.growth:>10} {r.leaks:>5}  {r.verdict}"
        )
    for leak in leaks[:5]:
        lines.append(f"leak: step {leak.step} kind {leak.kind} {leak.what}: {leak.detail}")
    return "\n".join(lines)


# --- traffic -------------------------------------------------------------------------------


def _keep_running(engine: Engine, want: int, params: Callable[[int], SamplingParams], n: list):
    running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
    tok = engine.tokenizer
    for _ in range(want - running):
        ids = tok.encode_chat([{"role": "user", "content": PROMPTS[n[0] % len(PROMPTS)]}])
        engine.add_request(ids, params(n[0]), request_id=f"s{n[0]}")
        n[0] += 1


def spec_disable_config(model: str, plant: str | None = None) -> EngineConfig:
    """The seed's mechanism where the model has an EAGLE head (smollm2): drafts from hidden
    states the `spec` kind holds between steps; n-gram drafts elsewhere."""
    return EngineConfig(
        model=model,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=256,
        speculative_method="eagle" if model == "smollm2" else "ngram",
        num_speculative_tokens=3,
        speculative_disable_by_batch_size=2,
        debug_plant_leak=plant,
    )


def drive_spec_disable(engine: Engine, steps: int) -> None:
    """1 request (spec), >= 4 for `steps` steps (no_spec), 1 again, 4 again, then drain."""
    counter = [0]

    def params(i: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=min(400, engine.max_model_len // 2), ignore_eos=True, seed=i
        )

    phases = [(1, 10), (4, steps), (1, 10), (4, max(20, steps // 10))]
    for want, length in phases:
        if want == 1:
            for req in list(engine.scheduler.running)[1:] + list(engine.scheduler.waiting):
                engine.abort(req.request_id)
        for _ in range(length):
            _keep_running(engine, want, params, counter)
            engine.step()
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(req.request_id)
    engine.run_until_idle()


def sampler_rise_config(
    model: str, plant: str | None = None, max_num_seqs: int = 8
) -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype="float32",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=256,
        debug_plant_leak=plant,
    )


def drive_sampler_rise(engine: Engine, steps: int) -> None:
    """Add one request with random temperature / top-p every few steps until the batch is full."""
    rng = random.Random(0)
    top = engine.cfg.max_num_seqs
    counter = [0]

    def params(i: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=min(steps + 8, engine.max_model_len // 2),
            ignore_eos=True,
            seed=i,
            temperature=rng.uniform(0.2, 1.5),
            top_p=rng.uniform(0.5, 1.0),
            top_k=rng.choice([0, 20, 50]),
        )

    every = max(1, steps // top)
    for step in range(steps):
        _keep_running(engine, min(top, 1 + step // every), params, counter)
        engine.step()
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(req.request_id)
    engine.run_until_idle()


SCENARIOS = {
    "spec-disable": (spec_disable_config, drive_spec_disable),
    "sampler-rise": (sampler_rise_config, drive_sampler_rise),
}


def num_driven_steps(name: str, steps: int) -> int:
    """The engine steps scenario `name` drives (the drain after them is a step or two)."""
    if name == "spec-disable":
        return 20 + steps + max(20, steps // 10)
    return steps


def run_scenario(
    name: str,
    steps: int,
    model: str = "smollm2",
    plant: str | None = None,
    sinks=(),
    overrides: dict | None = None,
) -> tuple[list[object], list[KindVerdict]]:
    """Run scenario `name`; `overrides` replace fields of its config (e.g. the proposer)."""
    make_config, drive = SCENARIOS[name]
    records: list[object] = []
    cfg = make_config(model, plant).replace(**(overrides or {}))
    engine = local_engine(cfg, sinks=[records.append, *sinks])
    drive(engine, steps)
    engine.shutdown()
    return records, verdicts(records)
