"""The two incidents as scenarios on the real model, clean and with a planted leak."""

from __future__ import annotations

from memstep.cli.scenarios import run_scenario
from memstep.events.stretches import stretches
from memstep.events.types import LeakSuspected, StepFinished

SUSTAINED = 2000


def test_spec_disabled_by_batch_size_sustained_is_clean():
    records, rows = run_scenario("spec-disable", SUSTAINED, "smollm2")
    parts = stretches(records)
    no_spec = [s for s in parts if s.kind == "no_spec"]
    assert max(s.num_steps for s in no_spec) >= SUSTAINED, "a sustained stretch of >= 4 requests"
    assert len(no_spec) >= 2 and len([s for s in parts if s.kind == "spec"]) >= 2, "drop and rise"
    for s in no_spec:
        assert s.live_end == s.live_start, f"no_spec stretch from step {s.first_step} grew"
        assert s.ledger_end == s.ledger_start
    assert all(r.verdict == "ok" for r in rows)
    # a high-water mark is information, not a leak
    assert not [r for r in records if isinstance(r, LeakSuspected) and r.is_leak]


def flagged_within_50_steps(plant: str, steps: int) -> LeakSuspected:
    """The first leak report of spec-disable with `plant`, checked: live growth in no_spec,
    within 50 steps of the first no_spec step, and the stretch's verdict LEAK."""
    records, rows = run_scenario("spec-disable", steps, "smollm2", plant=plant)
    first_no_spec = next(
        r.step for r in records if isinstance(r, StepFinished) and r.kind == "no_spec"
    )
    leaks = [r for r in records if isinstance(r, LeakSuspected)]
    assert leaks, "the planted leak went unnoticed"
    assert leaks[0].kind == "no_spec" and leaks[0].what == "live_growth"
    assert first_no_spec <= leaks[0].step < first_no_spec + 50
    assert {r.kind: r.verdict for r in rows}["no_spec"] == "LEAK"
    return leaks[0]


def test_spec_disable_with_the_original_bug_is_flagged_within_50_steps():
    leak = flagged_within_50_steps("no_spec_hidden_states", 120)
    assert "grew: no_spec.previous_hidden_states +" in leak.detail, leak.detail


def test_sampler_rise_after_capture_adds_zero_bytes():
    records, rows = run_scenario("sampler-rise", 64, "smollm2")
    finished = [r for r in records if isinstance(r, StepFinished)]
    sizes = [len(r.sampled) for r in finished]
    assert max(sizes) == 8 and sizes[0] == 1, "batch climbed from 1 to max_num_seqs"
    assert {r.memory.live_bytes for r in finished} == {finished[0].memory.live_bytes}
    assert all(r.verdict == "ok" for r in rows)


def test_sampler_scratch_per_step_is_flagged_within_50_steps():
    records, rows = run_scenario("sampler-rise", 64, "smollm2", plant="sampler_scratch")
    leaks = [r for r in records if isinstance(r, LeakSuspected)]
    assert leaks and leaks[0].kind == "no_spec" and leaks[0].step < 50
    assert rows[0].verdict == "LEAK"


def test_spec_disable_with_the_seed_shape_is_flagged_and_named():
    """The incident in its own shape: with EAGLE the spec kind holds hidden states, and the
    no_spec path appends every step's to that holder. The report names the holder, the
    tensors' shape and dtype."""
    leak = flagged_within_50_steps("spec_holder_hidden_states", 60)
    assert "grew: spec.previous_hidden_states +" in leak.detail, leak.detail
    assert "[4, 576] float32" in leak.detail
