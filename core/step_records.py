"""A step's two records: its plan (what the executor runs, recorded as StepPlanned) and its
result (the outputs, recorded as StepFinished with its memory report, and the leak reports),
and its cost, which moves the automatic speculation threshold.

`StepRecords` is a part of `Engine` (a base class), kept in its own file so that the engine reads
as its step; the attributes it uses are the engine's, declared here.
"""

from __future__ import annotations

import operator

import attrs
import structlog

from memstep.core import request_log
from memstep.core.block_manager import BlockManager
from memstep.core.config import EngineConfig
from memstep.core.executor import Executor, OwnProcess
from memstep.core.grammar import constraint_book
from memstep.core.growth import StepWork
from memstep.core.host_memory import HostWatch, rss_bytes
from memstep.core.output_book import OutputBook
from memstep.core.outputs import RequestOutput
from memstep.core.request import Request
from memstep.core.scheduler import Scheduled, StepBatch
from memstep.core.spec_threshold import SpecThreshold
from memstep.events.plan import Admission, SeqPlan, StepPlan, StepResult
from memstep.events.types import LeakSuspected, MemoryReport, StepFinished, StepPlanned

log = structlog.get_logger("memstep.engine")

# a step's thousand SeqResults are added up at C speed
_TOKEN_IDS = operator.attrgetter("token_ids")
_PROPOSED = operator.attrgetter("num_proposed")
_ACCEPTED = operator.attrgetter("num_accepted")


class StepRecords:
    """Makes each step's plan and records its result."""

    cfg: EngineConfig
    executor: Executor
    step_no: int
    state: str
    requests: dict[str, Request]
    book: OutputBook
    host_watch: HostWatch
    last_memory: MemoryReport | None
    spec_threshold: SpecThreshold
    decides_spec_threshold: bool
    _finished_ids: list[str]

    @property
    def blocks(self) -> BlockManager:
        raise NotImplementedError  # the engine's

    def emit(self, rec: object) -> None:
        raise NotImplementedError  # the engine's

    def _cache_blocks(self, req: Request) -> None:
        raise NotImplementedError  # the engine's

    def set_spec_threshold(
        self, threshold: int | None, rates: list[list], gaps: list[list] | None = None
    ) -> None:
        raise NotImplementedError  # the engine's

    def _plan(self, batch: StepBatch) -> StepPlan:
        """The step's plan for the executor, recorded as StepPlanned.  Every running request
        passes here every step: a decode's row is made from a few attributes; an admission's
        first plan and a prompt chunk go through `_first_seq_plan`."""
        seqs: list[SeqPlan] = []
        admitted: list[Admission] = []
        composition: list[list] = []
        cached: list[list] = []  # the record of reused pages: replay reproduces the hits
        table_of = self.blocks.table
        num_tokens = 0
        for s in batch.seqs:
            req, n = s.request, s.num_tokens
            start, num_prompt = req.num_computed, len(req.prompt_token_ids)
            if start == req.admitted_at or start < num_prompt:
                seqs.append(self._first_seq_plan(s, batch.kind, cached, admitted))
            else:  # decoding, or recomputing its output after a preemption
                out, at = req.output_token_ids, start - num_prompt
                table, sent = table_of(req.request_id), req.table_sent
                req.table_sent = len(table)
                seqs.append(
                    SeqPlan(
                        request_id=req.request_id,
                        start_pos=start,
                        token_ids=out[at : at + n],
                        block_table=table[sent:],
                        samples=at + n == len(out),
                        num_drafts=s.num_drafts,
                        prompt_len=num_prompt,
                        num_pages_held=sent,
                    )
                )
            composition.append([req.request_id, n])
            num_tokens += n + s.num_drafts
        finished, self._finished_ids = self._finished_ids, []
        self.emit(StepPlanned(self.step_no, batch.kind, composition, num_tokens, cached))
        return StepPlan(
            step=self.step_no, kind=batch.kind, seqs=seqs, finished=finished, admitted=admitted
        )

    def _first_seq_plan(
        self, s: Scheduled, kind: str, cached: list[list], admitted: list[Admission]
    ) -> SeqPlan:
        """The plan of an admission's first step (its Admission, with its params and the tokens
        before it, in `admitted`; the pages a prefix hit reuses in `cached`) or of a prompt
        chunk."""
        req = s.request
        start, stop = req.num_computed, req.num_computed + s.num_tokens
        table = list(self.blocks.table(req.request_id))
        req.table_sent = len(table)  # the whole table: the executor starts it afresh
        if start == req.admitted_at:  # an admission's first plan
            prefix_ids = req.token_at(0, start)
            admitted.append(
                Admission(request_id=req.request_id, params=req.params, prefix_ids=prefix_ids)
            )
            if start:
                cached.append([req.request_id, start, table[: start // self.cfg.block_size]])
        request_log.planned(self.step_no, kind, s)
        return SeqPlan(
            request_id=req.request_id,
            start_pos=start,
            token_ids=req.token_at(start, stop),
            block_table=table,
            samples=stop == req.num_tokens,  # Scheduled.samples
            num_drafts=s.num_drafts,
            prompt_len=req.num_prompt_tokens,
        )

    def _record(self, batch: StepBatch, result: StepResult) -> list[RequestOutput]:
        work = _work(batch)  # before _advance moves the requests on
        for rec in [*result.exited, *result.entered]:
            self.emit(rec)
        if result.entered:
            self.state = result.entered[-1].kind
            log.info(
                "kind",
                step=self.step_no,
                old=result.exited[0].kind if result.exited else None,
                new=batch.kind,
                batch_size=len(batch.seqs),
                bytes_released=sum(r.bytes_released for r in result.exited),
                bytes_claimed=sum(r.bytes_claimed for r in result.entered),
                live_bytes=result.memory.live_bytes,
            )
        for scored in result.prompt_logprobs:
            req = self.requests.get(scored.request_id)
            if req is not None:
                req.add_prompt_logprobs(scored.start, scored.entries)
        outputs, sampled, filled = self.book.advance(self.step_no, batch, result.seqs)
        failed = [rid for rid in result.failed if rid in self.requests]
        for rid in failed:
            outputs.append(self.book.fail(self.step_no, self.requests[rid], result.failed[rid]))
        for req in filled:
            if not req.is_finished:  # a finished request cached its blocks in _finish
                self._cache_blocks(req)
        used, cached = self.blocks.num_used, self.blocks.num_cached
        memory = attrs.evolve(
            result.memory,
            kv_pages_used=used,
            kv_pages_cached=cached,
            core_rss_bytes=rss_bytes(),
            constraint_cache_bytes=constraint_book().verdicts.num_bytes,
        )
        proposed = sum(map(_PROPOSED, result.seqs))
        accepted = sum(map(_ACCEPTED, result.seqs))
        self.emit(StepFinished(self.step_no, batch.kind, sampled, proposed, accepted, memory))
        request_log.step_done(self.step_no, batch, memory)
        if proposed:
            log.debug("spec step", step=self.step_no, proposed=proposed, accepted=accepted)
        for leak in [*result.leaks, *self._watch_core(batch.kind, memory.core_rss_bytes, work)]:
            log_leak(leak)
            self.emit(leak)
        self.last_memory = memory
        return outputs

    def _watch_core(self, kind: str, rss: int, work: StepWork) -> list:
        """Host growth of this process; an executor in this process reports it already."""
        if not isinstance(self.executor, OwnProcess):
            return []
        return self.host_watch.observe(self.step_no, kind, rss, work)

    def _observe_cost(
        self, batch: StepBatch, decode: bool, result: StepResult, seconds: float
    ) -> None:
        """Count a step and, unless replaying, keep a decode step's cost and record a new
        automatic speculation threshold where the costs call for one (core/spec_threshold.py)."""
        spec = self.spec_threshold
        tokens = sum(map(len, map(_TOKEN_IDS, result.seqs)))
        measured = seconds if self.decides_spec_threshold else None
        spec.observe(batch.kind, len(batch.seqs), decode, tokens, measured)
        if decode and spec.is_auto and self.decides_spec_threshold and spec.may_change:
            threshold = spec.decide()
            if threshold != spec.threshold:
                self.set_spec_threshold(threshold, spec.figures())


def log_leak(leak: LeakSuspected) -> None:
    """A leak as a warning; a high-water mark (a figure rose once and stayed) as information,
    which a clean session has and no one should be alarmed by."""
    if leak.is_leak:
        log.warning("leak suspected", **attrs.asdict(leak))
    else:
        log.info("memory high-water mark", **attrs.asdict(leak))


def _work(batch: StepBatch) -> StepWork:
    """A step's rows and tokens, and the requests it starts (none of their tokens computed)."""
    admitted = sum(1 for s in batch.seqs if s.request.num_computed == 0)
    return StepWork(len(batch.seqs), batch.num_tokens, admitted)
