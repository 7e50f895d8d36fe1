"""The engine core: plan the step, apply the transition, run, record.

It decides and never touches device tensors: the executor (in-process or behind ZeroMQ) runs
each plan.  Every input and every derived fact is emitted as a typed record to the sinks (the
event log writer, tests), which is what makes a run replayable.

When the executor is lost (it died, went silent, or answered with an error) the engine records
the loss, enters `recover`, puts every unfinished request back in the queue and starts a new
executor, one start-up stage per `step()` so that its caller keeps answering clients.
"""

from __future__ import annotations

import functools
import itertools
import operator
import time
from collections.abc import Callable, Iterable

import structlog

from memstep.core.block_manager import BlockManager
from memstep.core.config import EngineConfig
from memstep.core.engine_inputs import Inputs
from memstep.core.executor import ExecutorFactory, Submits
from memstep.core.executor_life import ExecutorLife
from memstep.core.generation_config import sampling_defaults
from memstep.core.grammar import TokenizerSpec, constraint_book
from memstep.core.host_memory import HostWatch
from memstep.core.model_source import model_config, resolve
from memstep.core.offline import run_until_idle
from memstep.core.output_book import OutputBook
from memstep.core.outputs import Completion, RequestOutput
from memstep.core.recovery import START_STAGES, EngineDead, ExecutorDown, RestartBudget
from memstep.core.request import Request, Status
from memstep.core.sampling_params import SamplingParams
from memstep.core.scheduler import Scheduler, StepBatch
from memstep.core.seeding import RequestSeeds, engine_seed
from memstep.core.shapes import check_tensor_parallel, max_model_len
from memstep.core.snapshot import Admitted, EngineFacts, EngineSnapshot
from memstep.core.spec_threshold import SpecThreshold, probe_gaps
from memstep.core.step_records import StepRecords
from memstep.core.tokenizer import load_tokenizer, with_chat_template
from memstep.events.plan import StepPlan, StepResult
from memstep.events.types import (
    EngineStarted,
    MemoryReport,
    RequestAborted,
    RequestFinished,
    SpecThresholdChanged,
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


class Engine(Inputs, ExecutorLife, StepRecords):
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
        self.recovery = None
        self.death: str | None = None  # why the engine gave up on executors
        self.num_losses = 0
        self._aborted_in_recovery: list[str] = []
        self._launched: tuple[StepBatch, StepPlan, bool] | None = None  # launch() .. finish()
        self._launched_at = 0.0  # perf_counter when the launched step was handed over
        self.last_memory: MemoryReport | None = None  # the last step's
        self.spec_threshold = SpecThreshold(cfg)
        self.decides_spec_threshold = decides_spec_threshold
        self.host_watch = HostWatch("core", cfg.host_leak_tolerance_mib << 20)
        eos = mc.eos_token_ids
        self.book = OutputBook(cfg, eos, self.max_model_len, self.emit, self._finish)
        self.emit(EngineStarted(VERSION, cfg.to_dict(), self.source.identity))
        for stage in START_STAGES:
            self._start_stage(stage)
        self.scheduler = Scheduler(
            cfg, self._pages(), self.max_model_len, self._lookahead(), self.spec_threshold
        )
        log.info("engine ready", model=self.source.label, max_model_len=self.max_model_len)

    # --- plumbing --------------------------------------------------------------------------

    def emit(self, rec: object) -> None:
        for sink in self.sinks:
            sink(rec)

    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks

    @property
    def num_failed(self) -> int:
        """Requests the executor could not go on with (`OutputBook.fail`)."""
        return self.book.num_failed

    # --- the front's surface: add, abort, launch, finish, snapshot ---------------------------

    def add(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        client_id: str | None = None,
        arrival_time: float | None = None,
        request_id: str | None = None,
        output_token_ids: list[int] | None = None,
    ) -> Admitted:
        """Queue a request a client named `client_id`; with `output_token_ids`, one that an
        earlier engine began (`resume_request`: a router's migration, `serve --resume`), under
        `request_id`.  Raises InvalidRequest with a clear message."""
        if output_token_ids is None:
            request_id = self.add_request(prompt, params, request_id, arrival_time, client_id)
        else:
            assert request_id is not None, "a resumed request keeps its id"
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            arrival = time.time() if arrival_time is None else arrival_time
            self.resume_request(request_id, ids, params, output_token_ids, arrival)
            if client_id is not None:
                self.name(request_id, client_id)
        req = self.requests[request_id]
        out = list(req.output_token_ids)
        return Admitted(request_id, req.prompt_token_ids, out, req.detok.text)

    def listen(self, sink: Sink) -> None:
        """Hand every record the engine emits from now on to `sink` too (after the others)."""
        self.sinks.append(sink)

    @functools.cached_property
    def facts(self) -> EngineFacts:
        cfg, mc = self.cfg, self.model_cfg
        return EngineFacts(
            model=self.source.label,
            max_model_len=self.max_model_len,
            vocab_size=mc.vocab_size,
            generation_config=cfg.generation_config,
            sampling_defaults=sampling_defaults(self.source, cfg.generation_config),
            token_bytes=self.token_bytes,
        )

    def snapshot(self) -> EngineSnapshot:
        """The engine's health, load and figures now (between steps)."""
        sched, blocks = self.scheduler, self.scheduler.blocks
        return EngineSnapshot(
            facts=self.facts,
            step=self.step_no,
            kind=self.state,
            has_work=self.has_work(),
            is_recovering=self.recovery is not None,
            num_losses=self.num_losses,
            death=self.death,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_preemptions=sched.num_preemptions,
            num_requeues=sched.num_requeues,
            kv_pages_total=blocks.num_blocks,
            kv_pages_used=blocks.num_used,
            kv_pages_cached=blocks.num_cached,
            memory=self.last_memory,
            executor_pid=getattr(self.executor, "pid", 0),
            standby_pid=getattr(self.executor_factory, "standby_pid", 0),  # a loaded spare
        )

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
        self._launched = (*planned, False)  # _collect() runs it: `execute`, as one call
        return self._collect()

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

    def finish(self, timeout: float | None = None) -> list[RequestOutput] | None:
        """The launched step's result, recorded: the outputs `step` returns; None where it did
        not come within `timeout` s (None: wait for it), the step still launched."""
        if timeout is not None and not self.step_ready(timeout):
            return None
        return self._collect()

    def _collect(self) -> list[RequestOutput]:
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

    def set_spec_threshold(
        self, threshold: int | None, rates: list[list], gaps: list[list] | None = None
    ) -> None:
        """Speculation from now on only below `threshold` requests (None: at every size), as
        the automatic threshold, its probes' first gaps made from `rates` (`probe_gaps`) or
        given (a replay's recorded ones); recorded, so that a replay applies it here."""
        self._between_steps()
        if gaps is None:
            gaps = probe_gaps(threshold, rates)
        self.emit(SpecThresholdChanged(self.step_no, threshold, rates, gaps))
        log.info("speculation threshold", step=self.step_no, threshold=threshold, rates=rates)
        self.spec_threshold.set(threshold, gaps)

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
        """Step until no request is left; each finished request's completion by its id."""
        return run_until_idle(self.has_work, self.step)
