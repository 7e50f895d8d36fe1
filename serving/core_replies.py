"""What the core process sends its clients, and the requests it answers.

`Inflight` is a generate request being answered and what it has been sent; `Outbox` gathers one
turn's replies to the clients that take their deltas together.  `Replies` (a part of `Server`,
the class below the others) delivers a step's outputs, sends a frame (a client whose connection
is gone is noticed here), and ends requests: their latencies go to the event log (RequestTimed,
through the engine) and to a log line, a vanished client's requests are aborted.
"""

from __future__ import annotations

import collections
import contextlib
import time

import attrs
import structlog
import zmq

from memstep.core.engine import Engine, UnknownRequest
from memstep.core.grammar_check import Check
from memstep.core.outputs import RequestOutput
from memstep.core.sampling_params import SamplingParams
from memstep.core.snapshot import EngineFacts
from memstep.events import codec
from memstep.events.types import RequestTimed
from memstep.events.wire import (
    ErrorReply,
    GenerateDelta,
    GenerateDeltas,
    GenerateDone,
    GenerateRequest,
    Timing,
    Usage,
)
from memstep.serving.reattach import Detached, Reattach

log = structlog.get_logger("memstep.server")

# the error a request ends with where the grammar engine cannot enforce its constraint
CONSTRAINT_UNENFORCEABLE = "constraint_unenforceable"


@attrs.frozen
class Checking:
    """A generate request that waits for its constraint's check, with what admits it after."""

    key: tuple[bytes, str]  # (peer, the client's id)
    envelope: list[bytes]
    msg: GenerateRequest
    prompt: str | list[int]
    params: SamplingParams
    check: Check


@attrs.define
class Inflight:
    """A generate request the server is answering, and what it has sent so far."""

    envelope: list[bytes]  # the routing frames to reply with: [peer] or [peer, b""]
    request_id: str  # the client's id
    stream: bool
    arrival: float  # time.monotonic() when the request arrived
    prompt_tokens: int
    token_ids: list[int] = attrs.Factory(list)
    texts: list[str] = attrs.Factory(list)
    token_times: list[float] = attrs.Factory(list)
    cached_tokens: int = 0  # prompt tokens the prefix cache held, known when it finishes
    queue_s: float | None = None  # arrival to the first step that scheduled it
    logprobs: list[list] = attrs.Factory(list)
    batch: bool = False  # its deltas go in the client's GenerateDeltas (batch_deltas)
    prompt_ids: list[int] = attrs.Factory(list)  # kept where it asked for prompt logprobs
    prompt_logprobs: list[list] = attrs.Factory(list)

    @property
    def peer(self) -> bytes:
        return self.envelope[0]

    def done(self, reason: str, now: float) -> GenerateDone:
        usage = Usage(self.prompt_tokens, len(self.token_ids), self.cached_tokens)
        ttft = self.token_times[0] if self.token_times else None
        timing = Timing(ttft, list(self.token_times), now - self.arrival, self.queue_s)
        text = "".join(self.texts)
        return GenerateDone(
            request_id=self.request_id,
            text=text,
            token_ids=list(self.token_ids),
            finish_reason=reason,
            usage=usage,
            timing=timing,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


class Outbox:
    """One turn's replies to the clients that take their deltas together: to each, its deltas
    in one GenerateDeltas, then the replies that must come after them (GenerateDone)."""

    def __init__(self) -> None:
        self.peers: dict[bytes, tuple[list[bytes], list[GenerateDelta], list[object]]] = {}

    def add(self, envelope: list[bytes], msg: object) -> None:
        entry = self.peers.get(envelope[0])
        if entry is None:
            entry = self.peers[envelope[0]] = (envelope, [], [])
        if type(msg) is GenerateDelta:
            entry[1].append(msg)
        else:
            entry[2].append(msg)

    def replies(self) -> list[tuple[list[bytes], object]]:
        """(envelope, reply) in the order they go out."""
        out: list[tuple[list[bytes], object]] = []
        for envelope, deltas, after in self.peers.values():
            if deltas:
                out.append((envelope, GenerateDeltas(deltas)))
            out.extend((envelope, msg) for msg in after)
        return out


class Replies:
    """Sending to clients and ending requests; the state it uses is the server's."""

    engine: Engine
    sock: zmq.Socket
    inflight: dict[str, Inflight]  # by engine request id
    by_client: dict[tuple[bytes, str], str]  # (peer, client id) -> engine id
    last_sent: dict[bytes, float]  # for peers with requests in flight
    gone: set[bytes]  # peers whose connection closed; dropped each turn
    finished: collections.Counter[str]
    executor_death: str | None
    dead_since: float | None
    checking: list[Checking]
    detached: Reattach
    facts: EngineFacts

    def _send_unsent(self, request_id: str | None = None) -> None:
        raise NotImplementedError  # the server's loop

    def _hand_over(self, held: Detached) -> None:
        raise NotImplementedError  # admission's

    def _deliver(self, out: RequestOutput, now: float, box: Outbox) -> None:
        """Send (or put in `box`, for a client that takes its deltas together) the output."""
        inf = self.inflight.get(out.request_id)
        if inf is None:
            held = self.detached.deliver(out)
            if held is not None:
                self._hand_over(held)
            return
        inf.token_ids.extend(out.new_token_ids)
        inf.texts.append(out.new_text)
        if len(out.new_token_ids) == 1:  # a decode's one token: no list to make
            inf.token_times.append(now - inf.arrival)
        else:
            inf.token_times.extend([now - inf.arrival] * len(out.new_token_ids))
        logprobs = self._named_logprobs(out.new_token_ids, out.logprobs) if out.logprobs else []
        inf.logprobs.extend(logprobs)
        scored = []
        if inf.prompt_ids and not inf.prompt_logprobs:  # its first output, which has the scores
            first = inf.prompt_ids[0]  # nothing comes before it: no logprob, no rank
            scored = [[first, self.engine.tokenizer.decode([first]), None, [], None]]
            scored += self._named_logprobs(inf.prompt_ids[1:], out.prompt_logprobs)
            inf.prompt_logprobs = scored
        send = box.add if inf.batch else self._send
        if inf.stream:
            send(
                inf.envelope,
                GenerateDelta(inf.request_id, out.new_token_ids, out.new_text, logprobs, scored),
            )
        if out.finish_reason == "error":  # the executor could not go on with it
            self._forget(out.request_id, CONSTRAINT_UNENFORCEABLE, now)
            send(inf.envelope, ErrorReply(inf.request_id, CONSTRAINT_UNENFORCEABLE, out.error))
        elif out.finished:
            inf.cached_tokens = out.cached_tokens
            reason = out.finish_reason or "stop"
            self._forget(out.request_id, reason, now)
            send(inf.envelope, inf.done(reason, now))

    def _named_logprobs(self, tokens: list[int], logprobs: list[list]) -> list[list]:
        """The engine's [logprob, [[id, logprob]...]] per token, with ids and texts added (a
        prompt token's rank, after them, kept at the end)."""
        decode = self.engine.tokenizer.decode
        named = []
        for token, (chosen, top, *rank) in zip(tokens, logprobs, strict=False):
            alternatives = [[tid, decode([tid]), lp] for tid, lp in top]
            named.append([token, decode([token]), chosen, alternatives, *rank])
        return named

    def _send(self, envelope: list[bytes], msg: object) -> None:
        try:
            self.sock.send_multipart([*envelope, codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone; EAGAIN: it stopped reading
            log.info("client gone", error=str(exc))
            self.gone.add(envelope[0])
        else:
            if envelope[0] in self.last_sent:
                self.last_sent[envelope[0]] = time.monotonic()

    def _forget(self, engine_id: str, reason: str, now: float | None = None) -> None:
        """Drop a request that ended (at `now`, monotonic); its latencies go to the event log
        (RequestTimed, the figures its GenerateDone carries) and to a log line."""
        inf = self.inflight.pop(engine_id)
        ttft = inf.token_times[0] if inf.token_times else None
        e2e = (time.monotonic() if now is None else now) - inf.arrival
        step = self.engine.snapshot().step
        self.engine.emit(RequestTimed(step, engine_id, reason, ttft, e2e, inf.queue_s))
        num_tokens = len(inf.token_ids)
        tpot = (e2e - ttft) / (num_tokens - 1) if ttft is not None and num_tokens > 1 else None
        log.info(
            "request finished",
            step=step,
            request_id=inf.request_id,
            engine_id=engine_id,
            finish_reason=reason,
            prompt_tokens=inf.prompt_tokens,
            cached_tokens=inf.cached_tokens,
            completion_tokens=num_tokens,
            ttft_s=_rounded(ttft),
            tpot_s=_rounded(tpot),
            e2e_s=_rounded(e2e),
            queue_s=_rounded(inf.queue_s),
        )
        del self.by_client[(inf.peer, inf.request_id)]
        self.finished[reason] += 1
        if not any(other.peer == inf.peer for other in self.inflight.values()):
            self.last_sent.pop(inf.peer, None)

    def _drop_gone_peers(self) -> None:
        """Abort every request of a client whose connection closed; its pages are freed."""
        while self.gone:
            peer = self.gone.pop()
            self.checking = [c for c in self.checking if c.key[0] != peer]
            for engine_id, inf in list(self.inflight.items()):
                if inf.peer == peer:
                    self._forget(engine_id, "disconnect")
                    self._abort_running(engine_id)
                    log.info("client disconnected; request aborted", request_id=inf.request_id)

    def _executor_died(self, reason: str) -> None:
        self.executor_death = reason
        self.dead_since = time.monotonic()
        self._fail_all("executor_dead", reason)

    def _fail_all(self, code: str, message: str) -> None:
        """Answer every request in flight with an error and drop it from the engine (after
        the outputs of the last step: those it finished are complete)."""
        self._send_unsent()
        for engine_id, inf in list(self.inflight.items()):
            self._send(inf.envelope, ErrorReply(inf.request_id, code, message))
            self._forget(engine_id, code)
            self._abort_running(engine_id)

    def _abort_running(self, engine_id: str) -> None:
        """Abort a request the engine may have finished already (then nothing to do)."""
        with contextlib.suppress(UnknownRequest):
            self.engine.abort(engine_id)


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)
