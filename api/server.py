"""The API server: a ZeroMQ ROUTER socket in front of the engine, driven by one thread.

Each turn of the loop reads the socket (waiting `idle_poll_s` when there is nothing to do, not at
all while there is), answers every message, checks the executor and runs one engine step in two
halves: it hands the step to the executor, sends what the last step produced while the executor
runs this one (an executor in its own process: the sends overlap the step), then waits for the
step's outputs, which the next turn sends.  The wire protocol is in `docs/protocol.md`; its
records in `events/wire.py`.

Bad input never ends the loop: every frame gets a reply, an ErrorReply when it cannot be served
(any failure to decode one is an ErrorReply too; a frame whose reply cannot be sent is dropped).
A client whose connection is gone is noticed when a send to it fails (ZMQ_ROUTER_MANDATORY):
streaming requests get a reply every step, the others a Keepalive about once a second, so a
vanished client's requests are aborted and their pages freed within about a second.

A lost executor is the engine's business: it recovers one stage per step while this loop keeps
answering (health `recovering`, new requests queued), and its clients only see a pause.  Once the
engine gives up (too many restarts) every request in flight gets an `executor_dead` error, health
says `dead`, and the loop ends `dead_exit_s` later so that a supervisor restarts the server.

Nothing is served unrecorded: while the event log cannot be written (a full disk, with the
recorder's `on_error` stop) the loop admits no request (`log_unwritable`), runs no step and holds
the last step's outputs, health says `log_unwritable` with the reason, and each turn the recorder
tries again; once it writes, serving resumes where it stopped and the log has lost nothing.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import structlog
import zmq
from zmq.utils import z85

from memstep.api.reattach import Detached, Reattach
from memstep.api.tally import Tally, host_rss_bytes
from memstep.core.config import ConfigError
from memstep.core.engine import Engine, UnknownRequest
from memstep.core.grammar import constraint_book
from memstep.core.grammar_check import Check
from memstep.core.outputs import RequestOutput
from memstep.core.prompt_checks import outside_vocabulary
from memstep.core.recovery import EngineDead
from memstep.core.sampling_params import DEFAULT_TEMPERATURE, InvalidRequest, SamplingParams
from memstep.core.snapshot import Admitted, EngineSnapshot
from memstep.events import codec
from memstep.events.types import RequestTimed, StepPlanned
from memstep.events.version import VERSION
from memstep.events.wire import (
    OVERLOADED,
    PROTOCOL_VERSION,
    AbortReply,
    AbortRequest,
    AttachRequest,
    ErrorReply,
    GenerateDelta,
    GenerateDeltas,
    GenerateDone,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    Keepalive,
    StatsReply,
    StatsRequest,
    Timing,
    TokenizeReply,
    TokenizeRequest,
    Usage,
    WireError,
    decode_request,
)
from memstep.replay.recorder import Recorder
from memstep.replay.resume import ResumePoint

log = structlog.get_logger("memstep.server")

T = TypeVar("T")

MAX_MESSAGES_PER_TURN = 256
# while the executor runs a step, the frames that come are read (and their prompts tokenized)
# this often: not between that step's result and the next plan, where the device would wait
AHEAD_POLL_S = 0.001
# the error a request ends with where the grammar engine cannot enforce its constraint
CONSTRAINT_UNENFORCEABLE = "constraint_unenforceable"
# requests whose constraints wait for a check worker at once; past it: overloaded
MAX_CHECKING = 64
# while a constraint's check runs in a grammar worker, an idle loop looks for its answer this often
CHECK_POLL_S = 0.005

# a generate request read while the executor ran a step, and its prompt's ids made then
Ahead = tuple[GenerateRequest, list[int]]
ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class RequestRefused(Exception):
    """A well-formed request the server will not serve; `code` goes back to the client."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@attrs.frozen(kw_only=True)
class ServerConfig:
    """Where and how the API socket listens.  A non-loopback host needs CURVE keys."""

    host: str = "127.0.0.1"
    port: int = 5557  # 0: any free port (see Server.endpoint)
    max_frame_bytes: int = 1 << 20  # larger frames get frame_too_large
    keepalive_s: float = 1.0
    idle_poll_s: float = 0.05
    stats_interval_s: float = 10.0  # a "stats" log line this often while busy; 0: never
    curve_secret_key: bytes | None = None  # z85, 40 characters
    curve_client_keys: frozenset[bytes] = frozenset()  # z85 public keys allowed to connect
    dead_exit_s: float = 2.0  # once the engine gave up: answer health (dead) this long, then stop
    # while a new executor starts, this many new requests are queued (beside those that were
    # waiting or running, all kept), then new ones get `recovering` errors: 60 req/s for the
    # 17-18 s an 8B model's recovery took on an H200 is about 1,100
    max_new_while_recovering: int = 4096
    # a new request that finds this many waiting (admitted, not yet running) is refused with
    # `overloaded` (HTTP 503 + Retry-After) instead of queued; 0: no bound.  How to choose it:
    # docs/serving-overload.md
    max_waiting_requests: int = 0

    def __attrs_post_init__(self) -> None:
        if self.max_frame_bytes < 1024:
            raise ConfigError("max_frame_bytes must be >= 1024")
        if self.max_new_while_recovering < 0:
            raise ConfigError("max_new_while_recovering must be >= 0")
        if self.max_waiting_requests < 0:
            raise ConfigError("max_waiting_requests must be >= 0 (0: no bound)")
        if (self.curve_secret_key is None) != (not self.curve_client_keys):
            raise ConfigError("CURVE needs both a server secret key and allowed client keys")
        if not (is_loopback(self.host) or self.uses_curve):
            raise ConfigError(
                f"refusing to listen on {self.host!r} without CURVE: give --curve-secret-key "
                "and --curve-client-keys, or bind to a loopback address"
            )

    @property
    def uses_curve(self) -> bool:
        return self.curve_secret_key is not None

    @property
    def hard_frame_bytes(self) -> int:
        """ZMQ_MAXMSGSIZE: a larger frame makes ZeroMQ drop the connection unread."""
        return 4 * self.max_frame_bytes


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
            self.request_id, text, list(self.token_ids), reason, usage, timing, self.logprobs,
            self.prompt_logprobs,
        )  # fmt: skip


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


class Server:
    """Owns the API socket and the requests in flight; drives `engine` (which it does not own)."""

    def __init__(self, engine: Engine, cfg: ServerConfig, recorder: Recorder | None = None):
        self.engine = engine
        self.cfg = cfg
        self.recorder = recorder  # among the engine's sinks; its failure stops admission
        self.ctx = zmq.Context()
        try:
            self.zap = self._zap_handler() if cfg.uses_curve else None
            self.sock = self._bind()
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        if self.zap is not None:
            self.poller.register(self.zap, zmq.POLLIN)
        self.inflight: dict[str, Inflight] = {}  # by engine request id
        self.new_while_recovering = (0, 0)  # (the engine's loss number, new requests queued)
        self.by_client: dict[tuple[bytes, str], str] = {}  # (peer, client id) -> engine id
        self.last_sent: dict[bytes, float] = {}  # for peers with requests in flight
        self.gone: set[bytes] = set()  # peers whose connection closed; dropped each turn
        self.finished: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()  # by error code
        self.executor_death: str | None = None  # why the engine gave up on executors
        self.unsent: list[RequestOutput] = []  # the last step's outputs, sent during the next
        # frames read while the executor ran a step, with a generate request's message and its
        # prompt's ids made then (None: nothing made ahead); handled in order at the next turn,
        # before any later frame
        self.early: collections.deque[tuple[list[bytes], Ahead | None]] = collections.deque()
        self.dead_since: float | None = None
        # requests whose constraint a grammar worker checks (core/grammar_check.py): admitted
        # by `_admit_checked` once it answers, never waited for on this thread
        self.grammars = constraint_book()
        self.checking: list[Checking] = []
        self.tally = Tally()
        self.detached = Reattach()  # requests carried over from a dead server's log
        self.num_migrated_in = 0  # requests a router moved here (GenerateRequest.output_token_ids)
        engine.listen(self.tally)
        engine.listen(self._note_scheduled)
        self.started = time.monotonic()
        self.last_keepalive = 0.0
        self.last_stats = (self.started, 0)  # (time, generation tokens) of the last stats line
        self.stopping = False
        # what a request's params leave out: the model's own defaults (--generation-config)
        self.facts = engine.snapshot().facts
        self.sampling_defaults = self.facts.sampling_defaults
        log.info("listening", endpoint=self.endpoint, curve=cfg.uses_curve)
        log.info(
            "sampling defaults",
            generation_config=self.facts.generation_config,
            **(self.sampling_defaults or {"temperature": DEFAULT_TEMPERATURE}),
        )

    def _bind(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a closed peer fails: disconnects
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.hard_frame_bytes)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # ZMTP pings close connections to dead hosts
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        if self.cfg.curve_secret_key is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.cfg.curve_secret_key)
            sock.setsockopt(zmq.ZAP_DOMAIN, b"memstep")
        host = self.cfg.host
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host}]"
        endpoint = f"tcp://{host}:{self.cfg.port or '*'}"
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise ConfigError(f"cannot listen on {endpoint}: {exc}") from exc
        return sock

    def _zap_handler(self) -> zmq.Socket:
        zap = self.ctx.socket(zmq.REP)
        zap.bind(ZAP_ENDPOINT)
        return zap

    # --- the loop --------------------------------------------------------------------------

    def serve_forever(self) -> None:
        while not self.stopping:
            self.run_once()
        self._send_unsent()

    def stop(self) -> None:
        """Make serve_forever return after the current turn (safe from a signal handler)."""
        self.stopping = True

    def run_once(self) -> None:
        """Read, check the executor, step (sending the last step's outputs while the executor
        runs this one), keep quiet clients alive."""
        busy = self._can_step() or bool(self.unsent) or bool(self.early)
        idle_s = CHECK_POLL_S if self.checking else self.cfg.idle_poll_s
        self._receive(0 if busy else idle_s)
        self._admit_checked()
        self._check_executor()
        self._drop_gone_peers()
        self._step()
        self._keepalive()
        dead_for = time.monotonic() - (self.dead_since or time.monotonic())
        if self.dead_since is not None and dead_for > self.cfg.dead_exit_s:
            self.stopping = True
        self._log_stats()

    def resume(self, point: ResumePoint) -> None:
        """Carry over the requests of a dead server's log (`serve --resume`), for AttachRequest."""
        self.detached.adopt(self.engine, point)

    def close(self) -> None:
        self.sock.close(0)
        if self.zap is not None:
            self.zap.close(0)
        self.ctx.term()

    def _can_step(self) -> bool:
        return self.executor_death is None and self.engine.has_work() and self._log_writable()

    def _log_writable(self) -> bool:
        """False while the event log cannot take what a step would record (tried again here)."""
        return self.recorder is None or not self.recorder.blocks or self.recorder.retry()

    def _log_blocks(self) -> bool:
        return self.recorder is not None and self.recorder.blocks

    def _receive(self, timeout: float) -> None:
        ready = dict(self.poller.poll(int(timeout * 1000)))
        if self.zap is not None and self.zap in ready:
            self._answer_zap()
        while self.early:
            self._handle_safely(*self.early.popleft())
        for _ in range(MAX_MESSAGES_PER_TURN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle_safely(frames, None)

    def _handle_safely(self, frames: list[bytes], ahead: Ahead | None) -> None:
        try:
            self._handle(frames, ahead)
        except Exception:  # even the error reply failed: drop the frame, keep serving
            log.exception("frame dropped", num_frames=len(frames))

    def _read_ahead(self) -> None:
        """While the executor runs a step: take the frames that came meanwhile and make their
        prompts' ids, so that the tokenizer's time (a long prompt's is a millisecond) is not
        spent between steps; the next turn handles them, in order, with those ids."""
        for _ in range(MAX_MESSAGES_PER_TURN - len(self.early)):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.early.append((frames, self._made_ahead(frames[-1])))

    def _made_ahead(self, payload: bytes) -> Ahead | None:
        """A generate request with a text prompt or chat, and its prompt's ids; None for any
        other frame, or one that fails here (handled in its turn, it fails there with its
        error)."""
        try:
            msg = decode_request(payload, self.cfg.max_frame_bytes)
            if not isinstance(msg, GenerateRequest) or msg.prompt_token_ids is not None:
                return None
            prompt = self._prompt(msg)
            tok = self.engine.tokenizer
            return msg, tok.encode(prompt) if isinstance(prompt, str) else prompt
        except Exception:
            return None

    def _check_executor(self) -> None:
        if self.executor_death is not None:
            return
        try:
            self.engine.check_executor()
        except EngineDead as exc:
            self._executor_died(str(exc))

    def _step(self) -> None:
        """Launch a step; while the executor runs it, send the outputs of the last one and read
        ahead the frames that come until its result does; then take this one's outputs, which
        the next turn sends (at once if no step follows it)."""
        if self.engine.snapshot().is_recovering:  # launch() starts an executor: seconds
            self._send_unsent()
        launched = self._can_step() and self._engine_call(self.engine.launch)
        try:
            self._send_unsent()
            if launched:
                self._read_ahead()
        finally:
            if launched:
                self.unsent = self._engine_call(self._outputs) or []

    def _outputs(self) -> list[RequestOutput]:
        """The launched step's outputs; the frames that come until they do are read ahead."""
        outputs = self.engine.finish(AHEAD_POLL_S)
        while outputs is None:
            self._read_ahead()
            outputs = self.engine.finish(AHEAD_POLL_S)
        return outputs

    def _send_unsent(self, request_id: str | None = None) -> None:
        """Send the last step's outputs (only those of `request_id`, if given); none while the
        log that should record them cannot be written."""
        if self._log_blocks():
            return
        if request_id is None:
            outputs, self.unsent = self.unsent, []
        else:
            outputs = [out for out in self.unsent if out.request_id == request_id]
            self.unsent = [out for out in self.unsent if out.request_id != request_id]
        now = time.monotonic()
        box = Outbox()
        for out in outputs:
            self._deliver(out, now, box)
        for envelope, reply in box.replies():
            self._send(envelope, reply)

    def _engine_call(self, call: Callable[[], T]) -> T | None:
        """`call()`, or None once every request failed: the engine gave up on executors, or a
        bug in a step (the server keeps serving)."""
        try:
            return call()
        except EngineDead as exc:
            self._executor_died(str(exc))
        except Exception as exc:
            log.exception("engine step failed")
            self._fail_all("internal_error", f"engine step failed: {exc}")
        return None

    def _keepalive(self) -> None:
        now = time.monotonic()
        if now - self.last_keepalive < self.cfg.keepalive_s / 2:
            return
        self.last_keepalive = now
        quiet: dict[bytes, list[str]] = collections.defaultdict(list)
        envelopes: dict[bytes, list[bytes]] = {}
        for inf in self.inflight.values():
            if now - self.last_sent[inf.peer] >= self.cfg.keepalive_s:
                quiet[inf.peer].append(inf.request_id)
                envelopes[inf.peer] = inf.envelope
        for peer, ids in quiet.items():
            self._send(envelopes[peer], Keepalive(ids))

    def _note_scheduled(self, rec: object) -> None:
        """Engine sink: a request's queue time ends with the first step planned to include it."""
        if not isinstance(rec, StepPlanned):
            return
        now = time.monotonic()
        for engine_id, _ in rec.batch:
            inf = self.inflight.get(engine_id)
            if inf is not None and inf.queue_s is None:
                inf.queue_s = now - inf.arrival

    def _log_stats(self) -> None:
        """The periodic "stats" line: load, KV pages, memory and tokens/s since the last one."""
        now, interval = time.monotonic(), self.cfg.stats_interval_s
        then, tokens_then = self.last_stats
        if not interval or now - then < interval:
            return
        tokens = self.tally.generation_tokens
        self.last_stats = (now, tokens)
        if tokens == tokens_then and not self.inflight:
            return  # idle: nothing worth a line
        snap = self.engine.snapshot()
        mem = snap.memory
        log.info(
            "stats",
            running=snap.num_running,
            waiting=snap.num_waiting,
            kv_pages_used=snap.kv_pages_used,
            kv_pages_total=snap.kv_pages_total,
            live_bytes=mem.live_bytes if mem else 0,
            reserved_bytes=mem.reserved_bytes if mem else 0,
            host_rss_bytes=host_rss_bytes(self._pids(snap)),
            tokens_per_s=round((tokens - tokens_then) / (now - then), 1),
        )

    # --- incoming messages -----------------------------------------------------------------

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
        waiting = []
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

    def _prompt(self, msg: GenerateRequest | TokenizeRequest) -> str | list[int]:
        """Text or token ids; chat messages become ids here, so their text stays plain text."""
        ids = msg.prompt_token_ids if isinstance(msg, GenerateRequest) else msg.token_ids
        given = [x for x in (msg.prompt, ids, msg.messages) if x is not None]
        if len(given) != 1:
            what = "prompt_token_ids" if isinstance(msg, GenerateRequest) else "token_ids"
            raise InvalidRequest(f"give exactly one of prompt, {what}, messages")
        extra = msg.chat_template_kwargs
        if any(not isinstance(key, str) for key in extra):
            raise InvalidRequest("chat_template_kwargs must map names (strings) to values")
        if msg.messages is None:
            if extra:
                raise InvalidRequest("chat_template_kwargs goes with messages only")
            return given[0]
        if not msg.messages:
            raise InvalidRequest("messages is empty")
        if any(set(m) != {"role", "content"} for m in msg.messages):
            raise InvalidRequest("every message needs exactly the keys 'role' and 'content'")
        special, extra = msg.special_tokens_in_messages, msg.chat_template_kwargs
        return self.engine.tokenizer.encode_chat(msg.messages, special, extra)

    def _tokenize(self, msg: TokenizeRequest) -> TokenizeReply:
        """A prompt's token ids as a generate request would read it, or token ids' text."""
        tok, vocab, max_len = self.engine.tokenizer, self.facts.vocab_size, self.facts.max_model_len
        if msg.tokenizer_info:
            config = tok.hf_config() | {"model_max_length": max_len}
            return TokenizeReply(msg.request_id, [], "", max_len, config)
        prompt = self._prompt(msg)
        if isinstance(prompt, str):
            ids, text = tok.encode(prompt), prompt
        else:
            bad = outside_vocabulary(prompt, vocab)
            if bad is not None:
                raise InvalidRequest(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
            ids, text = list(prompt), tok.decode(list(prompt))
        return TokenizeReply(msg.request_id, ids, text, max_len)

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

    def _health(self, msg: HealthRequest) -> HealthReply:
        dead, snap = self.executor_death, self.engine.snapshot()
        status = "dead" if dead else "recovering" if snap.is_recovering else "ok"
        log_failure = self.recorder.failure if self.recorder is not None else None
        if status == "ok" and self._log_blocks():
            status, dead = "log_unwritable", f"the event log cannot be written: {log_failure}"
        elif log_failure is not None:
            dead = dead or f"the event log cannot be written (records dropped): {log_failure}"
        return HealthReply(
            request_id=msg.request_id,
            status=status,
            executor_alive=not (self.executor_death or snap.is_recovering),
            executor_pid=snap.executor_pid,
            core_pid=os.getpid(),
            model=snap.facts.model,
            max_model_len=snap.facts.max_model_len,
            vocab_size=snap.facts.vocab_size,
            max_frame_bytes=self.cfg.max_frame_bytes,
            uptime_s=time.monotonic() - self.started,
            memstep_version=VERSION,
            protocol=PROTOCOL_VERSION,
            detail=dead or ("a new executor is starting" if status == "recovering" else ""),
        )

    def _stats(self, msg: StatsRequest) -> StatsReply:
        snap = self.engine.snapshot()
        return StatsReply(
            request_id=msg.request_id,
            num_running=snap.num_running,
            num_waiting=snap.num_waiting,
            num_inflight=len(self.inflight),
            num_clients=len({inf.peer for inf in self.inflight.values()}),
            step=snap.step,
            step_kind=snap.kind,
            kv_pages_total=snap.kv_pages_total,
            kv_pages_used=snap.kv_pages_used,
            memory=snap.memory,
            finished=dict(self.finished),
            kv_pages_cached=snap.kv_pages_cached,
            prompt_tokens=self.tally.prompt_tokens,
            generation_tokens=self.tally.generation_tokens,
            num_preemptions=snap.num_preemptions,
            num_requeues=snap.num_requeues,
            num_leak_reports=self.tally.num_leak_reports,
            steps=dict(self.tally.steps),
            transitions=dict(self.tally.transitions),
            host_rss_bytes=host_rss_bytes(self._pids(snap)),
            refused=dict(self.refused),
        )

    def _pids(self, snap: EngineSnapshot) -> dict[str, int]:
        pids = {"core": os.getpid(), "executor": snap.executor_pid, "standby": snap.standby_pid}
        return {name: pid for name, pid in pids.items() if pid}

    def _answer_zap(self) -> None:
        """ZAP (RFC 27): admit a CURVE client only if its public key is on the allowed list."""
        assert self.zap is not None
        while self.zap.poll(0):
            version, seq, _domain, _address, _identity, mechanism, *creds = (
                self.zap.recv_multipart()
            )
            key = z85.encode(creds[0]) if mechanism == b"CURVE" and creds else b""
            ok = key in self.cfg.curve_client_keys
            status = (b"200", b"OK") if ok else (b"400", b"client key not allowed")
            log.info("zap", allowed=ok, mechanism=mechanism)
            self.zap.send_multipart([version, seq, *status, key, b""])

    # --- outgoing messages -----------------------------------------------------------------

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

    # --- ends of requests ------------------------------------------------------------------

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


def _sampling_params(data: dict, defaults: dict[str, Any]) -> SamplingParams:
    """A request's params; what it leaves out (or sends as nil) takes the model's default."""
    for key in data:
        if type(key) is not str:
            raise InvalidRequest("sampling param names must be strings")
    given = {k: v for k, v in data.items() if v is not None or k not in defaults}
    return SamplingParams.from_dict({**defaults, **given})


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def _message(exc: BaseException) -> str:
    return codec.clip(str(exc.args[0]) if exc.args else type(exc).__name__, 1000)
