"""`bench serve --dataset RUN.memlog`: the traffic a `serve` log recorded, sent again to a live
server at its recorded pace (`--speed` scales it), as SGLang's request-dump replay does.

Each request goes out with its recorded prompt tokens and sampling params (seed included) at its
recorded arrival offset, so production traffic recorded under one configuration can be tried
against another.  Reported beside the usual serving metrics: how late each request left (the
pacing error) and whether each seeded request's completion is the recorded one.  The log holds
no wall time for a request's end, so recorded latencies are not available to compare with.
`memstep replay` stays the exact, step-by-step replay.
"""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from memstep.api.client import AsyncClient, ServerError
from memstep.events.log import read_log
from memstep.events.types import RequestAdded, RequestFinished, StepFinished


@attrs.frozen
class Recorded:
    """One request of the log: what was sent, when, and what the recorded run answered."""

    request_id: str
    offset_s: float  # arrival, seconds after the log's first request
    prompt_token_ids: list[int]
    params: dict[str, Any]
    token_ids: list[int]
    finish_reason: str | None  # None: still running when the log ended


@attrs.define
class Replayed:
    lag_s: float = 0.0  # how late it was sent against its (scaled) recorded offset
    ttft: float = 0.0
    itl: list[float] = attrs.Factory(list)
    latency: float = 0.0
    prompt_len: int = 0
    output_len: int = 0
    token_ids: list[int] = attrs.Factory(list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def load_recorded(path: Path) -> list[Recorded]:
    """The log's requests in arrival order, with the tokens each was given."""
    _, records, _ = read_log(path)
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    reasons: dict[str, str] = {}
    for rec in records:
        if isinstance(rec, StepFinished):
            for rid, new in rec.sampled:
                tokens[rid].extend(new)
        elif isinstance(rec, RequestFinished):
            reasons[rec.request_id] = rec.reason
    added = sorted((r for r in records if isinstance(r, RequestAdded)), key=_arrival)
    if not added:
        raise FileNotFoundError(f"{path}: the log records no requests")
    start = added[0].arrival_time
    return [
        Recorded(
            a.request_id,
            a.arrival_time - start,
            list(a.prompt_token_ids),
            dict(a.params),
            tokens[a.request_id],
            reasons.get(a.request_id),
        )
        for a in added
    ]


def _arrival(rec: RequestAdded) -> float:
    return rec.arrival_time


async def replay(
    address: str, recorded: list[Recorded], speed: float, timeout: float
) -> tuple[list[Replayed], float]:
    """Send every request at its recorded offset / speed; results in log order, wall time."""
    client = AsyncClient(address, timeout=timeout)
    try:
        start = time.perf_counter()
        tasks = []
        for rec in recorded:
            due = start + rec.offset_s / speed
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            lag = time.perf_counter() - due
            tasks.append(asyncio.create_task(_one(client, rec, lag)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    finally:
        await client.close()
    return list(results), duration


async def _one(client: AsyncClient, rec: Recorded, lag: float) -> Replayed:
    out = Replayed(lag_s=lag)
    start = last = time.perf_counter()
    try:
        stream = await client.generate(rec.prompt_token_ids, stream=True, **rec.params)
        async for _ in stream:  # type: ignore[union-attr]
            now = time.perf_counter()
            if out.ttft == 0.0:
                out.ttft = now - start
            else:
                out.itl.append(now - last)
            last = now
        done = stream.result  # type: ignore[union-attr]
        assert done is not None
        out.latency = time.perf_counter() - start
        out.prompt_len, out.output_len = done.usage.prompt_tokens, done.usage.completion_tokens
        out.token_ids = list(done.token_ids)
    except (ServerError, TimeoutError) as exc:
        out.error = str(exc)
    return out


def summary(recorded: list[Recorded], results: list[Replayed], duration: float) -> dict:
    """Pacing error, identical completions and the replayed latencies (milliseconds)."""
    finished = [(r, x) for r, x in zip(recorded, results, strict=True) if r.finish_reason]
    comparable = [(r, x) for r, x in finished if r.finish_reason != "abort" and x.ok]
    lags = np.asarray([x.lag_s for x in results]) * 1000
    done = [x for x in results if x.ok]
    out_tokens = sum(x.output_len for x in done)
    data: dict[str, Any] = {
        "requests": len(results),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "mean_lag_ms": float(lags.mean()),
        "max_lag_ms": float(lags.max()),
        "compared": len(comparable),
        "identical": sum(r.token_ids == x.token_ids for r, x in comparable),
        "recorded_output_tokens": sum(len(r.token_ids) for r in recorded),
        "replayed_output_tokens": out_tokens,
    }
    for name, values in (("ttft", [x.ttft for x in done]), ("e2el", [x.latency for x in done])):
        ms = np.asarray(values or [0.0]) * 1000
        data[f"median_{name}_ms"] = float(np.median(ms))
        data[f"p99_{name}_ms"] = float(np.percentile(ms, 99))
    return data


def report(data: dict, path: Path, speed: float) -> str:
    rows = [
        ("Log", str(path)),
        ("Speed", f"{speed:g}x"),
        ("Requests (failed)", f"{data['requests']} ({data['failed']})"),
        ("Send lag mean / max (ms)", f"{data['mean_lag_ms']:.2f} / {data['max_lag_ms']:.2f}"),
        ("Identical completions", f"{data['identical']} of {data['compared']} compared"),
        (
            "Output tokens recorded / replayed",
            f"{data['recorded_output_tokens']} / {data['replayed_output_tokens']}",
        ),
        ("Output token throughput (tok/s)", f"{data['output_throughput']:.2f}"),
        ("Median / P99 TTFT (ms)", f"{data['median_ttft_ms']:.2f} / {data['p99_ttft_ms']:.2f}"),
        ("Median / P99 E2EL (ms)", f"{data['median_e2el_ms']:.2f} / {data['p99_e2el_ms']:.2f}"),
        ("Recorded latencies", "not in the log (it records steps, not end times)"),
    ]
    lines = ["{s:{c}^60}".format(s=" Traffic Replay Result ", c="=")]
    lines += [f"{label + ':':<36}{value}" for label, value in rows]
    return "\n".join([*lines, "=" * 60])
