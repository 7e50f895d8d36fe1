"""Whether a text is a z85 CURVE key: shared by `serve` (reading keys) and the command line
(a key beginning with "-" is a flag's value, not a flag)."""

from __future__ import annotations

from zmq.utils import z85


def is_z85_key(text: str) -> bool:
    if len(text) != 40:
        return False
    try:
        return len(z85.decode(text)) == 32
    except (ValueError, KeyError, TypeError):
        return False
