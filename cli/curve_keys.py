"""Whether a text is a z85 CURVE key: shared by `serve` (reading keys) and both command lines
that take keys, `memstep serve` and `python -m memstep.cli.serve` (a key beginning with "-"
is a flag's value, not a flag)."""

from __future__ import annotations

KEY_FLAGS = ("--curve-client-keys", "--curve-secret-key")  # values that may begin with "-"


def is_z85_key(text: str) -> bool:
    if len(text) != 40:
        return False
    from zmq.utils import z85  # here: every command line passes through this module

    try:
        return len(z85.decode(text)) == 32
    except (ValueError, KeyError, TypeError):
        return False


def attach_dashed_keys(argv: list[str]) -> list[str]:
    """A z85 key may begin with "-" (1 in 85 do), which argparse reads as a flag: after a key
    flag, such a value (40-character z85 keys, comma-separated) is attached as `FLAG=VALUE`."""
    if not any(a in KEY_FLAGS for a in argv):
        return argv
    out: list[str] = []
    i = 0
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) else ""
        keys = value.split(",")
        if argv[i] in KEY_FLAGS and value.startswith("-") and all(map(is_z85_key, keys)):
            out.append(f"{argv[i]}={value}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out
