"""Prometheus metrics of the HTTP front, named `memstep:*`.

Three sources.  The front's own figures (`FrontStats`: its resident memory, open connections,
requests in flight, its client's entries) are read at each scrape.  Latency histograms (TTFT,
inter-token, end to end) are observed by the front from the `Timing` of each request it answers;
with several fronts (`--api-server-count`), each writes them to the folder named by
`PROMETHEUS_MULTIPROC_DIR` (prometheus_client's multiprocess mode) and a scrape of any front sums
every front's.
Everything the core owns (requests running and waiting, KV pages, token and step totals, memory)
is mirrored from a `StatsReply` fetched at each scrape, so the figures are the core's own, never
counted a second time here.
"""

from __future__ import annotations

import bisect
import collections
import os
from collections.abc import Iterator

import attrs
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from memstep.events.wire import GenerateDone, StatsReply

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is imported
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@attrs.frozen(kw_only=True)
class FrontStats:
    """The HTTP front's own figures at a scrape: what an outsider can make it hold."""

    rss_bytes: int
    num_connections: int
    num_inflight: int
    num_client_entries: int  # requests its ZMQ client tracks; back to 0 when idle
    num_refused_connections: int
    num_timed_out_connections: int


class Metrics:
    """The registry `/metrics` exposes: latency histograms plus the core's mirrored stats."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        shared = os.environ.get(MULTIPROC_ENV)
        # shared: the histograms live in the folder's files, read back merged by the collector
        self._own = None if shared else self.registry
        if shared:
            MultiProcessCollector(self.registry, shared)
        self.core = CoreStats()
        self.registry.register(self.core)
        self.front = FrontCollector()
        self.registry.register(self.front)
        self.ttft = self._histogram("time_to_first_token_seconds", "time to first token")
        self.itl = Histogram(
            "memstep:inter_token_latency_seconds",
            "time between consecutive output tokens",
            buckets=TOKEN_BUCKETS,
            registry=self._own,
        )
        self.e2e = self._histogram("e2e_request_latency_seconds", "request end-to-end latency")
        self.queue = self._histogram("request_queue_time_seconds", "arrival to first scheduled")

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(f"memstep:{name}", doc, buckets=LATENCY_BUCKETS, registry=self._own)

    def observe(self, done: GenerateDone) -> None:
        """Record one finished request's latencies."""
        timing = done.timing
        if timing.ttft_s is not None:
            self.ttft.observe(timing.ttft_s)
        times = timing.token_times_s
        gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
        observe_all(self.itl, gaps)
        self.e2e.observe(timing.e2e_s)
        if timing.queue_s is not None:
            self.queue.observe(timing.queue_s)

    def exposition(self, stats: StatsReply | None, front: FrontStats | None = None) -> bytes:
        self.core.stats = stats
        self.front.stats = front
        return generate_latest(self.registry)


def observe_all(histogram: Histogram, values: list[float]) -> None:
    """`histogram.observe` of every value, as one update of its sum and of each bucket hit: a
    request's inter-token gaps are hundreds of values, and one observe takes a lock (with
    several fronts, writes a shared file) each time. Falls back to one observe a value where
    prometheus_client keeps its parts otherwise."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    counts = collections.Counter(bisect.bisect_left(bounds, v) for v in values)
    for index, count in counts.items():
        buckets[index].inc(count)  # bisect_left: the first bound >= the value, as observe's
    total.inc(sum(values))


class FrontCollector(Collector):
    """Yields the front's own figures (none when not given)."""

    def __init__(self) -> None:
        self.stats: FrontStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        yield _gauge("front_rss_bytes", "resident memory of the HTTP front", s.rss_bytes)
        yield _gauge("front_connections", "open HTTP connections", s.num_connections)
        yield _gauge("front_requests_inflight", "HTTP requests being answered", s.num_inflight)
        doc = "requests the front's client of the core tracks"
        yield _gauge("front_client_entries", doc, s.num_client_entries)
        doc = "connections closed as they opened, past --max-connections"
        yield _counter("front_connections_refused", doc, s.num_refused_connections)
        doc = "connections closed for sending no whole request head in time"
        yield _counter("front_connections_timed_out", doc, s.num_timed_out_connections)


class CoreStats(Collector):
    """Yields the core's figures from the last StatsReply (none before the first)."""

    def __init__(self) -> None:
        self.stats: StatsReply | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        yield _gauge("num_requests_running", "requests in the running batch", s.num_running)
        yield _gauge("num_requests_waiting", "requests waiting to be scheduled", s.num_waiting)
        usage = s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0
        yield _gauge("kv_cache_usage_perc", "fraction of KV pages in use (0 to 1)", usage)
        yield _gauge("kv_pages_used", "KV pages in use", s.kv_pages_used)
        yield _gauge("kv_pages_total", "KV pages in the cache", s.kv_pages_total)
        yield _counter("prompt_tokens", "prompt tokens admitted", s.prompt_tokens)
        yield _counter("generation_tokens", "tokens generated", s.generation_tokens)
        yield _counter(
            "num_preemptions", "requests preempted for room (recomputed)", s.num_preemptions
        )
        yield _counter(
            "num_requeues", "requests requeued by an executor loss (recomputed)", s.num_requeues
        )
        yield _counter("leak_reports", "leak reports (LeakSuspected records)", s.num_leak_reports)
        yield _labelled("request_success", "finished requests", "finished_reason", s.finished)
        yield _labelled("requests_refused", "generate requests refused", "code", s.refused)
        yield _labelled("steps", "engine steps run", "kind", s.steps)
        yield _labelled("step_transitions", "step-kind transitions", "transition", s.transitions)
        yield from _memory(s)
        yield from _replicas(s)


def _replicas(s: StatsReply) -> Iterator[Metric]:
    """Behind a router (`serve --data-parallel-size`): each replica's figures, by `replica`."""
    names = sorted({name for figures in s.replicas.values() for name in figures})
    for name in names:
        family = GaugeMetricFamily(
            f"memstep:replica_{name}", f"{name} of each replica", labels=["replica"]
        )
        for replica, figures in sorted(s.replicas.items()):
            if name in figures:
                family.add_metric([replica], figures[name])
        yield family


def _memory(s: StatsReply) -> Iterator[Metric]:
    m = s.memory
    if m is not None:
        yield _gauge("memory_live_bytes", "device bytes live after the last step", m.live_bytes)
        yield _gauge("memory_reserved_bytes", "bytes the allocator reserves", m.reserved_bytes)
        yield _gauge("allocator_segments", "allocator segments (CPU: storages)", m.num_segments)
        yield _gauge("arena_claimed_bytes", "bytes step kinds claim", m.arena_claimed_bytes)
        doc = "bytes of the executor's compiled grammar matchers (estimated)"
        yield _gauge("grammar_cache_bytes", doc, m.grammar_cache_bytes)
        doc = "bytes of the core's constraint verdicts"
        yield _gauge("constraint_cache_bytes", doc, m.constraint_cache_bytes)
    rss = GaugeMetricFamily(
        "memstep:host_rss_bytes", "resident host memory by process", labels=["process"]
    )
    for process, nbytes in sorted(s.host_rss_bytes.items()):
        rss.add_metric([process], nbytes)
    yield rss


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"memstep:{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"memstep:{name}", doc, value=value)


def _labelled(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"memstep:{name}", doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family
