"""What comes into the engine: a request validated, given its id and seed, recorded
(`RequestAdded`, `RequestResumed`, `RequestNamed`) and queued.  A base of `Engine`, which holds
the state it names."""

from __future__ import annotations

import itertools
import time

from memstep.core import request_log
from memstep.core.model_config import ModelConfig
from memstep.core.prompt_checks import check_constraint, check_prompt, outside_vocabulary
from memstep.core.request import Request
from memstep.core.sampling_params import InvalidRequest, SamplingParams
from memstep.core.scheduler import Scheduler
from memstep.core.seeding import RequestSeeds
from memstep.core.tokenizer import Tokenizer
from memstep.events.types import RequestAdded, RequestNamed, RequestResumed


class Inputs:
    """Adds, resumes and names requests."""

    tokenizer: Tokenizer
    model_cfg: ModelConfig
    max_model_len: int
    requests: dict[str, Request]
    scheduler: Scheduler
    seeds: RequestSeeds
    step_no: int
    token_bytes: list[bytes] | None
    _ids: itertools.count
    _resumed_ids: set[str]

    def emit(self, rec: object) -> None:
        raise NotImplementedError  # the engine's

    def _between_steps(self) -> None:
        raise NotImplementedError  # the engine's

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
        request_log.queued(self.step_no, req, len(self.scheduler.waiting))
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
