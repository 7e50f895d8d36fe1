"""Structured logs: readable console lines for people, JSON lines for machines."""

from __future__ import annotations

import logging
import sys

import structlog


def setup_logging(fmt: str = "console", level: str = "info") -> None:
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )


def _stderr_logger(*_args: object) -> structlog.WriteLogger:
    """A logger to `sys.stderr` as it is now (loggers are not cached: one is made per line): a
    stream swapped after set-up (a test's capture, closed when the test ends) is followed.

    Each line goes out in one write, its newline with it: processes sharing one stderr (the core
    and its HTTP front) then never join two lines into one (`print` writes the newline apart, and
    another process's line could come between)."""
    return structlog.WriteLogger(sys.stderr)
