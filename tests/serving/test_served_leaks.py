"""A clean served session as users run one, through the HTTP front of a real `memstep serve`
with SmolLM2 (its executor a process of its own): bursts of 16, long prompts, echo with
logprobs, 54 requests.  No leak report: `memstep:leak_reports_total` stays 0, and `memstep
inspect` of the session's log says so (a step up of resident memory under a burst is a
high-water mark, not a leak)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from memstep.cli.serve import ServerProcess

LONG = " ".join(f"line {i}: the keeper counted the waves on the old stones." for i in range(60))


def bodies() -> list[list[dict]]:
    """Three bursts of 16 short prompts, two long prompts, and echo with logprobs."""
    short = [{"prompt": f"Story {i}: once upon a time", "max_tokens": 24} for i in range(48)]
    long = [{"prompt": LONG + f" ({i})", "max_tokens": 4} for i in range(2)]
    echo = [
        {"prompt": f"The capital of France {i} is", "max_tokens": 4, "echo": True, "logprobs": 2}
        for i in range(4)
    ]
    return [short[:16], long + echo[:2], short[16:32], echo[2:], short[32:]]


async def send(url: str) -> int:
    sent = 0
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for burst in bodies():
            replies = await asyncio.gather(*[client.post("/v1/completions", json=b) for b in burst])
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            sent += len(replies)
    return sent


def leak_reports(url: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "memstep:leak_reports_total":
                return sample.value
    raise AssertionError("no memstep:leak_reports_total in /metrics")


@pytest.fixture(scope="module")
def session():
    args = ["--model", "smollm2", "--dtype", "float32", "--max-num-seqs", "16"]
    with ServerProcess(args, http=True) as proc:
        proc.wait_ready(timeout=300)
        sent = asyncio.run(send(proc.http_url))
        reports = leak_reports(proc.http_url)
        proc.stop()
        log = next(proc.dir.glob("events*.memlog"))
        cmd = [sys.executable, "-m", "memstep.cli.main", "inspect", str(log)]
        inspected = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        summary = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300)
        yield sent, reports, inspected, json.loads(summary.stdout)


def test_a_clean_served_session_reports_no_leak(session):
    sent, reports, inspected, summary = session
    assert sent >= 50
    # long enough to be judged: the host watch's 3 warm-up windows and 3 more of 8 steps
    assert summary["num_steps"] >= 48, summary["num_steps"]
    assert summary["leaks"] == []
    assert reports == 0
    assert inspected.returncode == 0, inspected.stderr
    assert "leak reports: none" in inspected.stdout, inspected.stdout
