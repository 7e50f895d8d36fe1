"""`bench serve --dataset RUN.memlog`: the traffic a `serve` log recorded, sent again to a live
server at its recorded pace (`--speed` scales it), as SGLang's request-dump replay does.

Each request goes out with its recorded prompt tokens and sampling params (seed included) at its
recorded arrival offset, so production traffic recorded under one configuration can be tried
against another.  Reported: how late each request left (the pacing error), whether each seeded
request's completion is the recorded one, and the replayed latencies beside the recorded run's.
Both sides are the server's own measure (seconds since it received the request): the recorded
ones from the log's RequestTimed records, the replayed ones from each reply's Timing; TPOT is
(E2E - TTFT) / (output tokens - 1).  `memstep replay` stays the exact, step-by-step replay.
"""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from tqdm import tqdm

from memstep.api.client import AsyncClient, ServerError
from memstep.events.log import read_log
from memstep.events.types import RequestAdded, RequestFinished, RequestTimed, StepFinished

LATENCIES = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2EL"}


@attrs.frozen
class Recorded:
    """One request of the log: what was sent, when, and what the recorded run answered."""

    request_id: str
    offset_s: float  # arrival, seconds after the log's first request
    prompt_token_ids: list[int]
    params: dict[str, Any]
    token_ids: list[int]
    finish_reason: str | None  # None: still running when the log ended
    timed: RequestTimed | None = None  # the server's latencies; None in a log without them

    @property
    def latencies(self) -> dict[str, float] | None:
        """TTFT, TPOT and E2EL (seconds) as the recording server measured them."""
        t = self.timed
        if t is None or t.ttft_s is None or self.finish_reason in (None, "abort"):
            return None
        return _latencies(t.ttft_s, t.e2e_s, len(self.token_ids))


@attrs.define
class Replayed:
    lag_s: float = 0.0  # how late it was sent against its (scaled) recorded offset
    ttft: float = 0.0  # at the client
    itl: list[float] = attrs.Factory(list)
    latency: float = 0.0
    prompt_len: int = 0
    output_len: int = 0
    token_ids: list[int] = attrs.Factory(list)
    server: dict[str, float] | None = None  # TTFT, TPOT and E2EL as the server measured them
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def _latencies(ttft: float, e2e: float, num_tokens: int) -> dict[str, float]:
    tpot = (e2e - ttft) / (num_tokens - 1) if num_tokens > 1 else float("nan")
    return {"ttft": ttft, "tpot": tpot, "e2el": e2e}


def load_recorded(path: Path) -> list[Recorded]:
    """The log's requests in arrival order, with the tokens each was given."""
    _, records, _ = read_log(path)
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    reasons: dict[str, str] = {}
    timed: dict[str, RequestTimed] = {}
    for rec in records:
        if isinstance(rec, StepFinished):
            for rid, new in rec.sampled:
                tokens[rid].extend(new)
        elif isinstance(rec, RequestFinished):
            reasons[rec.request_id] = rec.reason
        elif isinstance(rec, RequestTimed):
            timed[rec.request_id] = rec
    added = sorted((r for r in records if isinstance(r, RequestAdded)), key=_arrival)
    if not added:
        raise FileNotFoundError(f"{path}: the log records no requests")
    start = added[0].arrival_time
    return [
        Recorded(
            a.request_id,
            a.arrival_time - start,
            list(a.prompt_token_ids),
            a.params.to_dict(),  # the client sends them as a map
            tokens[a.request_id],
            reasons.get(a.request_id),
            timed.get(a.request_id),
        )
        for a in added
    ]


def _arrival(rec: RequestAdded) -> float:
    return rec.arrival_time


async def replay(
    address: str, recorded: list[Recorded], speed: float, timeout: float, quiet: bool = True
) -> tuple[list[Replayed], float]:
    """Send every request at its recorded offset / speed; results in log order, wall time.
    Unless `quiet`, a bar on stderr counts the requests as they finish."""
    client = AsyncClient(address, timeout=timeout)
    bar = tqdm(total=len(recorded), desc="traffic replay", unit="req", disable=quiet)
    try:
        start = time.perf_counter()
        tasks = []
        for rec in recorded:
            due = start + rec.offset_s / speed
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            lag = time.perf_counter() - due
            task = asyncio.create_task(_one(client, rec, lag))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    finally:
        bar.close()
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
        if done.timing.ttft_s is not None:
            out.server = _latencies(done.timing.ttft_s, done.timing.e2e_s, out.output_len)
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
    data["latency"] = compare_latencies(recorded, results)
    return data


def compare_latencies(recorded: list[Recorded], results: list[Replayed]) -> dict[str, Any]:
    """Mean, median and P99 (ms) of TTFT, TPOT and E2EL, recorded and replayed, over the
    requests that finished in both runs; empty when the log holds no latencies."""
    pairs: list[tuple[dict[str, float], dict[str, float]]] = []
    for r, x in zip(recorded, results, strict=True):
        was = r.latencies
        if was is not None and x.server is not None:
            pairs.append((was, x.server))
    if not pairs:
        return {}
    out: dict[str, Any] = {"requests": len(pairs)}
    for name in LATENCIES:
        for side, index in (("recorded", 0), ("replayed", 1)):
            ms = np.asarray([p[index][name] for p in pairs]) * 1000
            ms = ms[~np.isnan(ms)]  # TPOT of one-token requests
            stats = {"mean": ms.mean(), "median": np.median(ms), "p99": np.percentile(ms, 99)}
            out[f"{name}_{side}_ms"] = {k: float(v) for k, v in stats.items()} if ms.size else {}
    return out


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
        ("Client median / P99 TTFT (ms)", _pair(data, "ttft")),
        ("Client median / P99 E2EL (ms)", _pair(data, "e2el")),
    ]
    lines = ["{s:{c}^60}".format(s=" Traffic Replay Result ", c="=")]
    lines += [f"{label + ':':<36}{value}" for label, value in rows]
    return "\n".join([*lines, *latency_table(data["latency"]), "=" * 60])


def _pair(data: dict, name: str) -> str:
    return f"{data[f'median_{name}_ms']:.2f} / {data[f'p99_{name}_ms']:.2f}"


def latency_table(latency: dict[str, Any]) -> list[str]:
    """Recorded and replayed latencies side by side, with their ratio (replayed / recorded)."""
    if not latency:
        return ["Recorded latencies: not in the log (no RequestTimed records: not a serve log)"]
    title = f" Server latency (ms), {latency['requests']} requests "
    lines = ["{s:{c}^60}".format(s=title, c="-")]
    lines.append(f"{'':<24}{'recorded':>12}{'replayed':>12}{'ratio':>12}")
    for name, short in LATENCIES.items():
        rec, rep = latency[f"{name}_recorded_ms"], latency[f"{name}_replayed_ms"]
        for stat in ("mean", "median", "p99"):
            if stat not in rec or stat not in rep:
                continue
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {short}"
            ratio = rep[stat] / rec[stat] if rec[stat] else float("nan")
            lines.append(f"{label:<24}{rec[stat]:>12.2f}{rep[stat]:>12.2f}{ratio:>11.2f}x")
    return lines
