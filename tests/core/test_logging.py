"""Structured logs follow the process's stderr as it is when a line is written, and write each
line whole."""

from __future__ import annotations

import io
import json
import sys

import structlog

from memstep.core import logging as memstep_logging
from memstep.core.logging import setup_logging


def test_logs_after_the_stream_of_set_up_time_is_closed_reach_the_current_stderr(monkeypatch):
    """Set up while stderr was a stream that is later closed (a test's capture, say), a line
    still goes to the stderr of its time: with the stream fixed at set-up, it fails with
    "I/O operation on closed file" (which, in a test run, broke every later test that logged)."""
    first, second = io.StringIO(), io.StringIO()
    before = structlog.get_config()
    try:
        monkeypatch.setattr(sys, "stderr", first)
        setup_logging("json")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        structlog.get_logger().info("after", n=1)
    finally:
        structlog.configure(**before)
    line = json.loads(second.getvalue())
    assert line["event"] == "after" and line["n"] == 1 and line["level"] == "info"


class Writes(io.StringIO):
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def _writes_of_one_line(monkeypatch) -> list[str]:
    stream = Writes()
    before = structlog.get_config()
    try:
        monkeypatch.setattr(sys, "stderr", stream)
        setup_logging("json")
        structlog.get_logger().info("request arrived", request_id="r-1")
    finally:
        structlog.configure(**before)
    return stream.writes


def test_a_line_and_its_newline_go_out_in_one_write(monkeypatch):
    """The core and its HTTP front share one stderr; a line written in two parts (text, then
    newline, as `print` does) let the other process's line in between, and a served run's JSON
    log once read two objects on one line. With print's logger the same check fails."""
    (write,) = _writes_of_one_line(monkeypatch)
    assert write.endswith("\n") and json.loads(write)["request_id"] == "r-1"
    monkeypatch.setattr(
        memstep_logging, "_stderr_logger", lambda *_: structlog.PrintLogger(sys.stderr)
    )
    assert len(_writes_of_one_line(monkeypatch)) == 2  # the text, then its newline


def test_a_high_water_mark_is_information_and_a_leak_a_warning():
    """A clean session's high-water marks (a figure rose once with a new shape of work and
    stayed) are logged at info, not as "leak suspected" warnings, which a user reads as an
    alarm; a leak stays a warning."""
    from memstep.core.step_records import log_leak
    from memstep.events.types import LeakSuspected

    mark = LeakSuspected(399, "no_spec", "high_water", 3 << 20, "rose once and stayed")
    leak = LeakSuspected(31, "no_spec", "live_growth", 9 << 20, "grows 1 MiB a step")
    before = structlog.get_config()
    try:  # every level kept, whatever an earlier test in this process set up (an LLM: warning)
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(0))
        with structlog.testing.capture_logs() as lines:
            log_leak(mark)
            log_leak(leak)
    finally:
        structlog.configure(**before)
    assert [(x["log_level"], x["event"], x["what"]) for x in lines] == [
        ("info", "memory high-water mark", "high_water"),
        ("warning", "leak suspected", "live_growth"),
    ]
