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
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=False,
    )


class _Stderr:
    """Whatever `sys.stderr` is when a line is written, not when logging was set up: a stream
    swapped afterwards (a test's capture, closed when the test ends; a redirect) is followed."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()
