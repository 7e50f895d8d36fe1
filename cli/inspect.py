"""Summarize an event log: requests, steps per kind, transitions, acceptance, memory, leaks;
or follow one request through it (`--request ID`), or rank its slowest requests (`--requests`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

from memstep.cli import router_log
from memstep.cli.request_report import life_report, slowest_report
from memstep.replay.recording import Recording, load
from memstep.replay.summary import LogSummary, summarize
from memstep.replay.text_table import fmt_bytes, render
from memstep.router.replay import is_router_log

MAX_STRETCHES = 20  # the text table shows the first ones; --json has them all


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", help="the event log (its rotated parts LOG.1, LOG.2, ... are read too)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--request",
        metavar="ID",
        help="one request's life, step by step (its engine id, client id, HTTP id or X-Request-Id)",
    )
    which.add_argument(
        "--requests",
        nargs="?",
        type=int,
        const=10,
        metavar="N",
        help="the N slowest requests by TTFT, TPOT and queue time (default 10)",
    )


def run(args: argparse.Namespace) -> int:
    if is_router_log(args.log):  # serve --data-parallel-size: the router's own log
        return router_log.inspect(args)
    recording = load(args.log)
    if recording.is_corrupt:
        print(f"memstep: warning: {recording.describe_problem()}", file=sys.stderr)
    report = _request_report(recording, args)
    if report is not None:
        print(json.dumps(report, indent=2) if args.json else report)
        return 0
    summary = summarize(recording.records)
    if args.json:
        print(json.dumps(to_json(recording, summary), indent=2))
    else:
        print(to_text(recording, summary))
    return 0


def _request_report(recording: Recording, args: argparse.Namespace) -> dict | str | None:
    if getattr(args, "request", None) is not None:
        return life_report(recording, args.request, args.json)
    if getattr(args, "requests", None) is not None:
        return slowest_report(recording, args.requests, args.json)
    return None


def to_json(recording: Recording, summary: LogSummary) -> dict[str, Any]:
    log = {
        "path": str(recording.path),
        "header": recording.header,
        "num_records": len(recording.records),
        "problem": recording.describe_problem(),
        "corrupt": recording.is_corrupt,
        "num_bytes_lost": sum(p.num_bytes for p in recording.problems),
    }
    return {"log": log, **summary.to_dict()}


def _resumed_from(link: dict) -> str:
    """The header entry of a log written by `serve --resume`: the dead server's log."""
    return (
        f"resumed  from {link.get('path')} (up to step {link.get('last_step')}, "
        f"{link.get('num_unfinished')} unfinished requests re-admitted)"
    )


def to_text(recording: Recording, s: LogSummary) -> str:
    h = recording.header
    problem = recording.describe_problem()
    sections = [
        "\n".join(
            [
                f"log      {recording.path} ({len(recording.records)} records, format "
                f"{h.get('format_version')}, memstep {h.get('memstep_version')}, "
                f"created {h.get('created')})",
                f"model    {recording.model_identity}",
                f"config   {recording.highlights()}",
                *([_resumed_from(h["resumed_from"])] if "resumed_from" in h else []),
                *([f"! {problem}"] if problem else []),
            ]
        ),
        _requests(s),
        _steps(s),
        _adaptive(s),
        _transitions(s),
        _ledger(s),
        _memory(s),
        _prefix_cache(s),
        _leaks(s),
        _recoveries(s),
    ]
    return "\n\n".join(sections)


def _requests(s: LogSummary) -> str:
    r = s.requests
    head = (
        f"requests: {r.num_added} added, {r.num_finished} finished, {r.num_unfinished} unfinished; "
        f"{r.prompt_tokens} prompt tokens, {r.completion_tokens} completion tokens"
    )
    if not r.reasons:
        return head
    return head + "\n" + render(["finish reason", "requests"], list(r.reasons.items()))


def _steps(s: LogSummary) -> str:
    rate = f"{s.acceptance_rate:.3f}" if s.acceptance_rate is not None else "-"
    head = (
        f"steps: {s.num_steps}; speculative acceptance: {s.num_accepted} of {s.num_proposed} "
        f"drafts accepted ({rate})"
    )
    rows = [
        [
            kind,
            k.num_steps,
            k.num_tokens,
            k.num_sampled,
            k.num_proposed,
            k.num_accepted,
            k.num_accepted / k.num_proposed if k.num_proposed else None,
        ]
        for kind, k in s.kinds.items()
    ]
    headers = ["kind", "steps", "tokens fed", "tokens sampled", "proposed", "accepted", "rate"]
    return head + ("\n" + render(headers, rows) if rows else "")


def _adaptive(s: LogSummary) -> str:
    """The engine's own speculation decisions, and the requests it sent back to recompute."""
    changes = ", ".join(
        f"step {step} -> {'none' if t is None else f'below {t}'}" for step, t in s.spec_thresholds
    )
    k = s.draft_lengths
    evicted = ", ".join(f"{n} by {cause}" for cause, n in sorted(s.evictions.items()))
    return "\n".join(
        [
            f"speculation threshold changes: {changes or 'none'}",
            f"draft length changes: {k['dropped']} dropped, {k['raised']} raised",
            f"requests sent back to recompute: {evicted or 'none'}",
        ]
    )


def _transitions(s: LogSummary) -> str:
    pairs: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in s.transitions:
        totals = pairs[(t.source, t.target)]
        totals[0] += 1
        totals[1] += t.bytes_released
        totals[2] += t.bytes_claimed
    head = f"transitions: {len(s.transitions)}"
    if s.transitions:
        last = s.transitions[-1]
        head += f" (first at step {s.transitions[0].step}, last at step {last.step})"
    rows = [[a, b, n, fmt_bytes(rel), fmt_bytes(cl)] for (a, b), (n, rel, cl) in pairs.items()]
    headers = ["from", "to", "count", "released (sum)", "claimed (sum)"]
    return head + ("\n" + render(headers, rows, left=2) if rows else "")


def _ledger(s: LogSummary) -> str:
    """Each kind's claims and releases in exact bytes.  A kind entered more often than exited
    (the log ends in it, or its executor was lost in it) is "not exited"; any other difference
    is an exit that did not give back what its entries took."""
    unbalanced = [
        kind for kind, k in s.ledger.items() if not k.is_balanced and k.num_exits >= k.num_entries
    ]
    head = "ledger: every kind released to the byte what it claimed"
    if unbalanced:
        head = f"ledger: NOT BALANCED for {', '.join(unbalanced)}"
    rows = [
        [
            kind,
            k.num_entries,
            k.num_exits,
            f"{k.claimed:,}",
            f"{k.released:,}",
            f"{k.claimed - k.released:+,}" if k.num_exits >= k.num_entries else "not exited",
        ]
        for kind, k in s.ledger.items()
    ]
    headers = ["kind", "entries", "exits", "claimed (B)", "released (B)", "claimed - released"]
    return head + ("\n" + render(headers, rows) if rows else "")


def _memory(s: LogSummary) -> str:
    head = (
        f"memory: peak live {fmt_bytes(s.peak_live_bytes)}, final live "
        f"{fmt_bytes(s.final_live_bytes)}, peak reserved {fmt_bytes(s.peak_reserved_bytes)}, "
        f"peak arena claimed {fmt_bytes(s.peak_arena_claimed_bytes)}, "
        f"peak KV pages {s.peak_kv_pages_used}"
    )
    for process, rss in s.host_rss.items():
        head += (
            f"\nhost RSS {process}: {fmt_bytes(rss.first)} after the first step, peak "
            f"{fmt_bytes(rss.peak)}, final {fmt_bytes(rss.final)} "
            f"({fmt_bytes(rss.final - rss.first, signed=True)})"
        )
    if not s.stretches:
        return head
    kinds = [
        [
            kind,
            k.num_stretches,
            k.num_steps,
            fmt_bytes(k.growth, signed=True),
            fmt_bytes(k.max_growth, signed=True),
        ]
        for kind, k in s.kinds.items()
    ]
    shown = s.stretches[:MAX_STRETCHES]
    stretches = [
        [
            st.kind,
            st.first_step,
            st.last_step,
            st.num_steps,
            fmt_bytes(st.live_start),
            fmt_bytes(st.live_end),
            fmt_bytes(st.growth, signed=True),
        ]
        for st in shown
    ]
    more = len(s.stretches) - len(shown)
    return "\n".join(
        [
            head,
            "memory growth per kind (live bytes, within stretches of one kind):",
            render(["kind", "stretches", "steps", "growth", "largest"], kinds),
            f"stretches of one kind{_more(len(shown), more)}:",
            render(
                ["kind", "from step", "to step", "steps", "live at start", "live at end", "growth"],
                stretches,
            ),
        ]
    )


def _prefix_cache(s: LogSummary) -> str:
    r = s.requests
    rate = f"{r.prefix_hit_rate:.3f}" if r.prefix_hit_rate is not None else "-"
    return (
        f"prefix cache: hit rate {rate} ({r.cached_tokens} of {r.prompt_tokens} prompt tokens of "
        f"finished requests reused), {s.num_prefix_hits} admissions with a hit; cached pages "
        f"(held by no request) peak {s.peak_kv_pages_cached}, final {s.final_kv_pages_cached}"
    )


def _more(shown: int, more: int) -> str:
    return f" (first {shown}; {more} more in --json)" if more else ""


def _leaks(s: LogSummary) -> str:
    lines = [f"leak reports: {len(s.leaks) or 'none'}"]
    lines += [
        f"  step {x.step} {x.kind} {x.what} {fmt_bytes(x.nbytes)}: {x.detail}" for x in s.leaks
    ]
    if s.high_water:  # information: a figure rose once (a new shape of work) and stayed
        lines.append(f"high-water marks (not leaks): {len(s.high_water)}")
        lines += [f"  step {x.step} {x.what}: {x.detail}" for x in s.high_water]
    return "\n".join(lines)


def _recoveries(s: LogSummary) -> str:
    if not s.losses:
        return "executor losses: none"
    lines = [f"executor losses: {len(s.losses)}, recoveries: {len(s.recoveries)}"]
    for x in s.losses:
        end = "; gave up, every request failed" if x.gave_up else ""
        lines.append(f"  step {x.step} lost during {x.during}: {x.reason}{end}")
    rows = [
        [r.step, r.num_readmitted, r.tokens_to_recompute, r.num_starts, f"{r.seconds:.2f}"]
        for r in s.recoveries
    ]
    headers = ["recovered at step", "requests re-admitted", "tokens recomputed", "starts", "s"]
    return "\n".join(lines) + ("\n" + render(headers, rows, left=2) if rows else "")
