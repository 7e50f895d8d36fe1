"""Structured logs follow the process's stderr as it is when a line is written."""

from __future__ import annotations

import io
import json
import sys

import structlog

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
