"""A running request's plan carries only its block table's new entries; the executor makes the
table whole. An executor that took the tail for the whole table would read other pages: the
greedy output changes (the check that the tail protocol needs, shown firing)."""

from __future__ import annotations

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime.running_requests import RunningRequests

CFG = EngineConfig(model="random:tiny", num_threads=1, block_size=4, enable_prefix_caching=False)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 17, 200, 3, 9, 11], [7, 8, 9], [100, 101, 102, 103, 104, 105, 106, 107, 108]]


def _plans_as_sent(engine) -> list[tuple[str, int, list[int]]]:
    """Wrap the executor: each plan's (request, num_pages_held, block_table) before it runs."""
    sent: list[tuple[str, int, list[int]]] = []
    execute = engine.executor.execute

    def noted(plan):
        sent.extend((s.request_id, s.num_pages_held, list(s.block_table)) for s in plan.seqs)
        return execute(plan)

    engine.executor.execute = noted
    return sent


def test_plans_carry_new_pages_only_and_the_output_is_unchanged():
    engine = local_engine(CFG)
    sent = _plans_as_sent(engine)
    out = [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]
    engine.shutdown()
    first = {rid: table for rid, start, table in reversed(sent) if start == 0}
    tails = [(rid, start, table) for rid, start, table in sent if start > 0]
    assert len(first) == len(PROMPTS) and tails, sent
    # 24 tokens past each prompt at 4 a page: most steps add no page, and send none
    assert sum(1 for _, _, table in tails if not table) > len(tails) // 2
    assert all(len(table) <= 1 for _, _, table in tails), tails
    whole = local_engine(CFG)  # every plan with the whole table, as before the tails
    plan = whole._plan

    def whole_tables(batch):
        for req in whole.requests.values():
            req.table_sent = 0
        return plan(batch)

    whole._plan = whole_tables
    sent_whole = _plans_as_sent(whole)
    assert [c.token_ids for c in whole.generate(PROMPTS, PARAMS)] == out
    whole.shutdown()
    assert all(start == 0 for _, start, _ in sent_whole) and len(sent_whole) == len(sent)


def test_an_executor_that_drops_the_pages_held_changes_the_output(monkeypatch):
    engine = local_engine(CFG)
    good = [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]
    engine.shutdown()

    def tail_only(seq, state):  # broken on purpose: the tail taken for the whole table
        state.table = seq.block_table

    monkeypatch.setattr(RunningRequests, "_whole_table", staticmethod(tail_only))
    broken = local_engine(CFG)
    try:
        bad = [c.token_ids for c in broken.generate(PROMPTS, PARAMS)]
    except Exception:  # a table too short to index: as good a failure
        bad = None
    finally:
        broken.shutdown()
    assert bad != good
