"""The engine core: plan the step, apply the transition, run, record.

It decides and never touches device tensors: the executor (in-process or behind ZeroMQ) runs
each plan.  Every input and every derived fact is emitted as a typed record to the sinks (the
event log writer, tests), which is what makes a run replayable.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

import attrs
import structlog

from memstep.core.block_manager import BlockManager
from memstep.core.config import EngineConfig
from memstep.core.model_source import model_config, resolve
from memstep.core.outputs import Completion, RequestOutput
from memstep.core.request import Request, Status
from memstep.core.sampling_params import InvalidRequest, SamplingParams
from memstep.core.scheduler import Scheduler, StepBatch
from memstep.core.shapes import max_model_len
from memstep.core.tokenizer import load_tokenizer
from memstep.events.plan import SeqPlan, StepPlan, StepResult
from memstep.events.types import (
    EngineStarted,
    PhaseChanged,
    RequestAborted,
    RequestAdded,
    RequestFinished,
    StepFinished,
    StepPlanned,
)
from memstep.events.version import VERSION

log = structlog.get_logger("memstep.engine")

Sink = Callable[[object], None]


class UnknownRequest(KeyError):
    code = "unknown_request"


class Engine:
    """The engine core. `executor_factory(cfg, max_model_len)` starts the executor that runs
    its plans (in this process or behind ZeroMQ): the caller picks it, the core imports none."""

    def __init__(
        self,
        cfg: EngineConfig,
        executor_factory: Callable,
        sinks: Iterable[Sink] = (),
    ):
        self.cfg = cfg
        self.sinks = list(sinks)
        self.source = resolve(cfg.model, cfg.seed)
        self.model_cfg = model_config(self.source)
        self.max_model_len = max_model_len(cfg, self.model_cfg)  # ConfigError beyond the model
        mc = self.model_cfg
        self.tokenizer = load_tokenizer(self.source, mc.vocab_size, mc.eos_token_ids)
        self.step_no = 0
        self.state = "boot"  # as the executor last reported it; the executor checks the table
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._ids = itertools.count()
        self.emit(EngineStarted(VERSION, cfg.to_dict(), self.source.identity))
        self.executor = executor_factory(cfg, self.max_model_len)
        self.memory_plan = self._phase("profile").info
        self.warmup_info = self._phase("warmup").info
        captured = self._phase("capture").info
        blocks = BlockManager(self.memory_plan["num_kv_blocks"], cfg.block_size)
        lookahead = 1 if captured.get("decode_ahead") else 0  # the executor replays ahead
        self.scheduler = Scheduler(cfg, blocks, self.max_model_len, lookahead)
        log.info("engine ready", model=self.source.label, max_model_len=self.max_model_len)

    # --- plumbing --------------------------------------------------------------------------

    def emit(self, rec: object) -> None:
        for sink in self.sinks:
            sink(rec)

    def _phase(self, phase: str):
        reply = self.executor.enter_phase(phase, self.step_no)
        self.emit(PhaseChanged(self.step_no, self.state, phase))
        log.info("phase", step=self.step_no, old=self.state, new=phase)
        self.state = phase
        for rec in [*reply.exited, *reply.entered]:
            self.emit(rec)
        return reply

    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks

    # --- inputs ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequest with a clear message."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        arrival = time.time() if arrival_time is None else arrival_time
        self.emit(RequestAdded(self.step_no, request_id, ids, params.to_dict(), arrival))
        req = Request(request_id, ids, params, self.tokenizer.decode)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequest("prompt is empty")
        vocab = self.model_cfg.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len}"
            )
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the context "
                f"of {self.max_model_len} tokens"
            )

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            raise UnknownRequest(f"unknown request id {request_id!r}")
        self.emit(RequestAborted(self.step_no, request_id))
        self._finish(req, "abort")

    # --- the step --------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Plan the step, apply the transition, run, record."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        plan = self._plan(batch)
        result = self.executor.execute(plan)
        outputs = self._record(batch, result)
        self.step_no += 1
        return outputs

    def _plan(self, batch: StepBatch) -> StepPlan:
        seqs = []
        for s in batch.seqs:
            req = s.request
            start = req.num_computed
            seqs.append(
                SeqPlan(
                    request_id=req.request_id,
                    start_pos=start,
                    token_ids=req.token_at(start, start + s.num_tokens),
                    block_table=list(self.blocks.table(req.request_id)),
                    samples=s.samples,
                    num_drafts=s.num_drafts,
                    prompt_len=req.num_prompt_tokens,
                    params=req.params.to_dict() if start == 0 else {},
                )
            )
        finished, self._finished_ids = self._finished_ids, []
        composition = [[s.request.request_id, s.num_tokens] for s in batch.seqs]
        self.emit(StepPlanned(self.step_no, batch.kind, composition, batch.num_tokens))
        return StepPlan(self.step_no, batch.kind, seqs, finished)

    def _record(self, batch: StepBatch, result: StepResult) -> list[RequestOutput]:
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
        by_id = {r.request_id: r for r in result.seqs}
        outputs: list[RequestOutput] = []
        sampled: list[list] = []
        for s in batch.seqs:
            req = s.request
            res = by_id.get(req.request_id)
            req.num_computed += s.num_tokens
            if res is None:
                continue
            req.num_computed += len(res.token_ids) - 1
            req.num_proposed += res.num_proposed
            req.num_accepted += res.num_accepted
            out = self._append(req, res.token_ids, res.logprobs)
            sampled.append([req.request_id, out.new_token_ids])
            outputs.append(out)
        memory = attrs.evolve(result.memory, kv_pages_used=self.blocks.num_used)
        proposed = sum(r.num_proposed for r in result.seqs)
        accepted = sum(r.num_accepted for r in result.seqs)
        self.emit(StepFinished(self.step_no, batch.kind, sampled, proposed, accepted, memory))
        if proposed:
            log.debug("spec step", step=self.step_no, proposed=proposed, accepted=accepted)
        for leak in result.leaks:
            log.warning("leak suspected", **attrs.asdict(leak))
            self.emit(leak)
        self.last_memory = memory
        return outputs

    def _append(self, req: Request, tokens: list[int], logprobs: list[list]) -> RequestOutput:
        """Append sampled tokens one by one until a stop condition; the output of this step."""
        p = req.params
        old_len = len(req.detok.text)
        new: list[int] = []
        reason = None
        for i, tok in enumerate(tokens):
            req.output_token_ids.append(tok)
            if i < len(logprobs):
                req.output_logprobs.append(logprobs[i])
            new.append(tok)
            if not p.ignore_eos and tok in self.model_cfg.eos_token_ids or tok in p.stop_token_ids:
                reason = "stop"
            elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                break
        req.detok.extend(req.output_token_ids, final=reason is not None)
        text = req.detok.text
        if p.stop and reason is None or reason == "length" and p.stop:
            cut = _find_stop(text, p.stop, old_len)
            if cut is not None:
                text, reason = text[:cut], "stop"
        out = RequestOutput(req.request_id, new, text[old_len:])
        out.logprobs = logprobs[: len(new)]
        if reason:
            self._finish(req, reason)
            out.finished, out.finish_reason = True, reason
            out.prompt_tokens = req.num_prompt_tokens
            out.completion_tokens = len(req.output_token_ids)
            out.num_proposed, out.num_accepted = req.num_proposed, req.num_accepted
        return out

    def _finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        self.scheduler.remove(req)
        self._finished_ids.append(req.request_id)
        del self.requests[req.request_id]
        usage = (req.num_prompt_tokens, len(req.output_token_ids))
        self.emit(RequestFinished(self.step_no, req.request_id, reason, *usage))
        if req.num_proposed:
            log.info(
                "speculation",
                request_id=req.request_id,
                proposed=req.num_proposed,
                accepted=req.num_accepted,
                acceptance_rate=round(req.num_accepted / req.num_proposed, 3),
            )

    # --- conveniences ----------------------------------------------------------------------

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        """Run prompts to completion as one continuous batch; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        done = self.run_until_idle()
        return [done[i] for i in ids]

    def run_until_idle(self) -> dict[str, Completion]:
        tokens: dict[str, list[int]] = {}
        texts: dict[str, str] = {}
        logprobs: dict[str, list] = {}
        done: dict[str, Completion] = {}
        while self.has_work():
            for out in self.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
                logprobs.setdefault(out.request_id, []).extend(out.logprobs)
                if out.finished:
                    ids = tokens.pop(out.request_id)
                    done[out.request_id] = Completion(
                        out.request_id,
                        texts.pop(out.request_id),
                        ids,
                        out.finish_reason or "",
                        out.prompt_tokens,
                        logprobs.pop(out.request_id),
                        out.num_proposed,
                        out.num_accepted,
                    )
        return done

    def shutdown(self) -> None:
        if self.state != "shutdown":
            self._phase("shutdown")
        self.executor.close()


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    begin = max(0, start - max(len(s) for s in stops))
    hits = [i for s in stops if (i := text.find(s, begin)) >= 0]
    return min(hits) if hits else None
