"""EAGLE's attention half: training unrolls exactly the chain that serving drafts, and each
request's context (the keys of the pairs its head has read) grows with its tokens and starts
again whenever its state is not fresh."""

from __future__ import annotations

import numpy as np
import torch

from memstep.core.config import EngineConfig
from memstep.core.model_source import model_config, resolve
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import StepFinished
from memstep.executors.process.inprocess import local_engine
from memstep.executors.spec.eagle import (
    SMOLLM2_HEAD,
    AttnShape,
    draft_context,
    init_params,
    save_head,
)
from memstep.executors.spec.eagle_cpu import CpuHead
from memstep.executors.spec.eagle_head import EagleHead
from memstep.executors.spec.eagle_torch import TorchHead
from memstep.states.kinds import KindEnv, Spec
from memstep.train.fit import unrolled

HIDDEN, VOCAB = 64, 96


def a_head(tmp_path) -> tuple[EagleHead, torch.Tensor, torch.Tensor]:
    """A random head with attention over a made-up target (hidden 64, vocabulary 96), its
    residual branches scaled up so that attention and MLP both move the drafts."""
    attn = AttnShape(heads=4, kv_heads=2, head_dim=16, theta=10000.0, window=256)
    params = init_params(HIDDEN, 64, seed=3, attention=attn)
    params["o"] *= 200
    params["down"] *= 200
    gen = torch.Generator().manual_seed(4)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=gen)
    vocab = torch.arange(VOCAB - 1, -1, -1)  # reversed: draft ids are not target ids
    meta = {"hidden": HIDDEN, "vocab": VOCAB, "heads": 4, "kv_heads": 2, "head_dim": 16}
    path = tmp_path / "head.npz"
    save_head(path, params, vocab, meta | {"rope_theta": 10000, "window": 256})
    head = EagleHead(path, embed, lm_head, VOCAB, 1e-5, int8=False)
    return head, embed, lm_head


def test_training_unrolls_the_chain_that_serving_drafts(tmp_path):
    """From the last true pair s, serving drafts d1, d2, d3 attending the context of pairs
    0..s and then its own drafts' pairs; the trainer's passes 1, 2, 3 at s, s+1, s+2 over the
    same tokens choose the same drafts."""
    head, embed, lm_head = a_head(tmp_path)
    assert head.attn is not None
    gen = torch.Generator().manual_seed(5)
    length, s = 12, 6
    feats = torch.randn(length, HIDDEN, generator=gen)
    tokens = torch.randint(0, VOCAB, (length,), generator=gen)
    positions = torch.arange(s + 1)
    keys, values = head.keys(feats[: s + 1], tokens[: s + 1], positions)
    kv = torch.stack([keys, values]).unsqueeze(0)  # [1, 2, s + 1, kv heads, d]
    valid = torch.ones(1, s + 1, dtype=torch.bool)
    context = (kv, valid, torch.tensor([s]))
    assert isinstance(head.backend, TorchHead)
    drafts = head.backend.draft(feats[s : s + 1], tokens[s : s + 1], 3, context)[0].tolist()
    chain = tokens.clone()
    chain[s + 1], chain[s + 2] = drafts[0], drafts[1]  # the tokens the chain read
    passes = list(
        unrolled(
            {n: torch.from_numpy(a).float() for n, a in np.load(tmp_path / "head.npz").items()},
            embed,
            lm_head[head.vocab],
            feats.unsqueeze(0),
            chain.unsqueeze(0),
            3,
            head.attn,
            1e-5,
        )
    )
    trained = [int(head.vocab[passes[u][1][0, s + u].argmax()]) for u in range(3)]
    assert trained == drafts


def test_only_a_head_with_attention_claims_a_context(tmp_path):
    model = model_config(resolve("smollm2"))
    cfg = eagle_config(max_num_seqs=2)
    with_attention = Spec(
        KindEnv(cfg, model, torch.float32, 8, "cpu", draft_context(cfg))
    ).buffers()
    context = [b for b in with_attention if b.name == "draft_context"]
    slots = 256 + 3  # the ring of pairs read, then a slot per draft position (K = 3)
    assert context and context[0].shape == (2, 2, slots, model.num_kv_heads, model.head_dim)
    params = init_params(model.hidden_size, 32, seed=0)
    plain = tmp_path / "plain.npz"
    save_head(plain, params, torch.arange(64), {"hidden": model.hidden_size, "vocab": 1})
    cfg = eagle_config(max_num_seqs=2, draft_model=str(plain))
    assert "draft_context" not in [
        b.name
        for b in Spec(KindEnv(cfg, model, torch.float32, 8, "cpu", draft_context(cfg))).buffers()
    ]


def eagle_config(**kw) -> EngineConfig:
    """K = 3 at every spec step: no adaptive K, no automatic threshold (tests/core has those)."""
    fixed = {"speculative_adaptive_k": False, "speculative_auto_disable": False} | kw
    return EngineConfig(speculative_method="eagle", num_speculative_tokens=3, **fixed)


def test_the_context_holds_a_pair_per_token_and_restarts_on_reentry(chat_prompts):
    """A request's context has read one pair per token it was given in `spec`, and (the
    committed head reads the prompt) one per position of the prompt it was admitted with in a
    `spec` step; after a `no_spec` stretch it starts again from the first `spec` step after it."""
    assert SMOLLM2_HEAD.exists()
    engine = local_engine(eagle_config(max_num_seqs=4, speculative_disable_by_batch_size=2))
    assert engine.executor.worker.eagle.reads_prompt
    spec = engine.executor.worker.lifecycle.kinds["spec"]
    assert isinstance(spec, Spec)
    kinds: list[str] = []
    engine.sinks.append(lambda r: isinstance(r, StepFinished) and kinds.append(r.kind))
    rid = engine.add_request(
        chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    )
    since, crossed, checked = len(chat_prompts[0]) - 1, False, 0
    step = 0
    while engine.has_work():
        if step == 6:  # two more requests: no_spec until they finish
            for i in (1, 2):
                engine.add_request(
                    chat_prompts[i], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
                )
        step += 1
        outs = engine.step()
        mine = sum(len(o.new_token_ids) for o in outs if o.request_id == rid)
        if kinds[-1] != "spec":
            since, crossed = 0, True
            assert rid not in spec.context_of
            continue
        since += mine
        if rid in spec.context_of:
            assert spec.context_of[rid] == since
            checked += crossed
    assert crossed and checked > 3


def marked_head(tmp_path, reads: bool) -> str:
    """The committed head, marked as trained with the prompt's pairs in its context or not."""
    with np.load(SMOLLM2_HEAD, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    arrays["meta_prompt_context"] = np.asarray(int(reads), dtype=np.int64)
    path = tmp_path / f"reads-prompt-{reads}.npz"
    with path.open("wb") as fh:
        np.savez(fh, **arrays)
    return str(path)


def test_a_head_that_reads_the_prompt_holds_its_last_window_of_pairs(tmp_path, smol_engine):
    """A prompt read in a `spec` step gives the context a pair per position (the state there and
    the token after it, the sampled one last), the last 256 of a 300-token prompt, each in its
    ring slot with the keys of its own position; the same head marked as trained without the
    prompt keeps only the sampled token's pair."""
    from memstep.train.exchanges import final_hidden

    prompt = smol_engine.tokenizer.encode("the lighthouse keeper climbed the steps " * 60)[:300]
    for reads in (True, False):
        engine = local_engine(
            eagle_config(max_num_seqs=2, draft_model=marked_head(tmp_path, reads))
        )
        worker = engine.executor.worker
        spec = worker.lifecycle.kinds["spec"]
        assert isinstance(spec, Spec) and worker.eagle.reads_prompt is reads
        rid = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0))
        (out,) = engine.step()
        assert spec.context_of[rid] == (300 if reads else 1)
        if not reads:
            engine.shutdown()
            continue
        row = spec.hidden_of[rid][0]
        hidden = final_hidden(worker.model, prompt, worker.cfg.block_size)
        pairs = torch.tensor([*prompt[1:], out.new_token_ids[0]])
        keys, values = worker.eagle.keys(hidden[44:], pairs[44:], torch.arange(44, 300))
        context = spec.held["draft_context"][row]
        slots = torch.arange(44, 300) % 256
        torch.testing.assert_close(context[0, slots], keys, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(context[1, slots], values, atol=1e-3, rtol=1e-3)
        engine.shutdown()


def test_off_the_c_kernels_every_draft_reads_the_whole_buffer(tmp_path, monkeypatch):
    """The float head (CUDA's) attends keys of one length at every step, the whole buffer
    masked to the pairs read: on CUDA an attention call of a new key length was planned anew,
    62 ms a draft step."""
    head, _, _ = a_head(tmp_path)
    lengths: list[int] = []
    draft = TorchHead.draft

    def spy(self, hidden, tokens, k, context=None):
        assert context is not None
        lengths.append(context[0].shape[2])
        return draft(self, hidden, tokens, k, context)

    monkeypatch.setattr(TorchHead, "draft", spy)
    context = torch.zeros(4, 2, 256 + 3, 2, 16)
    for counts in ([1, 7], [256, 300]):
        head.draft_rows(torch.randn(2, HIDDEN), torch.tensor([3, 4]), 3, context, [0, 2], counts)
    assert lengths == [259, 259]


def holding(head: EagleHead, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A context of 3 rows, 256 + 3 slots, whose row 1 has read the pairs (feats, tokens) (the
    last 256 of them, each in its ring slot), written by `head`."""
    context = torch.zeros(3, 2, 256 + 3, 2, 16)
    kept = torch.arange(len(tokens))[-256:]
    head.write_pairs(feats[kept], tokens[kept], kept, context, torch.ones_like(kept), kept % 256)
    return context


def test_the_c_kernels_draft_as_the_float_head(tmp_path):
    """On the CPU the head runs in the C kernels (Q8_0 matrices, eagle_cpu.py). Over a context
    that holds 7 pairs and over a full ring (280 read; the drafts' own pairs go to the slots
    after it): the keys of the float head within Q8_0's rounding, the same drafts, and the
    pairs read (and other rows) left as they were by drafting."""
    floats, embed, lm_head = a_head(tmp_path)
    head = EagleHead(tmp_path / "head.npz", embed, lm_head, VOCAB, 1e-5)
    assert isinstance(head.backend, CpuHead) and isinstance(floats.backend, TorchHead)
    gen = torch.Generator().manual_seed(6)
    feats = torch.randn(300, HIDDEN, generator=gen)
    tokens = torch.randint(0, VOCAB, (300,), generator=gen)
    for read in (7, 280):
        mine, theirs = (
            holding(head, feats[:read], tokens[:read]),
            holding(floats, feats[:read], tokens[:read]),
        )
        torch.testing.assert_close(mine, theirs, atol=0.05, rtol=0.05)
        before = mine.clone()
        last = slice(read - 1, read)
        drafts = head.draft_rows(feats[last], tokens[last], 3, mine, [1], [read])
        expected = floats.draft_rows(feats[last], tokens[last], 3, theirs, [1], [read])
        assert drafts.tolist() == expected.tolist()
        ring = min(read, 256)
        assert torch.equal(mine[1, :, :ring], before[1, :, :ring])
        assert not mine[[0, 2]].any()


def test_slots_no_pair_was_written_to_move_no_draft(tmp_path):
    """The float head (CUDA's) attends the whole buffer, masked: a slot that holds no pair
    read is whatever the arena's memory held before (a row's earlier request, another kind's
    buffer; NaN where float32 bytes read as bfloat16). A masked NaN key or value still made the
    attention NaN (NaN times a zero weight), every draft the draft vocabulary's first token."""
    head, _, _ = a_head(tmp_path)
    gen = torch.Generator().manual_seed(7)
    feats = torch.randn(20, HIDDEN, generator=gen)
    tokens = torch.randint(0, VOCAB, (20,), generator=gen)
    clean = holding(head, feats, tokens)
    dirty = clean.clone()
    dirty[1, :, 20:] = float("nan")  # past the 20 pairs read: the ring's rest, the draft slots
    dirty[0] = float("nan")  # another request's row
    last = slice(19, 20)
    drafts = head.draft_rows(feats[last], tokens[last], 3, dirty, [1], [20])
    expected = head.draft_rows(feats[last], tokens[last], 3, clean, [1], [20])
    assert drafts.tolist() == expected.tolist()
    tree = head.draft_tree(feats[last], tokens[last], (-1, 0, 0, 1, 2), dirty, [1], [20])
    assert (
        tree.tolist()
        == head.draft_tree(feats[last], tokens[last], (-1, 0, 0, 1, 2), clean, [1], [20]).tolist()
    )
