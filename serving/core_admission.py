"""How the core process takes a frame: decode it, dispatch it, and admit a generate request into
the engine (`Engine.add`) or refuse it with a typed error: a duplicate, a full queue, a dead
executor, an unwritable log, a constraint still being checked by a grammar worker (admitted once
it answers).  Aborts and attaches (`serve --resume`) come in here too.  `Admission` is a part of
`Server`."""

from __future__ import annotations

import time
from typing import Any

import structlog

from memstep.core.engine import UnknownRequest
from memstep.core.grammar import ConstraintBook
from memstep.core.sampling_params import InvalidRequest, SamplingParams
from memstep.core.snapshot import Admitted
from memstep.events import codec
from memstep.events.wire import (
    OVERLOADED,
    AbortReply,
    AbortRequest,
    AttachRequest,
    ErrorReply,
    GenerateDelta,
    GenerateRequest,
    HealthRequest,
    StatsRequest,
    TokenizeRequest,
    WireError,
    decode_request,
)
from memstep.serving.core_answers import Answers
from memstep.serving.core_replies import Checking, Inflight
from memstep.serving.reattach import Detached

log = structlog.get_logger("memstep.server")

# requests whose constraints wait for a check worker at once; past it: overloaded
MAX_CHECKING = 64
# a generate request read while the executor ran a step, and its prompt's ids made then
Ahead = tuple[GenerateRequest, list[int]]


class RequestRefused(Exception):
    """A well-formed request the server will not serve; `code` goes back to the client."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Admission(Answers):
    """Frames in: requests admitted, refused, aborted, attached."""

    grammars: ConstraintBook
    sampling_defaults: dict[str, Any]
    new_while_recovering: tuple[int, int]  # (the engine's loss number, new requests queued)
    num_migrated_in: int
    checking: list[Checking]  # requests whose constraint a grammar worker checks

    def _log_writable(self) -> bool:
        raise NotImplementedError  # the server's loop

    def _handle(self, frames: list[bytes], ahead: Ahead | None = None) -> None:
        """One frame; `ahead`: its message and prompt's ids, made ahead (`_read_ahead`)."""
        if len(frames) == 2:
            envelope, payload = frames[:1], frames[1]
        elif len(frames) == 3 and frames[1] == b"":
            envelope, payload = frames[:2], frames[2]
        else:
            err = "expected one frame (DEALER), or an empty frame then one frame (REQ)"
            self._send(frames[:1], ErrorReply("", "malformed_frame", err))
            return
        try:
            msg, ids = ahead or (decode_request(payload, self.cfg.max_frame_bytes), None)
        except WireError as exc:
            self._reject(envelope, exc.request_id, exc.code, str(exc))
            return
        except Exception as exc:  # a decoder bug costs this frame, never the server
            log.exception("frame not decoded", num_bytes=len(payload))
            self._send(envelope, ErrorReply("", "internal_error", _message(exc)))
            return
        try:
            self._dispatch(envelope, msg, ids)
        except (RequestRefused, InvalidRequest, UnknownRequest) as exc:
            if isinstance(exc, RequestRefused):
                self.refused[exc.code] += 1
            self._reject(envelope, msg.request_id, exc.code, _message(exc))
        except Exception as exc:
            log.exception("request failed", request_id=msg.request_id)
            self._send(envelope, ErrorReply(msg.request_id, "internal_error", _message(exc)))

    def _reject(self, envelope: list[bytes], request_id: str, code: str, reason: str) -> None:
        """Answer a request that will not be served, and say so in the log."""
        step = self.engine.snapshot().step
        log.info("request rejected", step=step, request_id=request_id, code=code, reason=reason)
        self._send(envelope, ErrorReply(request_id, code, reason))

    def _dispatch(self, envelope: list[bytes], msg: Any, ids: list[int] | None = None) -> None:
        if isinstance(msg, GenerateRequest):
            self._generate(envelope, msg, ids)
        elif isinstance(msg, AbortRequest):
            self._abort(envelope, msg)
        elif isinstance(msg, HealthRequest):
            self._send(envelope, self._health(msg))
        elif isinstance(msg, StatsRequest):
            self._send(envelope, self._stats(msg))
        elif isinstance(msg, AttachRequest):
            self._attach(envelope, msg)
        elif isinstance(msg, TokenizeRequest):
            self._send(envelope, self._tokenize(msg))
        else:
            raise NotImplementedError(f"no handler for {type(msg).__name__}")

    def _generate(
        self, envelope: list[bytes], msg: GenerateRequest, ids: list[int] | None = None
    ) -> None:
        self._check_alive()
        if not self._log_writable():
            assert self.recorder is not None
            raise RequestRefused(
                "log_unwritable",
                f"the event log cannot be written ({self.recorder.failure}); "
                "no request is served unrecorded",
            )
        key = (envelope[0], msg.request_id)
        if key in self.by_client:
            raise RequestRefused("duplicate_request", f"request {msg.request_id!r} is in flight")
        self._check_queue()
        self._check_waiting()
        prompt = self._prompt(msg) if ids is None else ids
        params = _sampling_params(msg.params, self.sampling_defaults)
        step = self.engine.snapshot().step
        log.info("request arrived", step=step, request_id=msg.request_id)
        if any(c.key == key for c in self.checking):
            raise RequestRefused("duplicate_request", f"request {msg.request_id!r} is in flight")
        if params.constraint is not None:
            check = self.grammars.start(*params.constraint)
            if not check.is_done:  # compiled in a worker while the engine steps the others
                self._check_checking()
                self.checking.append(Checking(key, envelope, msg, prompt, params, check))
                return
            self.grammars.keep(check)
        self._admit(envelope, msg, prompt, params)

    def _admit(
        self,
        envelope: list[bytes],
        msg: GenerateRequest,
        prompt: str | list[int],
        params: SamplingParams,
    ) -> None:
        key = (envelope[0], msg.request_id)
        if msg.output_token_ids:
            added = self._migrated(prompt, params, msg)
        else:
            added = self.engine.add(
                prompt, params, arrival_time=time.time(), client_id=msg.request_id
            )
        engine_id = added.request_id
        num_prompt = len(added.prompt_token_ids)
        inf = Inflight(envelope, msg.request_id, msg.stream, time.monotonic(), num_prompt)
        inf.batch = msg.batch_deltas
        if params.prompt_logprobs is not None:
            inf.prompt_ids = added.prompt_token_ids
        self.inflight[engine_id] = inf
        self.by_client[key] = engine_id
        self.last_sent.setdefault(inf.peer, inf.arrival)

    def _admit_checked(self) -> None:
        """Admit (or refuse with its reason) each request whose constraint's check settled."""
        if not self.checking:
            return
        self.grammars.poll()
        waiting: list[Checking] = []
        for c in self.checking:
            if not c.check.is_done:
                waiting.append(c)
                continue
            self.grammars.keep(c.check)
            self._admit_safely(c)
        self.checking = waiting

    def _admit_safely(self, c: Checking) -> None:
        """`_admit` a checked request; a refusal or a failure answers it, as `_handle` does."""
        try:
            self._check_alive()
            self._admit(c.envelope, c.msg, c.prompt, c.params)
        except (RequestRefused, InvalidRequest) as exc:
            self._reject(c.envelope, c.msg.request_id, exc.code, _message(exc))
        except Exception as exc:
            log.exception("request failed", request_id=c.msg.request_id)
            reply = ErrorReply(c.msg.request_id, "internal_error", _message(exc))
            self._send(c.envelope, reply)

    def _check_checking(self) -> None:
        """Refuse a request whose constraint would wait behind MAX_CHECKING others' checks."""
        if len(self.checking) >= MAX_CHECKING:
            raise RequestRefused(
                OVERLOADED,
                f"{len(self.checking)} constraints wait for their checks (limit {MAX_CHECKING}); "
                "retry in a second",
            )

    def _check_alive(self) -> None:
        if self.executor_death is not None:
            raise RequestRefused("executor_dead", f"the executor is dead: {self.executor_death}")

    def _migrated(
        self, prompt: str | list[int], params: SamplingParams, msg: GenerateRequest
    ) -> Admitted:
        """Admit a request a router moved here off a dead engine, with the tokens its client
        has: sampled on from there, keyed by (seed, position), as on the engine it left."""
        self.num_migrated_in += 1
        return self.engine.add(
            prompt,
            params,
            client_id=msg.request_id,
            arrival_time=time.time(),
            request_id=f"migrated-{self.num_migrated_in}",
            output_token_ids=msg.output_token_ids,
        )

    def _check_queue(self) -> None:
        """While a new executor starts, count the new requests of this recovery (the engine's
        loss number names it) and refuse those past the limit."""
        snap = self.engine.snapshot()
        if not snap.is_recovering:
            return
        loss, taken = self.new_while_recovering
        taken = taken if loss == snap.num_losses else 0
        limit = self.cfg.max_new_while_recovering
        if taken >= limit:
            raise RequestRefused(
                "recovering",
                f"a new executor is starting and {taken} new requests wait for it "
                f"(limit {limit}); retry in a few seconds",
            )
        self.new_while_recovering = (snap.num_losses, taken + 1)

    def _check_waiting(self) -> None:
        """Refuse a new request that would wait behind `max_waiting_requests` others (not while
        recovering: every re-admitted request waits then, and `_check_queue` bounds the new)."""
        limit = self.cfg.max_waiting_requests
        snap = self.engine.snapshot() if limit else None
        if snap is None or snap.is_recovering:
            return
        waiting = snap.num_waiting
        if waiting >= limit:
            raise RequestRefused(
                OVERLOADED,
                f"{waiting} requests wait for the running batch (limit {limit}); retry in a second",
            )

    def _attach(self, envelope: list[bytes], msg: AttachRequest) -> None:
        """Hand a carried request (`serve --resume`) to the client that sent it before."""
        if (envelope[0], msg.request_id) in self.by_client:
            raise RequestRefused("duplicate_request", f"request {msg.request_id!r} is in flight")
        held = self.detached.take(msg)
        held.waiting = (envelope, msg)
        if held.can_hand_over:
            self._hand_over(held)

    def _hand_over(self, held: Detached) -> None:
        assert held.waiting is not None
        (envelope, msg), held.waiting = held.waiting, None
        self.detached.release(held)
        now = time.monotonic()
        inf = Inflight(envelope, msg.request_id, msg.stream, now, held.prompt_tokens)
        inf.token_ids, inf.texts = list(held.token_ids), [held.text]
        decode, token_bytes = self.engine.tokenizer.decode, self.facts.token_bytes
        ids, text = held.tail(msg.from_index, decode, token_bytes)
        if msg.stream and (ids or text):
            self._send(envelope, GenerateDelta(msg.request_id, ids, text))
        if held.finish_reason is not None:
            self._send(envelope, inf.done(held.finish_reason, now))
            return
        self.inflight[held.engine_id] = inf
        self.by_client[(envelope[0], msg.request_id)] = held.engine_id
        self.last_sent.setdefault(inf.peer, now)

    def _abort(self, envelope: list[bytes], msg: AbortRequest) -> None:
        key = (envelope[0], msg.target_id)
        parked = [c for c in self.checking if c.key == key]
        if parked:  # still waiting for its constraint's check: it ends before it began
            self.checking.remove(parked[0])
            done = Inflight(envelope, msg.target_id, False, time.monotonic(), 0)
            self._send(parked[0].envelope, done.done("abort", time.monotonic()))
            self._send(envelope, AbortReply(msg.request_id, msg.target_id))
            return
        engine_id = self.by_client.get(key)
        if engine_id is None:
            raise UnknownRequest(f"unknown request id {msg.target_id!r}")
        self._send_unsent(engine_id)  # its outputs of the last step first: they may finish it
        inf = self.inflight.get(engine_id)
        if inf is not None:
            self.engine.abort(engine_id)
            self._forget(engine_id, "abort")
            self._send(inf.envelope, inf.done("abort", time.monotonic()))
        self._send(envelope, AbortReply(msg.request_id, msg.target_id))


def _sampling_params(data: dict, defaults: dict[str, Any]) -> SamplingParams:
    """A request's params; what it leaves out (or sends as nil) takes the model's default."""
    for key in data:
        if type(key) is not str:
            raise InvalidRequest("sampling param names must be strings")
    given = {k: v for k, v in data.items() if v is not None or k not in defaults}
    return SamplingParams.from_dict({**defaults, **given})


def _message(exc: BaseException) -> str:
    return codec.clip(str(exc.args[0]) if exc.args else type(exc).__name__, 1000)
