"""`inspect --request ID` and `inspect --requests`: one request's life, the slowest requests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from memstep.cli.errors import UsageError
from memstep.events.types import RequestPreempted
from memstep.replay.recording import Recording
from memstep.replay.request_view import (
    RequestLife,
    RequestTimes,
    UnknownRequestId,
    request_life,
    slowest,
)
from memstep.replay.text_table import fmt_bytes, render

Decode = Callable[[list[int]], str]


def life_report(recording: Recording, request_id: str, as_json: bool) -> dict | str:
    try:
        recorded = recording.format_version >= RequestPreempted.SINCE_FORMAT
        life = request_life(recording.records, request_id, records_preemptions=recorded)
    except UnknownRequestId as exc:
        raise UsageError(str(exc)) from None
    text = _decoder(recording)(life.output_token_ids)
    if as_json:
        data = attrs.asdict(life, recurse=True)
        data["text"], data["first_token_step"] = text, life.first_token_step
        return data
    return "\n\n".join([_head(life), _events(life), _steps(life), _cache(life), _out(life, text)])


def _decoder(recording: Recording) -> Decode:
    """The log's model's tokenizer, or token ids shown as such when it cannot be loaded."""
    try:
        from memstep.core.model_source import model_config, resolve
        from memstep.core.tokenizer import load_tokenizer

        cfg = recording.config
        source = resolve(cfg["model"], cfg.get("random_weights_seed", 0), cfg.get("tokenizer"))
        mc = model_config(source)
        return load_tokenizer(source, mc.vocab_size, mc.eos_token_ids).decode
    except Exception as exc:  # a model file gone since the run: the ids still tell the story
        why = str(exc)
        return lambda ids: f"(text unavailable: {why})"


def _head(life: RequestLife) -> str:
    names = ", ".join(life.client_ids) or "none"
    finish = f"finished at step {life.finish[0]}: {life.finish[1]}" if life.finish else "unfinished"
    lines = [
        f"request {life.engine_id} (client id: {names})",
        f"arrived at step {life.arrival_step}; {finish}; {len(life.prompt_token_ids)} prompt "
        f"tokens, {len(life.output_token_ids)} completion tokens, "
        f"max_tokens {life.params.max_tokens}, seed {life.params.seed}",
    ]
    if life.timed is not None:
        t = life.timed
        lines.append(f"timings: TTFT {_s(t.ttft_s)}, queue {_s(t.queue_s)}, E2E {_s(t.e2e_s)}")
    return "\n".join(lines)


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.4f} s"


def _events(life: RequestLife) -> str:
    lines = [
        f"  step {step:>6}  {what}{': ' if detail else ''}{detail}"
        for step, what, detail in life.events
    ]
    return "life:\n" + "\n".join(lines)


def _steps(life: RequestLife) -> str:
    rows = [
        [
            r.step,
            r.kind,
            r.batch_size,
            r.step_tokens,
            r.fed,
            len(r.sampled),
            fmt_bytes(r.live_bytes),
            r.kv_pages_used,
            r.note,
        ]
        for r in life.rows
    ]
    headers = ["step", "kind", "batch", "step tokens", "fed", "sampled", "live", "KV pages", ""]
    return f"steps that ran it: {len(rows)}\n" + render(headers, rows, left=2)


def _cache(life: RequestLife) -> str:
    if not life.hits:
        return "prefix cache: no hit"
    lines = [f"  step {step}: {n} tokens from pages {pages}" for step, n, pages in life.hits]
    shared = ", ".join(life.shared_with) or "none"
    return "prefix cache:\n" + "\n".join(lines) + f"\n  pages reused by other requests: {shared}"


def _out(life: RequestLife, text: str) -> str:
    return f"tokens: {life.output_token_ids}\ntext: {text!r}"


def slowest_report(recording: Recording, top: int, as_json: bool) -> dict | str:
    ranked = slowest(recording.records, top)
    if as_json:
        return {k: [attrs.asdict(t) for t in v] for k, v in ranked.items()}
    parts = [_ranking(title, ranked[field]) for field, title in TITLES.items()]
    return "\n\n".join(parts)


TITLES = {"ttft": "time to first token", "tpot": "time per output token", "queue": "queue time"}


def _ranking(title: str, times: list[RequestTimes]) -> str:
    if not times:
        return f"slowest by {title}: none recorded"
    rows: list[list[Any]] = [
        [t.client_id, t.engine_id, _fig(t.ttft), _fig(t.tpot), _fig(t.queue), t.completion_tokens]
        for t in times
    ]
    headers = ["request", "engine id", "TTFT", "TPOT", "queue", "tokens"]
    return f"slowest by {title} ({times[0].unit}):\n" + render(headers, rows, left=2)


def _fig(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
