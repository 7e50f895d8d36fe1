"""The router: one ZMQ endpoint in front of several replicas, each a `memstep serve` core.

Clients (the HTTP front among them) speak the client API to it as to one core (`docs/protocol.md`).
Each generate request goes to one replica by the routing policy (`router/policy.py`), always
streamed from the replica so the router holds every token its client was sent.  When a replica is
lost (`router/replica.py`), each of its unfinished requests is resent to a live replica with its
prompt, params, seed and those tokens (`GenerateRequest.output_token_ids`); seeded sampling keys
each draw by (seed, position), so the stream goes on with the tokens it would have had, and the
client sees a pause.  Every routing and migration is a record of the router's own log
(`events/routing.py`), which `memstep replay` checks and `memstep inspect` lists.

One thread drives it (`run_once`), as the core's `Server`; the replicas stay what they are, each
with its own executor, log and recovery.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import structlog
import zmq

from memstep.core.sampling_params import SamplingParams
from memstep.events import codec
from memstep.events.log import LogWriter
from memstep.events.routing import (
    ROUTER_LOG_KIND,
    ReplicaLost,
    ReplicaReturned,
    RequestMigrated,
    RequestRouted,
    RouteEnded,
)
from memstep.events.wire import (
    EXECUTOR_DEAD,
    RECOVERING,
    AbortReply,
    AbortRequest,
    AttachRequest,
    ErrorReply,
    GenerateDelta,
    GenerateDone,
    GenerateRequest,
    HealthRequest,
    StatsRequest,
    TokenizeReply,
    TokenizeRequest,
    WireError,
    decode_request,
)
from memstep.router.policy import NoReplica, Policy
from memstep.router.prefix import block_hashes, prompt_key
from memstep.router.replica import Replica
from memstep.router.routed import Routed
from memstep.router.summary import health_of, stats_of

log = structlog.get_logger("memstep.router")

SEED_BOUND = 2**63


@attrs.frozen(kw_only=True)
class RouterConfig:
    """Where the router listens, how it routes and when a silent connection counts as lost."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port (Router.endpoint)
    policy: str = "prefix"
    replica_timeout_s: float = 5.0  # a connection silent this long, heartbeats included, closes
    poll_interval_s: float = 0.5
    max_frame_bytes: int = 1 << 20
    seed: int | None = None  # draws the seeds of requests that come without one
    replica_curve: tuple[bytes | None, bytes | None, bytes | None] = (None, None, None)
    # test-only: migrate without the tokens sent, to prove that the migration test fails
    debug_drop_sent_tokens: bool = False


class Router:
    """Owns the client socket, a `Replica` (socket) for each replica, the requests in flight
    and the log."""

    def __init__(self, replicas: list[str], cfg: RouterConfig, log_path: Path | None = None):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(f"tcp://{cfg.host}:{cfg.port}")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replicas = [
            Replica(self.ctx, i, e, cfg.replica_curve, cfg.replica_timeout_s)
            for i, e in enumerate(replicas)
        ]
        self.policy = Policy(cfg.policy, len(replicas))
        self.seeds = random.Random(cfg.seed if cfg.seed is not None else os.urandom(16))
        self.routed: dict[tuple[bytes, str], Routed] = {}
        self.by_backend: dict[tuple[int, str], Routed] = {}
        # tokenize requests a replica answers: (replica, its id) -> (client envelope, client id)
        self.tokenizing: dict[tuple[int, str], tuple[list[bytes], str]] = {}
        self.num_tokenize = 0
        self.seq = 0
        self.started = time.monotonic()
        self.stopping = False
        self.writer = LogWriter(log_path, self._header(replicas)) if log_path else None

    def _header(self, replicas: list[str]) -> dict[str, Any]:
        cfg = {"policy": self.cfg.policy, "replicas": replicas, "seed": self.cfg.seed}
        return {"kind": ROUTER_LOG_KIND, "router": cfg}

    # --- the loop ----------------------------------------------------------------------------

    def serve_forever(self) -> None:
        while not self.stopping:
            self.run_once(0.05)

    def stop(self) -> None:
        self.stopping = True

    def run_once(self, timeout: float) -> None:
        """Read every socket, answer, check the replicas, flush the log."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        socks = {b.index: b.sock for b in self.replicas}
        for sock in socks.values():
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout * 1000)))
        for b in self.replicas:
            if socks[b.index] in ready and b.sock is socks[b.index]:
                self._read_replica(b)
        if self.sock in ready:
            self._read_clients()
        self._check_replicas()
        if self.writer is not None:
            self.writer.flush()

    def wait_live(self, timeout: float) -> bool:
        """Turn until every replica answers health `ok`; False after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not all(b.live for b in self.replicas):
            if time.monotonic() > deadline:
                return False
            self.run_once(0.05)
        return True

    def models(self) -> dict[int, str]:
        """The model each replica that answered health serves (its label, weights seed and all):
        a migration continues a stream exactly only on the same model."""
        return {b.index: b.health.model for b in self.replicas if b.health is not None}

    def close(self) -> None:
        for b in self.replicas:
            b.close()
        self.sock.close(0)
        self.ctx.term()
        if self.writer is not None:
            self.writer.close()

    # --- clients -----------------------------------------------------------------------------

    def _read_clients(self) -> None:
        for _ in range(256):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        envelope, payload = frames[:-1], frames[-1]
        try:
            msg = decode_request(payload, self.cfg.max_frame_bytes)
        except WireError as exc:
            self._send(envelope, ErrorReply(exc.request_id, exc.code, str(exc)))
            return
        handlers: dict[type, Callable[[list[bytes], Any], None]] = {
            GenerateRequest: self._generate,
            AbortRequest: self._abort,
            HealthRequest: lambda env, m: self._send(env, health_of(m, self.replicas, self)),
            StatsRequest: lambda env, m: self._send(env, stats_of(m, self.replicas, self)),
            AttachRequest: self._no_attach,
            TokenizeRequest: self._tokenize,
        }
        try:
            handlers[type(msg)](envelope, msg)
        except Exception as exc:  # a router bug costs this request, never the router
            log.exception("request failed", request_id=msg.request_id)
            self._error(envelope, msg.request_id, "internal_error", str(exc))

    def _generate(self, envelope: list[bytes], msg: GenerateRequest) -> None:
        if (envelope[0], msg.request_id) in self.routed:
            self._error(envelope, msg.request_id, "duplicate_request", "already in flight")
            return
        params = dict(msg.params)
        if params.get("seed") is None:
            params["seed"] = self.seeds.randrange(SEED_BOUND)
        # the router reads its engines' replies one frame a request (no GenerateDeltas)
        msg = attrs.evolve(msg, params=params, stream=msg.stream, batch_deltas=False)
        hashes = block_hashes(prompt_key(msg.prompt, msg.prompt_token_ids, msg.messages))
        loads, live = self._loads(), self._live()
        try:
            choice = self.policy.choose(hashes, loads, live)
        except NoReplica:
            self._error(envelope, msg.request_id, RECOVERING, "no replica serves; retry soon")
            return
        self.seq += 1
        r = Routed(
            envelope,
            msg,
            self.seq,
            choice.replica,
            f"r{self.seq}",
            time.monotonic(),
            hashes,
            _estimate(msg),
            _max_tokens(params),
        )
        self._track(r)
        seed = params["seed"] if type(params["seed"]) is int else -1  # not an int: refused there
        self._record(
            RequestRouted(
                self.seq,
                msg.request_id,
                r.backend_id,
                seed,
                hashes,
                loads,
                live,
                choice.replica,
                choice.reason,
                choice.matched_blocks,
                time.time(),
            )
        )
        self._forward(r, [])

    def _abort(self, envelope: list[bytes], msg: AbortRequest) -> None:
        r = self.routed.get((envelope[0], msg.target_id))
        if r is None:
            self._error(envelope, msg.request_id, "unknown_request", f"{msg.target_id!r}")
            return
        self.replicas[r.replica].send(AbortRequest(f"x{r.backend_id}", r.backend_id))
        self._end(r, r.done("abort", time.monotonic()))
        self._send(envelope, AbortReply(msg.request_id, msg.target_id))

    def _tokenize(self, envelope: list[bytes], msg: TokenizeRequest) -> None:
        """Asked of the first live replica (all serve one model); its answer is relayed."""
        live = [b for b in self.replicas if b.live]
        if not live:
            self._error(envelope, msg.request_id, EXECUTOR_DEAD, "every replica is lost")
            return
        self.num_tokenize += 1
        backend_id = f"t{self.num_tokenize}"
        self.tokenizing[(live[0].index, backend_id)] = (envelope, msg.request_id)
        live[0].send(attrs.evolve(msg, request_id=backend_id))

    def _no_attach(self, envelope: list[bytes], msg: AttachRequest) -> None:
        message = "a router carries requests across a replica's loss, not its own restart"
        self._error(envelope, msg.request_id, "unknown_request", message)

    def _send(self, envelope: list[bytes], msg: object) -> None:
        try:
            self.sock.send_multipart([*envelope, codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:  # the client is gone: its requests are aborted at their replicas
            for r in [r for r in self.routed.values() if r.envelope[0] == envelope[0]]:
                self.replicas[r.replica].send(AbortRequest(f"x{r.backend_id}", r.backend_id))
                self._forget(r)

    def _error(self, envelope: list[bytes], request_id: str, code: str, message: str) -> None:
        self._send(envelope, ErrorReply(request_id, code, message))

    # --- replicas ----------------------------------------------------------------------------

    def _read_replica(self, b: Replica) -> None:
        sock = b.sock
        for _ in range(1024):
            if b.sock is not sock:  # lost while reading: nothing more from the old socket
                return
            try:
                msg = codec.decode(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            now = time.monotonic()
            b.heard(msg)
            if b.returned():
                self._return(b)
            key = (b.index, getattr(msg, "request_id", ""))
            r = self.by_backend.get(key)
            if r is not None:
                self._reply(b, r, msg, now)
            elif key in self.tokenizing and isinstance(msg, (TokenizeReply, ErrorReply)):
                envelope, request_id = self.tokenizing.pop(key)
                self._send(envelope, attrs.evolve(msg, request_id=request_id))

    def _reply(self, b: Replica, r: Routed, msg: object, now: float) -> None:
        if isinstance(msg, GenerateDelta):
            r.take(msg.token_ids, msg.text, msg.logprobs, now)
            if r.msg.stream:
                delta = GenerateDelta(r.msg.request_id, msg.token_ids, msg.text, msg.logprobs)
                self._send(r.envelope, delta)
        elif isinstance(msg, GenerateDone):
            self._end(r, r.done(msg.finish_reason, now, msg))
        elif isinstance(msg, ErrorReply) and msg.code == EXECUTOR_DEAD:
            self._lose(b, f"its engine gave up: {msg.message}")
        elif isinstance(msg, ErrorReply):
            self._end(r, ErrorReply(r.msg.request_id, msg.code, msg.message))

    def _check_replicas(self) -> None:
        now = time.monotonic()
        for b in self.replicas:
            if b.disconnected() and b.joined and not b.lost:
                self._lose(b, "its connection closed (or carried nothing for the timeout)")
            elif now - b.last_polled >= self.cfg.poll_interval_s:
                b.poll(now)

    def _lose(self, b: Replica, reason: str) -> None:
        """Close a lost replica and move each of its unfinished requests to a live one."""
        b.lose()
        self.policy.lose(b.index)
        for key in [key for key in self.tokenizing if key[0] == b.index]:
            envelope, request_id = self.tokenizing.pop(key)
            self._error(envelope, request_id, EXECUTOR_DEAD, f"the replica was lost: {reason}")
        victims = sorted(
            (r for r in self.routed.values() if r.replica == b.index), key=lambda r: r.seq
        )
        self.seq += 1
        self._record(ReplicaLost(self.seq, b.index, b.endpoint, reason, len(victims)))
        log.warning("replica lost", replica=b.index, reason=reason, requests=len(victims))
        for r in victims:
            self._migrate(r, b.index)

    def _return(self, b: Replica) -> None:
        """A lost replica answers `ok` again (it was paused, or its network was): it serves."""
        self.seq += 1
        self._record(ReplicaReturned(self.seq, b.index, b.endpoint))
        log.warning("replica back", replica=b.index)

    def _migrate(self, r: Routed, lost: int) -> None:
        now = time.monotonic()
        del self.by_backend[(lost, r.backend_id)]
        if len(r.token_ids) >= r.max_tokens:
            self._end(r, r.done("length", now))
            return
        loads, live = self._loads(), self._live()
        try:
            choice = self.policy.choose(r.hashes, loads, live)
        except NoReplica:
            self._end(r, ErrorReply(r.msg.request_id, EXECUTOR_DEAD, "every replica is lost"))
            return
        self.seq += 1
        r.replica, r.backend_id, r.lost_at = choice.replica, f"r{self.seq}", now
        r.num_migrations += 1
        self.by_backend[(r.replica, r.backend_id)] = r
        self._record(
            RequestMigrated(
                self.seq,
                r.msg.request_id,
                r.backend_id,
                lost,
                loads,
                live,
                choice.replica,
                choice.reason,
                choice.matched_blocks,
                len(r.token_ids),
            )
        )
        self._forward(r, [] if self.cfg.debug_drop_sent_tokens else list(r.token_ids))

    def _forward(self, r: Routed, carried: list[int]) -> None:
        msg = attrs.evolve(r.msg, request_id=r.backend_id, stream=True, output_token_ids=carried)
        if not self.replicas[r.replica].send(msg):
            self._lose(self.replicas[r.replica], "it took no request")

    # --- bookkeeping -------------------------------------------------------------------------

    def _track(self, r: Routed) -> None:
        self.routed[r.key] = r
        self.by_backend[(r.replica, r.backend_id)] = r

    def _forget(self, r: Routed) -> None:
        self.routed.pop(r.key, None)
        self.by_backend.pop((r.replica, r.backend_id), None)

    def _end(self, r: Routed, last: GenerateDone | ErrorReply) -> None:
        self._forget(r)
        reason = last.finish_reason if isinstance(last, GenerateDone) else last.code
        self.seq += 1
        self._record(
            RouteEnded(
                self.seq,
                r.msg.request_id,
                r.replica,
                reason,
                len(r.token_ids),
                r.num_migrations,
                round(r.pause_s, 6),
            )
        )
        self._send(r.envelope, last)

    def _loads(self) -> list[int]:
        loads = [0] * len(self.replicas)
        for r in self.routed.values():
            loads[r.replica] += r.load
        return loads

    def _live(self) -> list[bool]:
        return [b.live for b in self.replicas]

    def _record(self, rec: object) -> None:
        if self.writer is not None:
            self.writer.append(rec)


def _estimate(msg: GenerateRequest) -> int:
    if msg.prompt_token_ids is not None:
        return len(msg.prompt_token_ids)
    return len(prompt_key(msg.prompt, None, msg.messages)) // 4


def _max_tokens(params: dict) -> int:
    try:
        return SamplingParams.from_dict(params).max_tokens
    except Exception:  # the replica refuses it with the reason
        return SamplingParams().max_tokens
