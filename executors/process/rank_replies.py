"""Rank 0's one reply to the core from every rank's reply to the same message.

The ranks of a tensor-parallel executor run each message in lock-step, so their replies must
agree on what the state machine did (the kinds exited and entered, the phase) and, since every
rank samples whole logit rows, on the tokens.  A disagreement is an `ExecutorError` (the core
then restarts the executor): ranks that drifted apart would compute garbage from then on.
What is each rank's own comes back whole: every rank's memory report (`StepResult.rank_memory`),
every rank's phase figures (`info["per_rank"]`) and memory plan (`rank_memory_plans`), and every
rank's leak reports, named by rank.
"""

from __future__ import annotations

import attrs

from memstep.events.plan import PhaseReply, StepResult
from memstep.events.types import LeakSuspected
from memstep.events.wire import ExecutorError, ExecutorReady


class RanksDisagree(RuntimeError):
    """Two ranks did different things with one message."""


def merge_replies(replies: list[object]) -> object:
    """One reply from every rank's (rank 0's first) to the same message."""
    first = replies[0]
    for rank, reply in enumerate(replies):
        if isinstance(reply, ExecutorError):
            return ExecutorError(reply.code, f"rank {rank}: {reply.message}")
        if type(reply) is not type(first):
            return _disagree(f"rank {rank} answered {type(reply).__name__}")
    try:
        return _merge(first, replies)
    except RanksDisagree as exc:
        return _disagree(str(exc))


def _disagree(why: str) -> ExecutorError:
    return ExecutorError("ranks_disagree", f"tensor-parallel ranks out of lock-step: {why}")


def _merge(first: object, replies: list) -> object:
    if isinstance(first, StepResult):
        _same(replies, "kinds", _moves)
        _same(replies, "sampled tokens", lambda r: [(s.request_id, s.token_ids) for s in r.seqs])
        memory = [r.memory for r in replies]
        return attrs.evolve(first, rank_memory=memory, leaks=_leaks(replies))
    if isinstance(first, PhaseReply):
        _same(replies, "phase and kinds", lambda r: (r.phase, _moves(r)))
        figures = [r.figures for r in replies]
        plans = [r.memory_plan for r in replies if r.memory_plan is not None]
        return attrs.evolve(
            first, rank_figures=figures, leaks=_leaks(replies), rank_memory_plans=plans
        )
    if isinstance(first, ExecutorReady):
        pids = ",".join(str(r.pid) for r in replies)
        return attrs.evolve(first, device=f"{first.device} x{len(replies)} ranks (pids {pids})")
    return first


def _moves(reply) -> tuple:
    return ([e.kind for e in reply.exited], [e.kind for e in reply.entered])


def _same(replies: list, what: str, key) -> None:
    want = key(replies[0])
    for rank, reply in enumerate(replies[1:], start=1):
        got = key(reply)
        if got != want:
            raise RanksDisagree(f"{what}: rank 0 {want}, rank {rank} {got}")


def _leaks(replies: list) -> list[LeakSuspected]:
    """Every rank's leak reports; those of ranks 1..N-1 say which rank in their detail."""
    leaks = list(replies[0].leaks)
    for rank, reply in enumerate(replies[1:], start=1):
        leaks += [attrs.evolve(leak, detail=f"rank {rank}: {leak.detail}") for leak in reply.leaks]
    return leaks
