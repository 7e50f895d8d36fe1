"""The one table of legal moves between engine phases and serving step kinds.

Phases run boot -> profile -> warmup -> capture -> serve; `warmup` and `capture` are kinds with
buffers and hooks of their own (`startup.py`), and during serve every step is a kind (`spec`,
`no_spec`).  `serve` itself is not a state: entering serve means entering the kind of
the first serving step.  Any state may go to `shutdown`, and any serving kind to `recover`.
"""

from __future__ import annotations

PHASES = ("boot", "profile", "warmup", "capture", "shutdown", "recover")
SERVING_KINDS = ("no_spec", "spec")

TRANSITIONS: frozenset[tuple[str, str]] = frozenset(
    {
        ("boot", "profile"),
        ("profile", "warmup"),
        ("warmup", "capture"),
        ("capture", "no_spec"),
        ("capture", "spec"),
        ("no_spec", "spec"),
        ("spec", "no_spec"),
        ("no_spec", "no_spec"),
        ("spec", "spec"),
        ("no_spec", "recover"),
        ("spec", "recover"),
        ("recover", "no_spec"),
        ("recover", "spec"),
    }
    | {(state, "shutdown") for state in ("boot", "profile", "warmup", "capture", *SERVING_KINDS)}
)


class TransitionNotAllowed(RuntimeError):
    def __init__(self, source: str, target: str):
        super().__init__(f"Can't go to {target!r} when in {source!r}")
        self.source = source
        self.target = target


def check(source: str, target: str) -> None:
    if (source, target) not in TRANSITIONS:
        raise TransitionNotAllowed(source, target)
