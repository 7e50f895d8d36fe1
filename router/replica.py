"""One replica as the router sees it: a DEALER socket to its core and what it last said.

A replica is `live` from its first `ok` health reply until it is lost: its connection closes (a
core killed: its OS closes the connection), its connection carries nothing for `timeout_s`
(ZMTP heartbeats, answered by the replica's ZMQ I/O thread, so a core busy in a long step still
answers them and only a machine or network gone is silent), or it answers `executor_dead` (its
engine gave up).  Health is asked every `poll_interval_s`; a slow answer is no loss.  A lost
replica's socket is closed at once, so nothing it sent after the loss is read: its requests
continue elsewhere.  A fresh socket (a new identity: the replica drops what the old one asked)
then keeps asking its health, so a replica that was only paused (SIGSTOP, a network gone for a
while) is taken back once it answers `ok` again (`returned`).
"""

from __future__ import annotations

import zmq

from memstep.events import codec
from memstep.events.wire import HealthReply, HealthRequest, StatsReply, StatsRequest

Key = bytes | None
HEARTBEAT_IVL_MS = 1000  # a ZMTP PING this often on an otherwise quiet connection


class Replica:
    """The socket to one replica's core; owns it and its monitor."""

    def __init__(
        self,
        ctx: zmq.Context,
        index: int,
        endpoint: str,
        curve: tuple[Key, Key, Key],
        timeout_s: float,
    ):
        self.index = index
        self.endpoint = endpoint
        self.ctx, self.curve, self.timeout_s = ctx, curve, timeout_s
        self.lost = False  # lost and not yet back: no request goes to it
        self.num_polls = 0
        self._open()

    def _open(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.timeout_s * 1000))
        server_key, public, secret = self.curve
        if server_key:
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public or b"")
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret or b"")
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(self.endpoint)
        self.closed = False
        self.joined = False  # answered health once: from now on its silence or closing is a loss
        self.live = False  # its last health was "ok" (not "recovering", not "dead")
        self.last_polled = 0.0
        self.health: HealthReply | None = None
        self.stats: StatsReply | None = None

    def send(self, msg: object) -> bool:
        """Send `msg`; False when no connection takes it now."""
        try:
            self.sock.send(codec.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def poll(self, now: float) -> None:
        """Ask for health and stats; their replies keep it live."""
        self.num_polls += 1
        self.send(HealthRequest(f"h{self.num_polls}"))
        self.send(StatsRequest(f"s{self.num_polls}"))
        self.last_polled = now

    def heard(self, msg: object) -> None:
        """Keep its last health and stats."""
        if isinstance(msg, HealthReply):
            self.health = msg
            self.joined = True
            self.live = msg.status == "ok"
        elif isinstance(msg, StatsReply):
            self.stats = msg

    def disconnected(self) -> bool:
        """Whether its connection closed since the last look."""
        found = False
        while self.monitor.poll(0):
            self.monitor.recv_multipart()
            found = True
        return found

    def lose(self) -> None:
        """Close its socket (nothing more is read from it) and open a fresh one that waits for
        the replica to answer again."""
        self.close()
        self.lost = True
        self._open()

    def returned(self) -> bool:
        """Whether a lost replica answers `ok` again: it is no longer lost."""
        back = self.lost and self.live
        self.lost = self.lost and not back
        return back

    def close(self) -> None:
        if self.closed:
            return
        self.live, self.closed = False, True
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
