"""The transition table refuses illegal moves; the arena's ledger and release checks."""

from __future__ import annotations

import gc

import attrs
import pytest
import torch

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.executors.process.inprocess import local_engine
from memstep.states import catalog
from memstep.states import kinds as kinds_module
from memstep.states.arena import Arena, ArenaFull
from memstep.states.lifecycle import Lifecycle
from memstep.states.table import TRANSITIONS, TransitionNotAllowed, check


def test_illegal_transition_names_both_sides():
    with pytest.raises(TransitionNotAllowed, match="Can't go to 'spec' when in 'boot'"):
        check("boot", "spec")
    check("no_spec", "spec")
    assert ("capture", "warmup") not in TRANSITIONS


def test_arena_claims_views_and_keeps_a_ledger():
    arena = Arena(4096, torch.device("cpu"))
    a = arena.claim("spec", "a", (16, 8), torch.float32, step=3)
    b = arena.claim("spec", "b", (10,), torch.long, step=4)
    assert a.untyped_storage().data_ptr() == arena.storage.untyped_storage().data_ptr()
    assert [(e.buffer, e.nbytes, e.step_claimed) for e in arena.ledger()] == [
        ("a", 512, 3),
        ("b", 256, 4),
    ]
    with pytest.raises(ArenaFull):
        arena.claim("spec", "c", (4096,), torch.float32, step=5)
    arena.release("spec", "a", a)
    arena.release("spec", "b", b)
    assert arena.claimed_bytes == 0
    assert arena.check_released() == [("spec", "a"), ("spec", "b")], "still referenced here"
    del a, b
    assert arena.claim("spec", "big", (1024,), torch.float32, step=6).numel() == 1024


class SpecKeepsItsBuffer(kinds_module.Spec):
    """Keeps a claimed buffer on self past its exit hook: the check must say so."""

    def on_enter(self):
        self.kept = self.held["residual"]


def test_buffer_held_after_exit_is_reported(monkeypatch):
    monkeypatch.setitem(catalog.KINDS, "spec", SpecKeepsItsBuffer)
    cfg = EngineConfig(
        model="random:tiny", speculative_method="ngram", speculative_disable_by_batch_size=2
    )
    records: list = []
    engine = local_engine(cfg, sinks=[records.append])
    engine.add_request([5, 6, 7, 5, 6], SamplingParams(temperature=0.0, max_tokens=6))
    engine.step()  # spec: one request
    engine.add_request([9, 10, 11], SamplingParams(temperature=0.0, max_tokens=4))
    engine.run_until_idle()  # two requests: no_spec, so spec exits
    gc.collect()
    held = [r for r in records if type(r).__name__ == "LeakSuspected"]
    assert [(r.kind, r.what) for r in held][:1] == [("spec", "held_after_exit")]
    assert "spec.residual" in held[0].detail


def _ledger_totals(records: list) -> dict[str, list[int]]:
    """kind -> [bytes claimed by its enter hooks, bytes released by its exit hooks]."""
    totals: dict[str, list[int]] = {}
    for r in records:
        if type(r).__name__ == "StateEntered":
            totals.setdefault(r.kind, [0, 0])[0] += r.bytes_claimed
        elif type(r).__name__ == "StateExited":
            totals.setdefault(r.kind, [0, 0])[1] += r.bytes_released
    return totals


class SpecWithAnOddBuffer(kinds_module.Spec):
    """The spec kind plus a buffer of 3 x 3 x 8 = 72 bytes, not a multiple of the alignment."""

    def buffers(self):
        return [*super().buffers(), kinds_module.BufferSpec("odd", (3, 3), torch.long)]


def _crossings(draft_layers: int | None = None) -> list:
    """warmup -> capture -> spec -> no_spec -> spec crossings, then shutdown."""
    extra = {"draft_layers": draft_layers} if draft_layers else {}
    cfg = EngineConfig(
        model="random:tiny",
        speculative_method="draft" if draft_layers else "ngram",
        speculative_disable_by_batch_size=2,
        num_speculative_tokens=3,
        max_num_seqs=3,
        **extra,
    )
    records: list = []
    engine = local_engine(cfg, sinks=[records.append])
    engine.add_request([5, 6, 7, 5, 6], SamplingParams(temperature=0.0, max_tokens=6))
    engine.step()
    engine.add_request([9, 10, 11], SamplingParams(temperature=0.0, max_tokens=3))
    engine.run_until_idle()
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))
    engine.run_until_idle()
    engine.shutdown()
    return records


@pytest.mark.parametrize("draft", [None, 1], ids=["ngram", "draft"])
def test_every_kind_releases_to_the_byte_what_it_claimed(draft, monkeypatch):
    monkeypatch.setitem(catalog.KINDS, "spec", SpecWithAnOddBuffer)
    totals = _ledger_totals(_crossings(draft))
    assert set(totals) == {"warmup", "capture", "no_spec", "spec"}
    assert totals["spec"][0] > 0 and totals["spec"][0] % 256 == 0
    assert totals["warmup"][0] == 3 * (3 + 1) * 64 * 4, "dummy batch: sampler rows x hidden"
    assert totals["capture"] == [0, 0], "nothing to capture on the CPU"
    assert all(claimed == released for claimed, released in totals.values()), totals


def test_spec_claims_only_what_its_method_uses():
    """n-gram drafts are deterministic: no draft probabilities, no draft KV; no method keeps
    draft tokens in a buffer."""
    env = kinds_module.KindEnv(EngineConfig(model="random:tiny"), _tiny(), torch.float32, 8)
    names = {b.name for b in kinds_module.Spec(env).buffers()}
    assert names == {"residual"}
    env = attrs.evolve(env, cfg=EngineConfig(model="random:tiny", speculative_method="draft"))
    assert {b.name for b in kinds_module.Spec(env).buffers()} == {
        "residual",
        "draft_probs",
        "draft_kv",
    }


def _tiny():
    from memstep.core.model_config import PRESETS

    return PRESETS["tiny"]


def test_shutdown_exits_the_last_kind_and_keeps_its_leaks(monkeypatch):
    monkeypatch.setitem(catalog.KINDS, "spec", SpecKeepsItsBuffer)
    cfg = EngineConfig(model="random:tiny", speculative_method="ngram")
    records: list = []
    engine = local_engine(cfg, sinks=[records.append])
    engine.add_request([5, 6, 7, 5, 6], SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # in spec, holding its own buffer on self
    engine.shutdown()
    names = [type(r).__name__ for r in records]
    last = names.index("PhaseChanged", len(names) - 4)
    assert names[last:] == ["PhaseChanged", "StateExited", "LeakSuspected"]
    assert records[-2].kind == "spec" and records[-1].what == "held_after_exit"


def test_the_lifecycle_refuses_a_move_the_table_lacks():
    life = Lifecycle()
    life.move("profile", 0)
    with pytest.raises(TransitionNotAllowed, match="Can't go to 'spec' when in 'profile'"):
        life.move("spec", 0)
    assert life.state == "profile"
