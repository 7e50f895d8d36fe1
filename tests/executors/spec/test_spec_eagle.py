"""EAGLE-style speculation: drafts from hidden states the `spec` kind holds, lossless, rebuilt
after every re-entry, and a head that `memstep train-draft` makes and the engine loads."""

from __future__ import annotations

import pytest
import torch
from drafted_position import CRITICAL, chi_square, find_position, second_tokens

from memstep.cli.main import main
from memstep.core.config import ConfigError, EngineConfig
from memstep.core.model_source import model_config, resolve
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import StateEntered, StateExited, StepFinished
from memstep.executors.process.inprocess import local_engine
from memstep.executors.spec import decoder as spec_decode
from memstep.executors.spec.eagle import SMOLLM2_HEAD, draft_context
from memstep.executors.spec.eagle_head import EagleHead
from memstep.states.arena import Arena
from memstep.states.kinds import KindEnv, Spec


def eagle_config(**kw) -> EngineConfig:
    """K = 3 at every spec step: no adaptive K, no automatic threshold (tests/core has those)."""
    fixed = {"speculative_adaptive_k": False, "speculative_auto_disable": False} | kw
    return EngineConfig(speculative_method="eagle", num_speculative_tokens=3, **fixed)


def test_the_committed_head_drafts_what_the_target_says(chat_prompts):
    """The trained head's drafts are accepted far more often than chance (a head trained on 8
    prompts for one epoch: 1 of 352); and the output is the plain greedy output."""
    engine = local_engine(eagle_config(max_num_seqs=4))
    done = engine.generate(chat_prompts[:4], SamplingParams(temperature=0.0, max_tokens=48))
    proposed = sum(c.num_proposed for c in done)
    accepted = sum(c.num_accepted for c in done)
    assert proposed > 50 and accepted / proposed > 0.04, (accepted, proposed)
    plain = local_engine(EngineConfig(max_num_seqs=4))
    assert [c.token_ids for c in done] == [
        c.token_ids
        for c in plain.generate(chat_prompts[:4], SamplingParams(temperature=0.0, max_tokens=48))
    ]


def test_hidden_states_are_rebuilt_after_each_reentry(chat_prompts):
    """After `spec` is re-entered no request drafts from a hidden state kept before: the first
    spec step of each stretch proposes nothing, later ones do; `previous_hidden_states` is
    claimed on every entry and released on every exit."""
    engine = local_engine(eagle_config(max_num_seqs=8, speculative_disable_by_batch_size=4))
    records: list[object] = []
    engine.sinks.append(records.append)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = [engine.add_request(chat_prompts[i], greedy) for i in range(2)]
    for _ in range(8):
        engine.step()
    for i in range(2, 6):
        engine.add_request(
            chat_prompts[i], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        )
    engine.run_until_idle()
    steps = [r for r in records if isinstance(r, StepFinished)]
    stretches: list[list[StepFinished]] = []
    for r in steps:
        if r.kind == "spec" and (not stretches or stretches[-1][-1].step != r.step - 1):
            stretches.append([])
        if r.kind == "spec":
            stretches[-1].append(r)
    assert len(stretches) >= 2, "spec, no_spec, then spec again"
    for stretch in stretches[1:]:
        assert stretch[0].num_proposed == 0, "drafted from a hidden state kept before the exit"
        assert sum(r.num_proposed for r in stretch[1:]) > 0
    entered = [r for r in records if isinstance(r, StateEntered) and r.kind == "spec"]
    exited = [r for r in records if isinstance(r, StateExited) and r.kind == "spec"]
    assert len(entered) == len(stretches) and len(exited) >= len(stretches) - 1
    assert all(r.bytes_claimed > 0 for r in entered)
    assert {r.bytes_claimed for r in entered} == {r.bytes_released for r in exited}
    assert len(first) == 2


def test_a_hidden_state_is_used_only_for_the_tokens_it_follows():
    cfg = eagle_config(max_num_seqs=2)
    env = KindEnv(
        cfg, model_config(resolve("smollm2")), torch.float32, 8, "cpu", draft_context(cfg)
    )
    spec, arena = Spec(env), Arena(4 << 20, torch.device("cpu"))
    spec.enter(arena, 0)
    spec.keep_hidden([("a", 10), ("b", 7)], torch.ones(2, env.model.hidden_size))
    assert spec.hidden_row("a", 10) is not None and spec.hidden_row("a", 11) is None
    spec.keep_hidden([("c", 3)], torch.ones(1, env.model.hidden_size))
    assert spec.hidden_row("c", 3) is None, "two rows, both taken: c drafts nothing"
    spec.forget("a")
    spec.keep_hidden([("c", 3)], torch.ones(1, env.model.hidden_size))
    assert spec.hidden_row("c", 3) is not None, "a's row went back to the free rows"
    spec.exit(arena, 1)
    spec.enter(arena, 2)
    assert spec.hidden_row("b", 7) is None, "nothing survives an exit"


# --- lossless at temperature > 0 -----------------------------------------------------------


@pytest.fixture(scope="module")
def drafted_position(chat_prompts):
    """`find_position`'s point, and the second tokens of RUNS seeded EAGLE runs from it."""
    prompt, first, top = find_position(chat_prompts)
    engine = local_engine(eagle_config(max_num_seqs=64))
    seconds, mode, done = second_tokens(engine, prompt, 4)
    assert mode == first
    return prompt, seconds, top, sum(c.num_proposed for c in done)


def test_sampled_tokens_at_a_drafted_position_follow_the_target(drafted_position):
    _, seconds, top, proposed = drafted_position
    assert proposed > 0 and sum(seconds.values()) > 400
    stat, bins = chi_square(seconds, top)
    assert bins >= 2 and stat < CRITICAL[bins], (stat, bins, seconds, top)


def test_the_same_test_fails_when_every_draft_is_accepted(drafted_position, monkeypatch):
    prompt, _, top, _ = drafted_position

    def always_accept(p, rows, drafts, q, residual):
        return [*drafts, int(p[len(drafts)].argmax())], len(drafts)

    monkeypatch.setattr(spec_decode, "accept_drafts", always_accept)
    seconds, _, _ = second_tokens(local_engine(eagle_config(max_num_seqs=64)), prompt, 4)
    stat, bins = chi_square(seconds, top)
    assert stat > CRITICAL[bins]


# --- the head and its training command -----------------------------------------------------


def test_train_draft_writes_a_head_the_engine_loads(tmp_path, chat_prompts):
    out = tmp_path / "head.npz"
    argv = ["train-draft", "--conversations", "4", "--max-tokens", "12", "--epochs", "1"]
    assert main([*argv, "--draft-vocab", "512", "--intermediate", "64", "--out", str(out)]) == 0
    engine = local_engine(eagle_config(max_num_seqs=2, draft_model=str(out)))
    done = engine.generate(chat_prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
    assert done[0].num_proposed > 0 and len(done[0].token_ids) == 8


def test_train_draft_from_exported_questions_without_attention(tmp_path, chat_prompts):
    """`--export-prompts` writes the questions a GPU machine without the dataset reads with
    `--prompts`; `--no-attention` makes a head that keeps no context."""
    questions = tmp_path / "q.jsonl"
    assert main(["train-draft", "--export-prompts", str(questions), "--conversations", "3"]) == 0
    assert len(questions.read_text().splitlines()) == 3
    out = tmp_path / "head.npz"
    argv = ["train-draft", "--prompts", str(questions), "--no-attention", "--max-tokens", "12"]
    argv += ["--epochs", "1", "--draft-vocab", "512", "--intermediate", "64", "--out", str(out)]
    assert main(argv) == 0
    engine = local_engine(eagle_config(max_num_seqs=2, draft_model=str(out)))
    assert engine.executor.worker.eagle.attn is None
    spec = engine.executor.worker.lifecycle.kinds["spec"]
    assert "draft_context" not in [b.name for b in spec.buffers()]
    done = engine.generate(chat_prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
    assert done[0].num_proposed > 0 and len(done[0].token_ids) == 8


def test_a_head_for_another_model_or_none_is_a_clear_error(tmp_path):
    cfg = model_config(resolve("smollm2"))
    embed = torch.zeros(cfg.vocab_size + 1, cfg.hidden_size)
    with pytest.raises(ConfigError, match="vocabulary"):
        EagleHead(SMOLLM2_HEAD, embed, embed, cfg.vocab_size + 1, 1e-5)
    with pytest.raises(ConfigError, match="draft_model"):
        EngineConfig(model="random:tiny", speculative_method="eagle")
    with pytest.raises(ConfigError, match="no EAGLE head"):
        local_engine(eagle_config(draft_model=str(tmp_path / "missing.npz")))


def test_drafts_on_the_calling_thread_alone_are_the_pool_s(chat_prompts, monkeypatch):
    """Where the pool's threads sleep between regions (the executor's passive policy), the
    head drafts on the calling thread alone (executors/cpu/threads.small_work): the same drafts,
    accepted as often, and the same tokens as on the pool."""
    params = SamplingParams(temperature=0.0, max_tokens=24)

    def run() -> list:
        engine = local_engine(eagle_config(max_num_seqs=2, num_threads=2))
        return [(c.token_ids, c.num_accepted) for c in engine.generate(chat_prompts[:2], params)]

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    pooled = run()
    threads, set_threads = [], torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (threads.append(n), set_threads(n)))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    alone = run()
    assert 1 in threads  # the drafts did run on one thread
    assert alone == pooled and sum(accepted for _, accepted in alone) > 0
