"""Draft trees (EAGLE-2 style, `speculative_tree`): lossless greedy and sampled output, only the
accepted path's K/V kept, and the seed-shaped leak still found with trees on."""

from __future__ import annotations

import collections

import pytest
import torch
from drafted_position import CRITICAL, chi_square, find_position, second_tokens

from memstep.cli.scenarios import run_scenario
from memstep.core.config import ConfigError, EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.core.spec_tree import tree_depths, tree_parents, tree_path, tree_size
from memstep.events.types import LeakSuspected, is_leak
from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.model import attention
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime.random_stream import ACCEPT, SIBLING, uniform
from memstep.executors.runtime.sampler import Row
from memstep.executors.spec import tree as spec_tree
from memstep.executors.spec.eagle import CONTEXT, AttnShape, init_params, save_head
from memstep.executors.spec.proposers import DraftTree, EagleProposer

TREE = (3, 2)

# speculation at a fixed K and threshold: what these tests compare must not adapt under them
FIXED = dict(speculative_auto_disable=False, speculative_adaptive_k=False)


def test_a_tree_is_numbered_breadth_first_and_cut_as_a_prefix():
    assert tree_parents((2, 2), 2) == (-1, 0, 0, 1, 1, 2, 2)
    assert tree_parents((2, 2), 3)[:7] == tree_parents((2, 2), 2)  # depth 3: one child each
    assert tree_size((3, 2), 3) == 3 + 6 + 6 and tree_size((), 4) == 4
    assert (
        EngineConfig(speculative_method="eagle", speculative_tree=(3, 2)).num_lookahead_slots == 15
    )
    with pytest.raises(ConfigError, match="eagle"):
        EngineConfig(speculative_method="ngram", speculative_tree=(2,))
    with pytest.raises(ConfigError, match="nodes"):
        EngineConfig(
            speculative_method="eagle", num_speculative_tokens=6, speculative_tree=(4, 4, 4)
        )


# --- greedy: the plain output, token for token ----------------------------------------------


@pytest.mark.parametrize("quantization", ["none", "q4"])
def test_greedy_tree_equals_greedy_smollm2(quantization, smol_engine, chat_prompts, monkeypatch):
    """The committed head's tree, float32 activations (float weights, or the GGUF's q4 blocks,
    whose verify rows run as one C call, `DecodeStep`): the plain greedy output, drafts
    accepted, and some accepted paths through a node that is not its parent's first child
    (their K/V rows moved)."""
    moved = []
    move = spec_tree.move_slots
    monkeypatch.setattr(
        spec_tree, "move_slots", lambda kv, a, b: (moved.append(len(a)), move(kv, a, b))
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    base = dict(dtype="float32", quantization=quantization, max_num_seqs=4)
    plain = smol_engine if quantization == "none" else local_engine(EngineConfig(**base))
    ref = [c.token_ids for c in plain.generate(chat_prompts[:4], params)]
    cfg = EngineConfig(**base, **FIXED, speculative_method="eagle", speculative_tree=TREE)
    done = local_engine(cfg).generate(chat_prompts[:4], params)
    assert [c.token_ids for c in done] == ref
    assert sum(c.num_accepted for c in done) > 10 and sum(moved) > 0


def random_head(path, mc) -> str:
    """A head of random weights for `mc` (its drafts are replaced in these tests)."""
    shape = AttnShape(mc.num_heads, mc.num_kv_heads, mc.head_dim, 10000, CONTEXT)
    params = init_params(mc.hidden_size, 32, seed=0, attention=shape)
    meta = {"hidden": mc.hidden_size, "vocab": mc.vocab_size, "intermediate": 32}
    meta |= {"heads": mc.num_heads, "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim}
    meta |= {"rope_theta": 10000, "window": CONTEXT, "prompt_context": 0}
    save_head(path, params, torch.arange(mc.vocab_size), meta)
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """random:tiny in float32: prompts, their greedy replies and a head file."""
    plain = local_engine(EngineConfig(model="random:tiny", dtype="float32", max_num_seqs=4))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (8 + 5 * i,), generator=gen).tolist() for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    replies = [c.token_ids for c in plain.generate(prompts, params)]
    head = random_head(
        tmp_path_factory.mktemp("head") / "tiny.npz", plain.executor.worker.model_cfg
    )
    return prompts, replies, head


def oracle(replies: dict[tuple[int, ...], list[int]], vocab: int):
    """`EagleProposer.propose_tree` whose trees hold the greedy continuation as the last child
    of each node on it (its siblings wrong): every accepted path leaves the first children."""

    def propose_tree(self, seqs, ks, widths):
        trees = []
        for seq, k in zip(seqs, ks, strict=True):
            tokens = self.requests[seq.request_id].tokens
            prompt = next(p for p in replies if tuple(tokens[: len(p)]) == p)
            truth = replies[prompt][len(tokens) - len(prompt) :]
            parents = tree_parents(widths, k)
            depths = tree_depths(parents)
            on_truth, drafts = {0}, []
            for node in range(1, len(parents)):
                want = truth[depths[node] - 1] if depths[node] <= len(truth) else 0
                last = node + 1 == len(parents) or parents[node + 1] != parents[node]
                if parents[node] in on_truth and last:
                    on_truth.add(node)
                    drafts.append(want)
                else:
                    drafts.append((want + node) % vocab)
            trees.append(DraftTree(drafts, parents) if k else None)
        return trees

    return propose_tree


def tiny_tree_run(tiny, monkeypatch) -> tuple[list[list[int]], int]:
    """The tiny model with the oracle's trees: each reply, and the drafts accepted."""
    prompts, replies, head = tiny
    monkeypatch.setattr(
        EagleProposer,
        "propose_tree",
        oracle(dict(zip(map(tuple, prompts), replies, strict=True)), 512),
    )
    cfg = EngineConfig(
        model="random:tiny",
        dtype="float32",
        max_num_seqs=4,
        speculative_method="eagle",
        draft_model=head,
        speculative_tree=TREE,
        **FIXED,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    done = local_engine(cfg).generate(prompts, params)
    return [c.token_ids for c in done], sum(c.num_accepted for c in done)


@pytest.fixture(params=["c", "torch"])
def attention_path(request, monkeypatch):
    """The CPU's C decode attention over each node's path (`query_remap`), or torch's
    attention with the tree mask (no C kernel)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "attends", lambda head_dim: False)
    return request.param


def test_greedy_tree_equals_greedy_random_tiny(tiny, attention_path, monkeypatch):
    replies, accepted = tiny_tree_run(tiny, monkeypatch)
    assert replies == tiny[1]
    assert accepted > 40, "every path through last children, each accepted whole"


def test_a_rejected_branch_s_kv_left_in_place_changes_the_output(tiny, monkeypatch):
    """Broken on purpose: the accepted path's rows not moved, so later steps read a rejected
    sibling's K/V at a position the path now holds."""
    monkeypatch.setattr(spec_tree, "move_slots", lambda kv, src, dst: None)
    replies, _ = tiny_tree_run(tiny, monkeypatch)
    assert replies != tiny[1]


@pytest.mark.parametrize("path", ["c", "torch"])
def test_a_wrong_tree_mask_changes_the_output(tiny, path, monkeypatch):
    """Broken on purpose: each node attends the nodes numbered 1..its depth (a chain's rows)
    instead of its ancestors."""
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "attends", lambda head_dim: False)
    monkeypatch.setattr(
        attention,
        "tree_path",
        lambda parents, node: list(range(1, len(tree_path(parents, node)) + 1)),
    )
    replies, _ = tiny_tree_run(tiny, monkeypatch)
    assert replies != tiny[1]


# --- the acceptance rule, statistically ------------------------------------------------------

P = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
TRIALS = 6000


class Residual:
    """The `spec` kind's `residual` workspace, as `accept_tree` reads it."""

    held = {"residual": torch.empty(2, len(P))}


def first_tokens(rule) -> torch.Tensor:
    """The first token appended over TRIALS seeds: a root with three children (tokens 1, 3,
    4: the target's likeliest), each with one child, every node's target distribution P."""
    tree = DraftTree([1, 3, 4, 2, 2, 2], (-1, 0, 0, 0, 1, 2, 3))
    counts = torch.zeros(len(P))
    for seed in range(TRIALS):
        params = SamplingParams(temperature=1.0, seed=seed)
        rows = [Row(params, 10 + (node > 0) + (node > 3), [], 0) for node in range(7)]
        tokens, path = rule(P.expand(7, -1), rows, tree, Residual())
        assert len(tokens) == len(path) + 1
        counts[tokens[0]] += 1
    return counts


def test_tree_acceptance_keeps_the_target_distribution():
    counts = first_tokens(spec_tree.accept_tree)
    expected = P * counts.sum()
    assert float(((counts - expected) ** 2 / expected).sum()) < 20.5  # 5 dof, p = 0.001


def test_a_wrong_sibling_rule_fails_the_same_test():
    """Broken on purpose: a rejected child's mass left in, so later siblings are tried against
    the whole distribution."""

    def keeps_mass(p, rows, tree, spec):
        for i, child in enumerate(tree.children()[0]):
            u = uniform(rows[0].seed, rows[0].position, ACCEPT if i == 0 else SIBLING + i)
            if u < float(p[0, tree.token(child)]):
                return [tree.token(child), 0], [child]
        return [0], []

    counts = first_tokens(keeps_mass)
    expected = P * counts.sum()
    assert float(((counts - expected) ** 2 / expected).sum()) > 20.5


# --- sampled: the target's distribution at a drafted position --------------------------------


def tree_runs(prompt: list[int]) -> tuple[collections.Counter, int, int]:
    """`second_tokens` with a tree: the drafted position's three candidates (the head's top
    three, tried in turn), every run's one tree step; and the drafts accepted."""
    cfg = EngineConfig(
        speculative_method="eagle",
        num_speculative_tokens=1,
        speculative_tree=(3,),
        max_num_seqs=32,
        **FIXED,
    )
    seconds, mode, done = second_tokens(local_engine(cfg), prompt, 3)
    return seconds, mode, sum(c.num_accepted for c in done)


@pytest.fixture(scope="module")
def drafted_position(chat_prompts):
    return find_position(chat_prompts)


@pytest.mark.slow  # 640 sampled runs (test_tree_acceptance_... is the small version)
def test_sampled_tokens_at_a_tree_drafted_position_follow_the_target(drafted_position):
    prompt, first, top = drafted_position
    seconds, mode, accepted = tree_runs(prompt)
    assert mode == first and accepted > 0 and sum(seconds.values()) > 400
    stat, bins = chi_square(seconds, top)
    assert bins >= 2 and stat < CRITICAL[bins], (stat, bins, seconds, top)


@pytest.mark.slow  # 640 sampled runs (test_tree_acceptance_... is the small version)
def test_the_same_test_fails_when_the_first_child_is_always_kept(drafted_position, monkeypatch):
    """Broken on purpose: a node's first child accepted whatever the target says."""
    prompt, _, top = drafted_position

    def first_child(p, rows, tree, spec):
        kids = tree.children()
        node, tokens, path = 0, [], []
        while kids[node]:
            node = kids[node][0]
            path.append(node)
            tokens.append(tree.token(node))
        return [*tokens, int(p[node].argmax())], path

    monkeypatch.setattr(spec_tree, "accept_tree", first_child)
    seconds, _, _ = tree_runs(prompt)
    stat, bins = chi_square(seconds, top)
    assert stat > CRITICAL[bins]


# --- memory: the seed-shaped leak is still found, and a clean run stays clean ----------------


def test_spec_disable_with_trees_is_clean_and_the_seed_shape_is_still_named():
    records, rows = run_scenario(
        "spec-disable", 40, "smollm2", overrides={"speculative_tree": TREE}
    )
    assert not [r for r in records if is_leak(r)]
    assert all(r.verdict == "ok" for r in rows)
    records, rows = run_scenario(
        "spec-disable",
        60,
        "smollm2",
        plant="spec_holder_hidden_states",
        overrides={"speculative_tree": TREE},
    )
    leaks = [r for r in records if isinstance(r, LeakSuspected)]
    assert leaks and leaks[0].kind == "no_spec" and leaks[0].what == "live_growth"
    assert "grew: spec.previous_hidden_states +" in leaks[0].detail, leaks[0].detail
    assert {r.kind: r.verdict for r in rows}["no_spec"] == "LEAK"


# --- CUDA: the tree's verify through torch's attention with the mask (the lead runs these) ---


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("broken", [False, True])
def test_greedy_tree_equals_greedy_on_cuda(tmp_path, broken, monkeypatch):
    """float32 on CUDA, graphs on: the oracle's trees give plain greedy decoding's tokens (tree
    steps never replay the decode graphs, whose rows are consecutive positions); with the
    accepted rows left unmoved they do not."""
    base = dict(model="random:smollm2-135m", dtype="float32", device="cuda", max_num_seqs=4)
    base |= dict(max_model_len=512, num_kv_blocks=512)
    plain = local_engine(EngineConfig(**base))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40000, (9 + 4 * i,), generator=gen).tolist() for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    replies = [c.token_ids for c in plain.generate(prompts, params)]
    mc = plain.executor.worker.model_cfg
    plain.shutdown()
    monkeypatch.setattr(
        EagleProposer,
        "propose_tree",
        oracle(dict(zip(map(tuple, prompts), replies, strict=True)), mc.vocab_size),
    )
    if broken:
        monkeypatch.setattr(spec_tree, "move_slots", lambda kv, src, dst: None)
    head = random_head(tmp_path / "head.npz", mc)
    cfg = EngineConfig(
        **base, **FIXED, speculative_method="eagle", draft_model=head, speculative_tree=TREE
    )
    done = local_engine(cfg).generate(prompts, params)
    assert ([c.token_ids for c in done] == replies) is not broken
    assert sum(c.num_accepted for c in done) > 40


# --- the kernels: a node's keys read through its path ----------------------------------------


def tree_rows(seed: int = 0):
    """Paged caches and 4 rows of one tree at base 37 (nodes 0..5: 0 -> 1, 2; 1 -> 3; 2 -> 4
    -> 5): each node's path positions past the base."""
    gen = torch.Generator().manual_seed(seed)
    bs, kvh, d, heads = 16, 2, 64, 4
    k_cache = torch.randn(8, bs, kvh, d, generator=gen)
    v_cache = torch.randn(8, bs, kvh, d, generator=gen)
    base, paths = 37, {1: [0, 1], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 2, 4, 5]}
    table = torch.tensor([5, 2, 7, 0], dtype=torch.int32)
    remap = torch.full((4, 4), -1, dtype=torch.int32)
    for r, path in enumerate(paths.values()):
        remap[r, : len(path)] = torch.tensor([base + a for a in path])
    lens = torch.tensor([base + len(p) for p in paths.values()], dtype=torch.int32)
    bases = torch.full((4,), base, dtype=torch.int32)
    q = torch.randn(4, heads, d, generator=gen)
    return q, k_cache, v_cache, table.repeat(4, 1), lens, bases, remap


def tree_reference(q, k_cache, v_cache, tables, lens, bases, remap, scale):
    """Each row over its keys gathered one by one: the context, then its path."""
    bs, kvh, d = k_cache.shape[1:]
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        base, n = int(bases[r]), int(lens[r])
        positions = [*range(base), *remap[r, : n - base].tolist()]
        slots = [int(tables[r, p // bs]) * bs + p % bs for p in positions]
        k, v = k_cache.view(-1, kvh, d)[slots], v_cache.view(-1, kvh, d)[slots]
        out[r] = torch.nn.functional.scaled_dot_product_attention(
            q[r][None, :, None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            scale=scale,
            enable_gqa=True,
        )[0, :, 0]
    return out


def test_c_decode_attention_reads_a_node_s_keys_through_its_path():
    if not cpu_kernels.attends(64):
        pytest.skip("no C kernels here")
    q, k, v, tables, lens, bases, remap = tree_rows()
    expected = tree_reference(q, k, v, tables, lens, bases, remap, 0.125)
    got = cpu_kernels.decode_attention(q, k, v, tables, lens, 0.125, None, bases, remap)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    plain = cpu_kernels.decode_attention(q, k, v, tables, lens, 0.125)  # the path ignored
    assert not torch.allclose(plain, expected, atol=1e-3)


@pytest.mark.parametrize("split", [False, True])
def test_triton_decode_attention_reads_a_node_s_keys_through_its_path(split):
    """In Triton's interpreter on a machine without CUDA (tests/conftest.py sets it)."""
    pytest.importorskip("triton")
    from memstep.executors.cuda.kernels import DecodeWorkspace, paged_decode_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [t.to(device) for t in tree_rows()]
    q, k, v, tables, lens, bases, remap = rows
    expected = tree_reference(*[t.cpu() for t in rows], 0.125)
    ws = DecodeWorkspace.allocate(4, q.shape[1], q.shape[2], 64, device, 16) if split else None
    got = paged_decode_attention(
        q, k, v, tables, lens, 0.125, None, ws, split, bases=bases, remap=remap
    )
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    plain = paged_decode_attention(q, k, v, tables, lens, 0.125, None, ws, split)
    assert not torch.allclose(plain.cpu(), expected, atol=1e-3)
