"""The router's answers to health and stats: its replicas' last replies, summed into one view.

Health is `ok` while any replica serves, `recovering` while none does but some may yet (starting,
or restarting an executor), `dead` once every replica is lost.  Stats sum the replicas' counters
and keep each replica's figures by name in `replicas`, for `/metrics`' `replica` label.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Protocol

from memstep.events.version import VERSION
from memstep.events.wire import (
    PROTOCOL_VERSION,
    HealthReply,
    HealthRequest,
    StatsReply,
    StatsRequest,
)
from memstep.router.replica import Replica

SUMMED = (
    "num_running",
    "num_waiting",
    "num_inflight",
    "num_clients",
    "kv_pages_total",
    "kv_pages_used",
    "kv_pages_cached",
    "prompt_tokens",
    "generation_tokens",
    "num_preemptions",
    "num_requeues",
    "num_leak_reports",
)
COUNTED = ("finished", "steps", "transitions", "refused")


class RouterView(Protocol):
    started: float  # time.monotonic() at its start


def health_of(msg: HealthRequest, replicas: list[Replica], router: RouterView) -> HealthReply:
    live = [b for b in replicas if b.live]
    known = [b.health for b in replicas if b.health is not None]
    status = "ok" if live else "dead" if all(b.lost for b in replicas) else "recovering"
    first = live[0].health if live else known[0] if known else None
    lost = [str(b.index) for b in replicas if b.lost]
    detail = f"{len(live)} of {len(replicas)} replicas serve"
    detail += f"; lost: {', '.join(lost)}" if lost else ""
    return HealthReply(
        request_id=msg.request_id,
        status=status,
        executor_alive=bool(live),
        executor_pid=0,
        core_pid=os.getpid(),
        model=first.model if first else "",
        max_model_len=first.max_model_len if first else 0,
        vocab_size=first.vocab_size if first else 0,
        max_frame_bytes=min((h.max_frame_bytes for h in known), default=1 << 20),
        uptime_s=time.monotonic() - router.started,
        memstep_version=VERSION,
        protocol=PROTOCOL_VERSION,
        detail=detail,
    )


def stats_of(msg: StatsRequest, replicas: list[Replica], router: RouterView) -> StatsReply:
    replies = [b.stats for b in replicas if b.stats is not None and not b.lost]
    sums: dict[str, Any] = {name: sum(getattr(s, name) for s in replies) for name in SUMMED}
    for name in COUNTED:
        total: collections.Counter[str] = collections.Counter()
        for s in replies:
            total.update(getattr(s, name))
        sums[name] = dict(total)
    rss = {
        f"replica{b.index}:{k}": v
        for b in replicas
        if b.stats and not b.lost
        for k, v in b.stats.host_rss_bytes.items()
    }
    return StatsReply(
        request_id=msg.request_id,
        step=max((s.step for s in replies), default=0),
        step_kind="serve" if replies else "none",
        memory=None,
        host_rss_bytes=rss,
        replicas={str(b.index): _figures(b) for b in replicas},
        **sums,
    )


def _figures(b: Replica) -> dict[str, int]:
    figures = {"live": int(b.live), "lost": int(b.lost)}
    if b.stats is not None and not b.lost:
        figures.update({name: getattr(b.stats, name) for name in SUMMED})
        if b.stats.memory is not None:
            figures["memory_live_bytes"] = b.stats.memory.live_bytes
            figures["memory_reserved_bytes"] = b.stats.memory.reserved_bytes
    return figures
