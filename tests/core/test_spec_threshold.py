"""The automatic speculation threshold, decided from synthetic step costs: spec off from the
smallest batch-size bucket where it makes fewer tokens per second, probes that keep both kinds
measured (a step that re-enters spec not counted), a margin before it comes back on, and the
user's threshold winning."""

from __future__ import annotations

import pytest

from memstep.core.config import EngineConfig
from memstep.core.spec_threshold import (
    DECISIVE,
    DISABLE_RATIO,
    HOLD_STEPS,
    MAX_PROBE_PERIOD,
    MIN_SAMPLES,
    PAIRED,
    PROBE_BUDGET,
    PROBE_PERIOD,
    PROBE_STEPS,
    WINDOW,
    SpecThreshold,
    bucket_of,
    probe_gaps,
)

SPEC = EngineConfig(model="random:tiny", speculative_method="ngram", num_speculative_tokens=3)


def feed(kinds: SpecThreshold, batch: int, spec: tuple[int, float], plain: tuple[int, float]):
    """MIN_SAMPLES decode steps of each kind at `batch` ((tokens, seconds) each), no_spec first:
    the spec step that re-enters the kind after them is not counted, so it costs a day."""
    for _ in range(MIN_SAMPLES):
        kinds.observe("no_spec", batch, True, *plain)
    kinds.observe("spec", batch, True, spec[0], 86400.0)
    for _ in range(MIN_SAMPLES):
        kinds.observe("spec", batch, True, *spec)


def test_buckets_are_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 7, 8, 15, 16, 255, 256)] == [
        1,
        2,
        2,
        4,
        4,
        8,
        8,
        16,
        128,
        256,
    ]


def test_spec_goes_off_from_the_smallest_bucket_where_it_loses():
    kinds = SpecThreshold(SPEC)
    assert kinds.is_auto and kinds.decide() is None  # nothing measured: spec everywhere
    # batch 1: 2 tokens in 12 ms against 1 in 8 ms (1.33x); batch 4: 8 in 20 ms against 4 in 9
    feed(kinds, 1, (2, 0.012), (1, 0.008))
    feed(kinds, 4, (8, 0.020), (4, 0.009))
    feed(kinds, 16, (20, 0.080), (16, 0.030))
    assert kinds.ratio(1) == pytest.approx(2 / 0.012 / (1 / 0.008))
    assert kinds.decide() == 4
    assert kinds.figures()[0] == [1, pytest.approx(166.67), pytest.approx(125.0)]


def test_no_threshold_while_spec_wins_everywhere_or_a_kind_is_unmeasured():
    kinds = SpecThreshold(SPEC)
    feed(kinds, 1, (2, 0.010), (1, 0.008))
    feed(kinds, 8, (12, 0.020), (8, 0.018))
    assert kinds.decide() is None
    for _ in range(10):
        kinds.observe("spec", 64, True, 30, 1.0)  # loses badly, but no_spec is unmeasured at 64
    assert kinds.ratio(64) is None and kinds.decide() is None


def test_a_bucket_goes_off_and_comes_back_only_past_the_margins():
    kinds = SpecThreshold(SPEC)
    feed(kinds, 8, (10, 0.0101), (8, 0.008))  # 0.99x: a tie is noise
    assert kinds.ratio(8) == pytest.approx(0.99, abs=0.001) and kinds.decide() is None
    kinds = SpecThreshold(SPEC)
    feed(kinds, 8, (10, 0.0104), (8, 0.008))  # 0.96x
    assert kinds.ratio(8) < DISABLE_RATIO and kinds.decide() == 8
    kinds = SpecThreshold(SPEC)
    feed(kinds, 8, (10, 0.0098), (8, 0.008))  # 1.02x
    kinds.set(8)
    assert 1.0 < kinds.ratio(8) < 1.03 and kinds.decide() == 8, "inside the margin: stays off"
    kinds.set(None)
    assert kinds.decide() is None, "1.02x while on: stays on"
    kinds.set(8)
    for _ in range(2):  # two probes of spec, each a re-entry and then PAIRED steps counted
        kinds.observe("no_spec", 8, True, 8, 0.008)
        for _ in range(PAIRED + 1):
            kinds.observe("spec", 8, True, 10, 0.009)  # 1.11x
    assert kinds.ratio(8) == pytest.approx(1.11, abs=0.01) and kinds.decide() is None


def test_load_that_comes_while_spec_runs_does_not_read_as_speculations_loss():
    """Steps at 1.5 tok / 12 ms (spec) and 1 tok / 10 ms (no_spec) through the first periodic
    probe, then the machine gets busy and every step takes four times as long: spec's window
    against no_spec's, made before, reads 0.31x, but each probe against the steps around it
    read 1.25x, and spec stays on."""
    kinds = SpecThreshold(SPEC)

    def steps(n: int, slower: float) -> None:
        for _ in range(n):
            kind = kinds.kind_for(1, is_decode=True)
            tokens, seconds = (3, 0.024) if kind == "spec" else (2, 0.02)
            kinds.observe(kind, 1, True, tokens, seconds * slower)
            if kinds.may_change and kinds.decide() != kinds.threshold:
                kinds.set(kinds.decide())

    feed(kinds, 1, (3, 0.024), (2, 0.02))
    steps(7 * PROBE_PERIOD + 4, 1.0)  # past three periodic probes (gaps 32, 64, 128)
    steps(WINDOW, 4.0)
    windows = kinds.rates[("spec", 1)].per_second / kinds.rates[("no_spec", 1)].per_second
    assert windows < 0.8, "the windows alone turn spec off"
    assert len(kinds.pairs[1]) == 3, "a pair a probe"
    assert kinds.ratio(1) == pytest.approx(1.25) and kinds.threshold is None


def test_probes_measure_the_kind_not_chosen_then_once_a_period():
    kinds = SpecThreshold(SPEC)
    chosen = []
    for _ in range(2 * PROBE_PERIOD):
        kind = kinds.kind_for(4, is_decode=True)
        chosen.append(kind)
        kinds.observe(kind, 4, True, 4, 0.01)
    assert chosen[:MIN_SAMPLES] == ["no_spec"] * MIN_SAMPLES  # spec wanted: no_spec probed
    # then one in PROBE_PERIOD counted steps; the spec step after each no_spec stretch
    # re-enters spec and is not counted (the first periodic probe: the 33rd step, not the 32nd)
    assert chosen.count("no_spec") == MIN_SAMPLES + 1 and chosen[PROBE_PERIOD] == "no_spec"
    assert kinds.num_steps[("spec", 4)] == 2 * PROBE_PERIOD - (MIN_SAMPLES + 1) - 2
    assert len(kinds.rates[("spec", 4)].tokens) == 16
    assert kinds.kind_for(4, is_decode=False) == "spec", "a prefill step is never a probe"
    kinds.set(4)
    assert kinds.kind_for(3, is_decode=False) == "spec"
    assert kinds.kind_for(4, is_decode=False) == "no_spec"
    assert kinds.kind_for(8, is_decode=True) == "spec", "spec unmeasured at 8: probed"


def test_a_spec_probe_is_a_reentry_and_paired_steps_where_spec_is_off_and_probes_grow_apart():
    """After a threshold change the other kind is probed PROBE_PERIOD counted steps on, then
    twice as far each time, up to MAX_PROBE_PERIOD; a change starts the gaps again."""
    kinds = SpecThreshold(SPEC)
    feed(kinds, 8, (10, 0.02), (8, 0.01))
    kinds.set(8)
    start = kinds.num_steps[("spec", 8)] + kinds.num_steps[("no_spec", 8)]
    chosen = []
    for _ in range(2000):
        kind = kinds.kind_for(8, is_decode=True)
        chosen.append(kind)
        kinds.observe(kind, 8, True, 8, 0.01)
    runs = "".join("s" if k == "spec" else "n" for k in chosen)
    probe = "s" * (1 + PAIRED)  # a re-entry, then PAIRED counted steps
    pairs = [i for i in range(len(runs)) if runs.startswith("n" + probe + "n", i - 1)]
    assert runs.count("s") == len(pairs) * len(probe), runs
    gaps = [b - a - 1 for a, b in zip(pairs, pairs[1:], strict=False)]  # counted steps apart
    assert pairs[0] == PROBE_PERIOD - 1, pairs  # counted steps after the change
    assert gaps[:3] == [2 * PROBE_PERIOD, 4 * PROBE_PERIOD, 8 * PROBE_PERIOD], gaps
    assert len(gaps) > 3 and set(gaps[3:]) == {MAX_PROBE_PERIOD}, gaps
    spec_rates = min(WINDOW, MIN_SAMPLES + PAIRED * len(pairs))
    assert len(kinds.rates[("spec", 8)].tokens) == spec_rates  # each probe's counted steps
    assert start == 2 * MIN_SAMPLES
    kinds.set(None)  # a change: the other kind (no_spec now) probed PROBE_PERIOD steps on again
    assert kinds.kind_for(8, True) == "spec"
    chosen = []
    for _ in range(PROBE_PERIOD + 1):
        kind = kinds.kind_for(8, is_decode=True)
        chosen.append(kind)
        kinds.observe(kind, 8, True, 8, 0.01)
    # the first spec step re-enters the kind and is not counted: the probe one step later
    assert chosen.index("no_spec") == PROBE_PERIOD, chosen
    kinds.observe("no_spec", 8, False, 1, 0.01)  # a prefill step: not counted, but a kind
    assert kinds.last_kind == "no_spec"


def test_probes_count_the_same_without_measuring():
    """A replay observes steps without seconds: the same probes, no rates to decide from."""
    live, replay = SpecThreshold(SPEC), SpecThreshold(SPEC)
    kinds_live, kinds_replay = [], []
    for kinds, seen, seconds in ((live, kinds_live, 0.01), (replay, kinds_replay, None)):
        for step in range(80):
            batch = 1 + step % 5
            kind = kinds.kind_for(batch, is_decode=True)
            seen.append(kind)
            kinds.observe(kind, batch, True, batch, seconds)
    assert kinds_live == kinds_replay
    assert live.rates and not replay.rates and replay.decide() is None


def test_the_users_threshold_wins_and_no_speculation_never_specs():
    user = SpecThreshold(SPEC.replace(speculative_disable_by_batch_size=3))
    assert not user.is_auto
    user.set(1)  # a recorded automatic threshold (a what-if replay) changes nothing
    assert [user.kind_for(b, True) for b in (1, 2, 3, 9)] == ["spec", "spec", "no_spec", "no_spec"]
    off = SpecThreshold(SPEC.replace(speculative_auto_disable=False))
    assert not off.is_auto and off.kind_for(64, True) == "spec"
    plain = SpecThreshold(EngineConfig(model="random:tiny"))
    assert not plain.is_auto and plain.kind_for(1, True) == "no_spec"
    plain.observe("no_spec", 1, True, 1, 0.01)
    assert not plain.rates


def test_an_older_log_keeps_its_fixed_threshold_and_k():
    cfg = SPEC.to_dict()
    del cfg["speculative_auto_disable"], cfg["speculative_adaptive_k"]
    old = EngineConfig.from_dict(cfg)
    assert not old.speculative_auto_disable and not old.speculative_adaptive_k
    assert EngineConfig.from_dict(SPEC.to_dict()) == SPEC


def test_a_new_threshold_is_held_a_while():
    kinds = SpecThreshold(SPEC)
    assert not kinds.may_change
    feed(kinds, 8, (10, 0.0135), (8, 0.01))  # spec at 0.93x: a loss, but not a decisive one
    assert kinds.may_change == (2 * MIN_SAMPLES >= HOLD_STEPS)
    for _ in range(HOLD_STEPS):
        kinds.observe("no_spec", 8, True, 8, 0.01)
    assert kinds.may_change
    kinds.set(8)
    assert not kinds.may_change
    kinds.observe("no_spec", 8, False, 8, 0.01)  # a prefill step does not count
    assert kinds.steps_since_change == 0


def test_a_decisive_verdict_is_acted_on_without_waiting():
    """Spec at 0.5x where it is on: the threshold may change at once, not HOLD_STEPS steps
    later; held, the same bucket at 0.9x waits (broken on purpose: DECISIVE at 0 never acts)."""
    kinds = SpecThreshold(SPEC)
    feed(kinds, 8, (10, 0.025), (8, 0.01))  # 0.5x
    assert not kinds.may_change, "no pair: the windows' verdict waits"
    for _ in range(2):  # no_spec probes, each paired with the spec steps before it
        feed(kinds, 8, (10, 0.025), (8, 0.01))
    kinds.set(None)  # the hold starts again: only a decisive verdict acts before its end
    feed(kinds, 8, (10, 0.025), (8, 0.01))  # the third pair
    assert kinds.steps_since_change < HOLD_STEPS and kinds.may_change
    assert kinds.decide() == 8
    kinds.set(8)
    assert not kinds.may_change, "0.5x agrees with spec off at 8: nothing decisive against it"
    for _ in range(4):  # now 1.54x where spec is off: each spec run a probe, paired
        feed(kinds, 8, (10, 0.0065), (8, 0.01))
    assert kinds.may_change and kinds.decide() is None
    mild = SpecThreshold(SPEC)
    for _ in range(3):
        feed(mild, 8, (10, 0.0139), (8, 0.01))  # 0.9x
    mild.set(None)
    feed(mild, 8, (10, 0.0139), (8, 0.01))
    assert mild.decide() == 8 and not mild.may_change


def test_without_the_decisive_rule_a_clear_loss_waits(monkeypatch):
    from memstep.core import spec_threshold

    monkeypatch.setattr(spec_threshold, "DECISIVE", 0.0)
    kinds = SpecThreshold(SPEC)
    for _ in range(3):
        feed(kinds, 8, (10, 0.025), (8, 0.01))
    kinds.set(None)
    feed(kinds, 8, (10, 0.025), (8, 0.01))
    assert len(kinds.pairs[8]) == 3 and not kinds.may_change


def test_at_one_stream_spec_goes_off_only_on_a_decisive_loss():
    kinds = SpecThreshold(SPEC)
    feed(kinds, 1, (10, 0.0115), (8, 0.008))  # 0.87x: off at 8 streams, not at one
    assert kinds.decide() is None
    feed(kinds, 8, (10, 0.0115), (8, 0.008))
    assert kinds.decide() == 8
    kinds = SpecThreshold(SPEC)
    feed(kinds, 1, (10, 0.0160), (8, 0.008))  # 0.62x: nothing accepted, say
    assert kinds.ratio(1) < DECISIVE and kinds.decide() == 1


def test_probe_gaps_hold_a_losing_kinds_probes_under_the_budget():
    """spec at a third of no_spec's rate where it is off: PROBE_STEPS probe steps each losing
    two steps' time fit PROBE_BUDGET once in 400 steps; spec on at 1.2x: 40; a kind that wins
    (its verdict about to flip) or loses little keeps the period; MAX_PROBE_PERIOD caps it."""
    assert PROBE_STEPS * 2 / PROBE_BUDGET == 400
    rates = [[1, 36.0, 30.0], [4, 100.0, 99.0], [16, 100.0, 300.0], [32, 10.0, 1000.0]]
    assert probe_gaps(16, rates) == [[1, 40], [16, 400], [32, MAX_PROBE_PERIOD]]
    assert probe_gaps(None, [[16, 100.0, 300.0]]) == [], "no_spec probed where it wins"


def run_at(batch: int, steps: int, use_gaps: bool) -> tuple[list[str], float]:
    """`steps` decode steps at `batch` as the engine runs them, where a spec step takes three
    no_spec steps' time for 1.3 times the tokens (2 cores at 16 streams): the kinds chosen, and
    the share of the time lost against no_spec from the eighth step on (the probes')."""
    kinds, chosen = SpecThreshold(SPEC), []
    for _ in range(steps):
        kind = kinds.kind_for(batch, is_decode=True)
        tokens, seconds = (int(1.3 * batch), 0.03) if kind == "spec" else (batch, 0.01)
        kinds.observe(kind, batch, True, tokens, seconds)
        chosen.append(kind)
        if kinds.may_change and kinds.decide() != kinds.threshold:
            threshold = kinds.decide()
            kinds.set(threshold, probe_gaps(threshold, kinds.figures()) if use_gaps else ())
    later = chosen[8:]
    made = sum(int(1.3 * batch) if k == "spec" else batch for k in later)
    spent = sum(0.03 if k == "spec" else 0.01 for k in later)
    return chosen, 1 - made / batch * 0.01 / spent


def test_at_a_third_of_the_rate_spec_goes_off_at_once_and_its_probes_cost_little():
    """Past one stream the windows' 0.43x acts before any pair or the hold (four spec steps,
    the first and a re-entry among them), and the probes that follow cost under PROBE_BUDGET;
    with the period's gaps (`probe_gaps` left out: the break) over the budget, twice as much."""
    chosen, lost = run_at(16, 1000, use_gaps=True)
    assert chosen[:8].count("spec") == 4 and "spec" not in chosen[8:250], chosen[:40]
    assert lost < PROBE_BUDGET, lost
    _, lost_without = run_at(16, 1000, use_gaps=False)
    assert lost_without > PROBE_BUDGET and lost_without > 1.9 * lost, (lost, lost_without)
    one, _ = run_at(1, 40, use_gaps=True)
    assert one[:16].count("spec") > 8, "at one stream the windows alone never act: pairs do"
