"""Rank 0's merge of every rank's reply, and the weight shards it relies on.

The lock-step checks are broken on purpose here (a rank that entered another kind, a rank that
sampled another token) and must answer with an error; the shards of a real model must put the
whole model back together.
"""

from __future__ import annotations

import attrs
import torch

from memstep.core.model_config import PRESETS
from memstep.core.model_source import resolve
from memstep.core.shapes import rank_model_config, vocab_shard_size
from memstep.events import codec
from memstep.events.plan import PhaseFigures, PhaseReply, SeqResult, StepResult
from memstep.events.types import LeakSuspected, MemoryReport, StateEntered
from memstep.events.wire import ExecutorError
from memstep.executors.model.sharding import Shard
from memstep.executors.model.weights import load_weights
from memstep.executors.process.rank_replies import merge_replies


def _result(rank: int, kind: str = "no_spec", token: int = 7) -> StepResult:
    memory = MemoryReport(1000 + rank, 1000 + rank, 3, 0, 0, 0)
    entered = [StateEntered(4, kind, 0, [])]
    leak = LeakSuspected(4, kind, "live_growth", 8, "live bytes 1 -> 9")
    seqs = [SeqResult("r", [token], [], 0, 0)]
    return StepResult(4, kind, seqs, memory, [], entered, [leak])


def test_agreeing_ranks_give_every_rank_s_memory_and_leaks():
    merged = merge_replies([_result(0), _result(1), _result(2)])
    assert isinstance(merged, StepResult)
    assert [m.live_bytes for m in merged.rank_memory] == [1000, 1001, 1002]
    assert merged.memory == merged.rank_memory[0]
    details = [leak.detail for leak in merged.leaks]
    assert details == [
        "live bytes 1 -> 9",
        "rank 1: live bytes 1 -> 9",
        "rank 2: live bytes 1 -> 9",
    ]
    assert codec.decode(codec.encode(merged)) == merged, "it travels on the wire"


def test_a_rank_in_another_kind_is_out_of_lock_step():
    merged = merge_replies([_result(0), _result(1, kind="spec")])
    assert isinstance(merged, ExecutorError) and merged.code == "ranks_disagree"
    assert "kinds" in merged.message and "rank 1" in merged.message


def test_a_rank_that_sampled_another_token_is_out_of_lock_step():
    merged = merge_replies([_result(0), _result(1), _result(2, token=8)])
    assert isinstance(merged, ExecutorError) and "sampled tokens" in merged.message


def test_a_rank_s_error_is_the_reply_and_names_the_rank():
    merged = merge_replies([_result(0), ExecutorError("exception", "boom")])
    assert merged == ExecutorError("exception", "rank 1: boom")


def test_phase_replies_carry_every_rank_s_figures():
    replies = [
        PhaseReply(
            phase="capture",
            figures=PhaseFigures(graph_pool_bytes=10 + r),
            exited=[],
            entered=[],
            leaks=[],
        )
        for r in range(2)
    ]
    merged = merge_replies(replies)
    assert isinstance(merged, PhaseReply)
    assert merged.figures.graph_pool_bytes == 10
    assert [f.graph_pool_bytes for f in merged.rank_figures] == [10, 11]
    other = attrs.evolve(replies[1], phase="warmup")
    assert isinstance(merge_replies([replies[0], other]), ExecutorError)


def test_shards_put_the_whole_model_back_together():
    model = attrs.evolve(PRESETS["tiny"], vocab_size=509)  # not a multiple of 2: padded
    source = resolve("random:tiny")
    whole = load_weights(source, model, torch.float32, torch.device("cpu"))
    shards = [
        load_weights(source, model, torch.float32, torch.device("cpu"), Shard(model, r, 2))
        for r in range(2)
    ]
    local = rank_model_config(model, 2)
    d = model.head_dim
    q, kv = local.num_heads * d, local.num_kv_heads * d
    parts = [s["layers.1.wqkv"].split([q, kv, kv]) for s in shards]
    qkv = torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
    assert torch.equal(qkv, whole["layers.1.wqkv"])
    gate_up = [s["layers.0.w_gate_up"].chunk(2) for s in shards]
    assert torch.equal(
        torch.cat([g for g, _ in gate_up] + [u for _, u in gate_up]), whole["layers.0.w_gate_up"]
    )
    for name in ("layers.0.wo", "layers.1.w_down"):
        assert torch.equal(torch.cat([s[name] for s in shards], dim=1), whole[name])
    rows = vocab_shard_size(model, 2)
    embed = torch.cat([s["embed"] for s in shards])
    assert embed.shape[0] == 2 * rows == 510
    assert torch.equal(embed[:509], whole["embed"]) and not embed[509:].any()
    assert torch.equal(shards[1]["norm"], whole["norm"])


def test_the_70b_preset_has_llama_3_1_70b_s_size_and_splits_over_8():
    model = PRESETS["llama-3.1-70b"]
    assert 70.5e9 < model.num_params < 70.6e9  # Llama-3.1-70B: 70.55 B parameters
    local = rank_model_config(model, 8)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (8, 1, 3584)
