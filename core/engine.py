"""The engine core: plan the step, apply the transition, run, record.

It decides and never touches device tensors: the executor (in-process or behind ZeroMQ) runs
each plan.  Every input and every derived fact is emitted as a typed record to the sinks (the
event log writer, tests), which is what makes a run replayable.

When the executor is lost (it died, went silent, or answered with an error) the engine records
the loss, enters `recover`, puts every unfinished request back in the queue and starts a new
executor, one start-up stage per `step()` so that its caller keeps answering clients.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Iterable

import attrs
import structlog

from memstep.core import lifecycle
from memstep.core.block_manager import BlockManager
from memstep.core.config import EngineConfig
from memstep.core.draft_length import adapt
from memstep.core.executor import (
    Checked,
    ExecutorFactory,
    OwnProcess,
    Submits,
    require_executor,
)
from memstep.core.grammar import TokenizerSpec, constraint_book, grammar_error
from memstep.core.growth import StepWork
from memstep.core.host_memory import HostWatch, rss_bytes
from memstep.core.model_source import model_config, resolve
from memstep.core.outputs import Completion, RequestOutput
from memstep.core.recovery import (
    START_STAGES,
    EngineDead,
    ExecutorDown,
    Recovery,
    RestartBudget,
    executor_config,
)
from memstep.core.request import Request, Status
from memstep.core.sampling_params import InvalidRequest, SamplingParams
from memstep.core.scheduler import Scheduled, Scheduler, StepBatch
from memstep.core.seeding import RequestSeeds, engine_seed
from memstep.core.shapes import check_tensor_parallel, max_model_len
from memstep.core.spec_threshold import SpecThreshold
from memstep.core.tokenizer import load_tokenizer, with_chat_template
from memstep.events.plan import (
    Admission,
    MemoryPlanned,
    SeqPlan,
    SeqResult,
    StepPlan,
    StepResult,
)
from memstep.events.types import (
    DraftLengthChanged,
    EngineStarted,
    ExecutorLost,
    PhaseChanged,
    RecoveryDone,
    RecoveryStarted,
    RequestAborted,
    RequestAdded,
    RequestFinished,
    RequestNamed,
    RequestPreempted,
    RequestResumed,
    SpecThresholdChanged,
    StepFinished,
    StepPlanned,
)
from memstep.events.version import VERSION

log = structlog.get_logger("memstep.engine")

Sink = Callable[[object], None]
# a step's thousand SeqResults are added up at C speed
_TOKEN_IDS = operator.attrgetter("token_ids")
_PROPOSED = operator.attrgetter("num_proposed")
_ACCEPTED = operator.attrgetter("num_accepted")


class UnknownRequest(KeyError):
    code = "unknown_request"


class Engine:
    """The engine core. `executor_factory(cfg, max_model_len)` starts the executor that runs
    its plans (in this process or behind ZeroMQ): the caller picks it, the core imports none.
    `decides_spec_threshold=False` (a replay): the automatic speculation threshold changes only
    where a recorded `SpecThresholdChanged` is applied (`set_spec_threshold`), never from the
    step costs this run measures."""

    def __init__(
        self,
        cfg: EngineConfig,
        executor_factory: ExecutorFactory,
        sinks: Iterable[Sink] = (),
        decides_spec_threshold: bool = True,
    ):
        seed = engine_seed(cfg)
        self.cfg = cfg = cfg.replace(seed=seed)  # recorded: a replay draws nothing from entropy
        self.sinks = list(sinks)
        self.seeds = RequestSeeds(seed)
        self.source = resolve(cfg.model, cfg.random_weights_seed, cfg.tokenizer)
        self.model_cfg = model_config(self.source)
        self.max_model_len = max_model_len(cfg, self.model_cfg)  # ConfigError beyond the model
        check_tensor_parallel(self.model_cfg, cfg.tensor_parallel_size)
        mc = self.model_cfg
        self.tokenizer = load_tokenizer(self.source, mc.vocab_size, mc.eos_token_ids)
        if cfg.chat_template is not None:  # vLLM's --chat-template
            self.tokenizer = with_chat_template(self.tokenizer, cfg.chat_template)
        spec = (cfg.model, cfg.random_weights_seed, cfg.tokenizer, mc.vocab_size, mc.eos_token_ids)
        constraint_book().use_model(TokenizerSpec(*spec))  # checks compile as the executor will
        # None: text by decoding (core/detokenizer.py); ids past the tokenizer's vocabulary (a
        # random model with another model's tokenizer) decode to nothing, as `decode` has them
        table = self.tokenizer.token_bytes()
        self.token_bytes = None if table is None else table + [b""] * (mc.vocab_size - len(table))
        self.step_no = 0
        self.state = "boot"  # as the executor last reported it; the executor checks the table
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._ids = itertools.count()
        self._resumed_ids: set[str] = set()  # kept from an earlier engine: never drawn again
        self.executor_factory = executor_factory
        self.restarts = RestartBudget(cfg.max_executor_restarts, cfg.executor_restart_window_s)
        self.recovery: Recovery | None = None
        self.death: str | None = None  # why the engine gave up on executors
        self.num_losses = 0
        self.num_failed = 0  # requests the executor could not go on with (`_fail`)
        self._aborted_in_recovery: list[str] = []
        self._launched: tuple[StepBatch, StepPlan, bool] | None = None  # launch() .. finish()
        self._launched_at = 0.0  # perf_counter when the launched step was handed over
        self.spec_kinds = SpecThreshold(cfg)
        self.decides_spec_threshold = decides_spec_threshold
        self.host_watch = HostWatch("core", cfg.host_leak_tolerance_mib << 20)
        self.emit(EngineStarted(VERSION, cfg.to_dict(), self.source.identity))
        for stage in START_STAGES:
            self._start_stage(stage)
        self.scheduler = Scheduler(
            cfg, self._pages(), self.max_model_len, self._lookahead(), self.spec_kinds
        )
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
        for rec in [*reply.exited, *reply.entered, *reply.leaks]:
            self.emit(rec)
        return reply

    def _start_stage(self, stage: str) -> None:
        """Start an executor (`start`) or take it through one start-up phase."""
        if stage == "start":
            restarted = self.recovery is not None
            first = self.recovery.kills_from if self.recovery is not None else 0
            cfg = executor_config(self.cfg, first, restarted)
            self.executor = require_executor(self.executor_factory(cfg, self.max_model_len))
        elif stage == "profile":
            reply = self._phase("profile")
            if reply.memory_plan is None:
                raise RuntimeError("the executor's profile reply has no memory plan")
            self.memory_plan = reply.memory_plan
            self.rank_memory_plans = reply.rank_memory_plans
            self.emit(MemoryPlanned(self.step_no, reply.memory_plan))
        elif stage == "warmup":
            self.warmup_figures = self._phase("warmup").figures
        else:
            self.captured = self._phase(stage).figures

    def _pages(self) -> BlockManager:
        num_blocks, cfg = self.memory_plan.num_kv_blocks, self.cfg
        return BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)

    def _lookahead(self) -> int:
        return 1 if self.captured.decode_ahead else 0  # the executor replays ahead

    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks

    @property
    def is_recovering(self) -> bool:
        return self.recovery is not None

    # --- inputs ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        client_id: str | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequest with a clear message.

        A request without a seed gets one drawn here, recorded in RequestAdded's params; one with
        a `client_id` (the id its client gave) is named by it (`name`)."""
        self._between_steps()
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(ids, params)
        request_id = request_id or self._new_id()
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if params.seed is None:
            params = params.with_seed(self.seeds.draw())
        arrival = time.time() if arrival_time is None else arrival_time
        added = RequestAdded(
            step=self.step_no,
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            arrival_time=arrival,
        )
        self.emit(added)
        req = Request(request_id, ids, params, self.tokenizer.decode, self.token_bytes)
        self.requests[request_id] = req
        self.scheduler.add(req)
        if client_id is not None:
            self.name(request_id, client_id)
        lifecycle.queued(self.step_no, req, len(self.scheduler.waiting))
        return request_id

    def name(self, request_id: str, client_id: str) -> None:
        """Record the id a client gave the request; its log lines carry it from now on."""
        self.emit(RequestNamed(self.step_no, request_id, client_id))
        self.requests[request_id].client_id = client_id

    def resume_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        output_ids: list[int],
        arrival_time: float,
    ) -> None:
        """Queue a request an earlier engine's log left unfinished, with the tokens it produced:
        recomputed and sampled on from there, as after an executor loss (`serve --resume`)."""
        self._between_steps()
        self.validate_prompt(prompt_ids, params)
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if params.seed is None or len(output_ids) >= params.max_tokens:
            raise InvalidRequest(f"request {request_id!r} has no seed or is already complete")
        bad = outside_vocabulary(list(output_ids), self.model_cfg.vocab_size)
        if bad is not None:
            vocab = self.model_cfg.vocab_size
            raise InvalidRequest(f"output token id {bad!r} is outside the vocabulary [0, {vocab})")
        out = list(output_ids)
        ids = list(prompt_ids)
        resumed = RequestResumed(
            step=self.step_no,
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            output_token_ids=out,
            arrival_time=arrival_time,
        )
        self.emit(resumed)
        req = Request(request_id, ids, params, self.tokenizer.decode, self.token_bytes)
        req.output_token_ids = out
        req.detok.extend(out)
        self.requests[request_id] = req
        self._resumed_ids.add(request_id)
        self.scheduler.add(req)

    def _new_id(self) -> str:
        """The next `req-N` that no request of this engine, resumed ones included, has had."""
        while (request_id := f"req-{next(self._ids)}") in self._resumed_ids:
            pass
        return request_id

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        check_prompt(ids, params, self.model_cfg.vocab_size, self.max_model_len)
        check_constraint(params)

    def abort(self, request_id: str) -> None:
        """Finish a request now, or, while recovering, when the recovery is done: a replay
        applies inputs that came during a recovery after it, and must finish it at that place."""
        self._between_steps()
        req = self.requests.get(request_id)
        if req is None or request_id in self._aborted_in_recovery:
            raise UnknownRequest(f"unknown request id {request_id!r}")
        self.emit(RequestAborted(self.step_no, request_id))
        if self.recovery is not None:
            self._aborted_in_recovery.append(request_id)
        else:
            self._finish(req, "abort")

    # --- the step --------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.recovery is not None or self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Plan the step, apply the transition, run, record; while recovering, the next start-up
        stage of the new executor instead.  Raises EngineDead once the engine gave up."""
        self._between_steps()
        planned = self._next_plan()
        if planned is None:
            return []
        self._launched = (*planned, False)  # finish() runs it: `execute`, as one call
        return self.finish()

    def launch(self) -> bool:
        """`step` in two halves, for a caller with work of its own to do while the executor runs
        the step (the server sends the last step's outputs): plan the step and hand it over;
        False if none was (nothing to run, or a start-up stage of a recovery ran instead).  An
        executor that takes a plan without answering (`submit`: the process executor) runs it
        until `finish`; nothing may add, abort or step in between."""
        self._between_steps()
        planned = self._next_plan()
        if planned is None:
            return False
        batch, plan = planned
        submits = isinstance(self.executor, Submits)
        if isinstance(self.executor, Submits):
            try:
                self.executor.submit(plan)
            except ExecutorDown as exc:
                self._lose(exc, "step")
                return False
        self._launched = (batch, plan, submits)
        return True

    def step_ready(self, timeout: float) -> bool:
        """Whether `finish` would not wait for the launched step: its result came (or the
        executor is gone, which `finish` handles), waiting up to `timeout` s for it."""
        launched = self._launched
        executor = self.executor
        if launched is None or not launched[2] or not isinstance(executor, Submits):
            return True
        return executor.ready(timeout)

    def finish(self) -> list[RequestOutput]:
        """The launched step's result, recorded: the outputs `step` returns."""
        assert self._launched is not None, "finish without launch"
        (batch, plan, submitted), self._launched = self._launched, None
        try:
            executor = self.executor
            if submitted and isinstance(executor, Submits):
                result = executor.collect()
            else:
                result = executor.execute(plan)
        except ExecutorDown as exc:
            self._lose(exc, "step")
            return []
        return self._done(batch, result)

    def _between_steps(self) -> None:
        """Inputs and steps come between steps: an input taken while a launched step runs would
        be recorded at that step's number, where a replay applies it before the step's plan."""
        if self._launched is not None:
            raise RuntimeError("a step is launched: finish() it first")

    def _next_plan(self) -> tuple[StepBatch, StepPlan] | None:
        if self.death is not None:
            raise EngineDead(self.death)
        if self.recovery is not None:
            self._recover_stage()
            return None
        batch = self.scheduler.schedule()
        self._evicted(batch.preempted, "preemption")  # recorded even when nothing runs
        if not batch.seqs:
            return None
        plan = self._plan(batch)
        self._launched_at = time.perf_counter()
        return batch, plan

    def _done(self, batch: StepBatch, result: StepResult) -> list[RequestOutput]:
        seconds = time.perf_counter() - self._launched_at
        decode = batch.is_decode
        outputs = self._record(batch, result)
        self.step_no += 1
        self._observe_cost(batch, decode, result, seconds)
        return outputs

    def _observe_cost(
        self, batch: StepBatch, decode: bool, result: StepResult, seconds: float
    ) -> None:
        """Count a step and, unless replaying, keep a decode step's cost and record a new
        automatic speculation threshold where the costs call for one (core/spec_threshold.py)."""
        kinds = self.spec_kinds
        tokens = sum(map(len, map(_TOKEN_IDS, result.seqs)))
        measured = seconds if self.decides_spec_threshold else None
        kinds.observe(batch.kind, len(batch.seqs), decode, tokens, measured)
        if decode and kinds.is_auto and self.decides_spec_threshold and kinds.may_change:
            threshold = kinds.decide()
            if threshold != kinds.threshold:
                self.set_spec_threshold(threshold, kinds.figures())

    def set_spec_threshold(self, threshold: int | None, rates: list[list]) -> None:
        """Speculation from now on only below `threshold` requests (None: at every size), as
        the automatic threshold; recorded, so that a replay applies it here."""
        self._between_steps()
        self.emit(SpecThresholdChanged(self.step_no, threshold, rates))
        log.info("speculation threshold", step=self.step_no, threshold=threshold, rates=rates)
        self.spec_kinds.set(threshold)

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
        lifecycle.planned(self.step_no, kind, s)
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
        outputs, sampled, filled = self._advance(batch, result.seqs)
        failed = [rid for rid in result.failed if rid in self.requests]
        outputs += [self._fail(rid, result.failed[rid]) for rid in failed]
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
        lifecycle.step_done(self.step_no, batch, memory)
        if proposed:
            log.debug("spec step", step=self.step_no, proposed=proposed, accepted=accepted)
        for leak in [*result.leaks, *self._watch_core(batch.kind, memory.core_rss_bytes, work)]:
            log.warning("leak suspected", **attrs.asdict(leak))
            self.emit(leak)
        self.last_memory = memory
        return outputs

    def _watch_core(self, kind: str, rss: int, work: StepWork) -> list:
        """Host growth of this process; an executor in this process reports it already."""
        if not isinstance(self.executor, OwnProcess):
            return []
        return self.host_watch.observe(self.step_no, kind, rss, work)

    def _advance(
        self, batch: StepBatch, results: list[SeqResult]
    ) -> tuple[list[RequestOutput], list[list], list[Request]]:
        """Move each scheduled request on by the tokens it computed and sampled: this step's
        outputs, the record of sampled tokens, and the requests with a block newly full of
        computed KV.  Every running request passes here every step, so it calls little."""
        by_id = {r.request_id: r for r in results}
        bs = self.cfg.block_size
        adapts_k = batch.kind == "spec" and self.cfg.speculative_adaptive_k
        outputs: list[RequestOutput] = []
        sampled: list[list] = []
        filled: list[Request] = []
        for s in batch.seqs:
            req = s.request
            res = by_id.get(req.request_id)
            # full blocks of computed KV (drafts past a stop are not tokens); the prefix cache
            # holds them all once a step is done, so only a step that fills one offers it more
            # (a running request's blocks fill one in `block_size` steps)
            num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
            computed = req.num_computed
            full_before = min(computed, num_tokens) // bs
            computed += s.num_tokens
            if res is None:
                req.num_computed = computed
            else:
                req.num_computed = computed = computed + len(res.token_ids) - 1
                req.num_proposed += res.num_proposed
                req.num_accepted += res.num_accepted
                if adapts_k:
                    self._adapt_k(req, res)
                out = self._append(req, res.token_ids, res.logprobs)
                sampled.append([req.request_id, out.new_token_ids])
                outputs.append(out)
                num_tokens += len(out.new_token_ids)
            if min(computed, num_tokens) // bs > full_before:
                filled.append(req)
        return outputs, sampled, filled

    def _adapt_k(self, req: Request, res: SeqResult) -> None:
        old = req.draft_length or self.cfg.num_speculative_tokens
        new = adapt(req, res.num_proposed, res.num_accepted, self.cfg.num_speculative_tokens)
        if new is not None:
            self.emit(DraftLengthChanged(self.step_no, req.request_id, old, new))

    def _append(self, req: Request, tokens: list[int], logprobs: list[list]) -> RequestOutput:
        """Append sampled tokens one by one until a stop condition; the output of this step."""
        p = req.params
        out_ids = req.output_token_ids
        old_len = len(req.detok.text) if p.stop else 0
        reason = None
        num_new = 0
        eos = () if p.ignore_eos else self.model_cfg.eos_token_ids
        # max_tokens, or the context: prompt + output reaching max_model_len
        limit = min(p.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        for tok in tokens:
            out_ids.append(tok)
            num_new += 1
            if tok in eos or tok in p.stop_token_ids:
                reason = "stop"
            elif len(out_ids) >= limit:
                reason = "length"
            if reason:
                break
        if len(out_ids) == num_new:
            lifecycle.first_token(self.step_no, req)
        if num_new < len(tokens):
            tokens, logprobs = tokens[:num_new], logprobs[:num_new]
        if logprobs:
            req.output_logprobs.extend(logprobs)
        text = req.detok.extend(out_ids, final=reason is not None)
        if p.stop and reason in (None, "length") and len(out_ids) >= p.min_tokens:
            end = stop_end(req.detok.text, p, old_len)
            if end is not None:
                text, reason = req.detok.text[old_len:end], "stop"
        out = RequestOutput(req.request_id, tokens, text, logprobs=logprobs)
        if p.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            out.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        if reason:
            self._finish(req, reason)
            out.finished, out.finish_reason = True, reason
            out.prompt_tokens = req.num_prompt_tokens
            out.cached_tokens = req.num_cached_tokens
            out.completion_tokens = len(req.output_token_ids)
            out.num_proposed, out.num_accepted = req.num_proposed, req.num_accepted
        return out

    def _fail(self, request_id: str, why: str) -> RequestOutput:
        """End a request the executor cannot go on with (StepResult.failed: a grammar the engine
        cannot enforce), with finish reason "error": never text outside its constraint."""
        req = self.requests[request_id]
        log.warning("request failed", step=self.step_no, request_id=request_id, reason=why)
        self.num_failed += 1
        self._finish(req, "error")
        return RequestOutput(
            request_id,
            [],
            "",
            finished=True,
            finish_reason="error",
            error=why,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=len(req.output_token_ids),
        )

    def _cache_blocks(self, req: Request) -> None:
        """Offer the request's full blocks of computed KV to the prefix cache."""
        num_valid = min(req.num_computed, req.num_tokens)
        self.blocks.commit(req.request_id, num_valid, req.token_at)

    def _finish(self, req: Request, reason: str) -> None:
        self._cache_blocks(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        self.scheduler.remove(req)
        self._finished_ids.append(req.request_id)
        del self.requests[req.request_id]
        usage = (req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_tokens)
        self.emit(RequestFinished(self.step_no, req.request_id, reason, *usage))
        if req.num_proposed:
            log.info(
                "speculation",
                request_id=req.request_id,
                proposed=req.num_proposed,
                accepted=req.num_accepted,
                acceptance_rate=round(req.num_accepted / req.num_proposed, 3),
            )

    # --- executor loss and recovery --------------------------------------------------------

    def check_executor(self) -> None:
        """Learn of a death between steps, from an executor that can tell without a call."""
        executor = self.executor
        if not isinstance(executor, Checked) or self.recovery is not None or self.death is not None:
            return
        try:
            executor.check()
        except ExecutorDown as exc:
            self._lose(exc, "idle")

    def _lose(self, exc: ExecutorDown, during: str) -> None:
        """Record the loss, then recover, or give up past the restart budget (EngineDead)."""
        reason = str(exc)
        self.num_losses += 1
        allowed = self.restarts.take(time.monotonic()) if exc.give_up is None else not exc.give_up
        self.emit(ExecutorLost(self.step_no, reason, during, not allowed))
        log.error("executor lost", step=self.step_no, during=during, reason=reason)
        self._close_executor()
        if not allowed:
            self._give_up(reason)
        if self.state != "recover":
            self.emit(PhaseChanged(self.step_no, self.state, "recover"))
            self.state = "recover"
        if self.recovery is not None:
            self.recovery.restart()
            return
        self._evicted(self.scheduler.running, "recovery", reason)
        readmitted, tokens = self.scheduler.requeue_all()
        num_waiting = len(self.scheduler.waiting)
        self.emit(RecoveryStarted(self.step_no, self.num_losses, readmitted, num_waiting, tokens))
        kills_from = self.step_no + 1 if during == "step" else self.step_no
        self.recovery = Recovery(time.monotonic(), readmitted, tokens, kills_from)

    def _evicted(self, reqs: list[Request], cause: str, why: str = "") -> None:
        """Record the requests sent back to the queue to recompute their KV (a preemption, or a
        requeue by an executor loss): the logs, `inspect` and `trace` read these records."""
        for req in reqs:
            rec = RequestPreempted(self.step_no, req.request_id, cause, req.num_tokens)
            self.emit(rec)
            lifecycle.evicted(rec, req, why)

    def _recover_stage(self) -> None:
        assert self.recovery is not None
        rec = self.recovery
        stage = rec.next_stage
        rec.num_starts += stage == "start"
        try:
            self._start_stage(stage)
        except ExecutorDown as exc:
            self._lose(exc, stage)
            return
        rec.stage += 1
        if rec.stage < len(START_STAGES):
            return
        self.scheduler.use_pages(self._pages(), self._lookahead())
        self.recovery = None
        done = RecoveryDone(
            self.step_no, rec.num_readmitted, rec.tokens_to_recompute, rec.num_starts, rec.seconds()
        )
        self.emit(done)
        log.warning("executor recovered", **attrs.asdict(done))
        aborted, self._aborted_in_recovery = self._aborted_in_recovery, []
        for request_id in aborted:
            self._finish(self.requests[request_id], "abort")

    def _close_executor(self) -> None:
        executor, self.executor = self.executor, None
        if executor is not None:
            executor.close()

    def _give_up(self, reason: str) -> None:
        """Fail every unfinished request and stay dead: a supervisor restarts the whole server."""
        self.death = reason
        self.recovery = None
        self._aborted_in_recovery.clear()
        for req in list(self.requests.values()):
            self._finish(req, "executor_dead")
        log.error("engine dead: too many executor restarts", reason=reason)
        raise EngineDead(f"executor lost too often (last: {reason})")

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
        prompt_logprobs: dict[str, list] = {}
        done: dict[str, Completion] = {}
        while self.has_work():
            for out in self.step():
                if out.prompt_logprobs:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
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
                        out.cached_tokens,
                        prompt_logprobs.pop(out.request_id, []),
                    )
        return done

    def shutdown(self) -> None:
        if self.state == "shutdown":
            self._close_executor()
            return
        if self.executor is None:  # lost, and no new one started yet (or given up)
            self.emit(PhaseChanged(self.step_no, self.state, "shutdown"))
            self.state = "shutdown"
            return
        try:
            self._phase("shutdown")
        finally:
            self._close_executor()


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, int] | None:
    """Where the first stop string that ends past `start` (the text's length before this step)
    begins and ends (the longest of those that begin there): one that ended by then was matched
    then, or not at all (before `min_tokens`)."""
    begin = max(0, start - max(len(s) for s in stops) + 1)
    hits = [(i, -len(s)) for s in stops if (i := text.find(s, begin)) >= 0]
    if not hits:
        return None
    at, minus = min(hits)
    return at, at - minus


def stop_end(text: str, params: SamplingParams, start: int) -> int | None:
    """Where the output `text` ends at the first of `params.stop` that ends past `start`: before
    it, or after it with `include_stop_str_in_output`; None where none does."""
    cut = _find_stop(text, params.stop, start)
    if cut is None:
        return None
    return cut[1] if params.include_stop_str_in_output else cut[0]


def check_prompt(ids: list[int], params: SamplingParams, vocab: int, max_len: int) -> None:
    """InvalidRequest for a prompt the engine cannot run: empty, ids outside the vocabulary (its
    own, its logit_bias's or stop_token_ids'), or longer (with its max_tokens) than the context.
    The CLI calls it before the model loads."""
    if not ids:
        raise InvalidRequest("prompt is empty")
    bad = outside_vocabulary(ids, vocab)
    if bad is not None:
        raise InvalidRequest(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
    if len(ids) >= max_len:
        raise InvalidRequest(f"prompt has {len(ids)} tokens; this model's context is {max_len}")
    named = [*(t for t, _ in params.logit_bias), *params.stop_token_ids]
    outside = outside_vocabulary(named, vocab)
    if outside is not None:
        raise InvalidRequest(
            f"token id {outside} of logit_bias or stop_token_ids is outside the vocabulary "
            f"[0, {vocab})"
        )
    if len(ids) + params.max_tokens > max_len:
        raise InvalidRequest(
            f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the context "
            f"of {max_len} tokens"
        )


def check_constraint(params: SamplingParams) -> None:
    """InvalidRequest for a constraint the grammar engine cannot run: it does not compile, or
    its compile crashed or outran its budget in a check worker (core/grammar_check.py).  The
    server starts the check ahead (`Server._generate`), so that it waits here for nothing."""
    if params.constraint is None:
        return
    error = grammar_error(*params.constraint)
    if error:
        name = "guided_" + params.constraint[0]
        raise InvalidRequest(f"{name} does not compile: {error}")


def outside_vocabulary(ids: list, vocab: int) -> object | None:
    """The first of `ids` that is not a token id of a vocabulary of `vocab`, or None."""
    if not ids or set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < vocab:
        return None  # at C speed, the common case
    return next((t for t in ids if not _is_token(t, vocab)), None)


def _is_token(t: object, vocab: int) -> bool:
    return isinstance(t, int) and 0 <= t < vocab


def _work(batch: StepBatch) -> StepWork:
    """A step's rows and tokens, and the requests it starts (none of their tokens computed)."""
    admitted = sum(1 for s in batch.seqs if s.request.num_computed == 0)
    return StepWork(len(batch.seqs), batch.num_tokens, admitted)
