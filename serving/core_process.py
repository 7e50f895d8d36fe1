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
import time
from collections.abc import Callable
from typing import TypeVar

import structlog
import zmq

from memstep.core.engine import Engine
from memstep.core.grammar import constraint_book
from memstep.core.outputs import RequestOutput
from memstep.core.recovery import EngineDead
from memstep.core.sampling_params import DEFAULT_TEMPERATURE
from memstep.events.types import PhaseChanged, RecoveryDone, StepPlanned
from memstep.events.wire import (
    GenerateRequest,
    Keepalive,
    decode_request,
)
from memstep.replay.recorder import Recorder
from memstep.replay.resume import ResumePoint
from memstep.serving.core_admission import Admission, Ahead
from memstep.serving.core_config import ServerConfig
from memstep.serving.core_replies import Checking, Inflight, Outbox
from memstep.serving.core_socket import answer_zap, bind, zap_handler
from memstep.serving.reattach import Reattach
from memstep.serving.tally import Tally, host_rss_bytes

log = structlog.get_logger("memstep.server")

T = TypeVar("T")

MAX_MESSAGES_PER_TURN = 256
# while the executor runs a step, the frames that come are read (and their prompts tokenized)
# this often: not between that step's result and the next plan, where the device would wait
AHEAD_POLL_S = 0.001
# while a constraint's check runs in a grammar worker, an idle loop looks for its answer this often
CHECK_POLL_S = 0.005


class Server(Admission):
    """Owns the API socket and the requests in flight; drives `engine` (which it does not own)
    through its surface: add, abort, launch, finish, check_executor, has_work, snapshot, the
    tokenizer, emit and listen (a test counts them)."""

    def __init__(self, engine: Engine, cfg: ServerConfig, recorder: Recorder | None = None):
        self.engine = engine
        self.cfg = cfg
        self.recorder = recorder  # among the engine's sinks; its failure stops admission
        self.ctx = zmq.Context()
        try:
            self.zap = zap_handler(self.ctx) if cfg.uses_curve else None
            self.sock = bind(self.ctx, cfg)
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
        self.checking = list[Checking]()
        self.tally = Tally()
        self.detached = Reattach()  # requests carried over from a dead server's log
        self.num_migrated_in = 0  # requests a router moved here (GenerateRequest.output_token_ids)
        engine.listen(self.tally)
        self.recovering = False  # from the engine's records (`_note`)
        engine.listen(self._note)
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
            answer_zap(self.zap, self.cfg)
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
        if self.recovering:  # launch() starts an executor: seconds, not a step
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

    def _note(self, rec: object) -> None:
        """Engine sink: a request's queue time ends with the first step planned to include it;
        a recovery runs from the phase `recover` to RecoveryDone (read here, not asked of the
        engine each turn)."""
        if isinstance(rec, StepPlanned):
            now = time.monotonic()
            for engine_id, _ in rec.batch:
                inf = self.inflight.get(engine_id)
                if inf is not None and inf.queue_s is None:
                    inf.queue_s = now - inf.arrival
        elif isinstance(rec, PhaseChanged) and rec.new == "recover":
            self.recovering = True
        elif isinstance(rec, RecoveryDone):
            self.recovering = False

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
