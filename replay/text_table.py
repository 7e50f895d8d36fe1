"""Plain-text tables and byte counts for people reading a terminal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: int, signed: bool = False) -> str:
    """`812.34 MiB`; with `signed`, `+1.50 KiB` / `-3 B` / `0 B`."""
    sign = ("+" if n > 0 else "-" if n < 0 else "") if signed else ("-" if n < 0 else "")
    size, unit = float(abs(n)), 0
    while size >= 1024 and unit < len(_UNITS) - 1:
        size, unit = size / 1024, unit + 1
    number = f"{int(size)}" if unit == 0 else f"{size:.2f}"
    return f"{sign}{number} {_UNITS[unit]}"


def render(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1, indent: str = "  "
) -> str:
    """Columns padded to their widest cell: the first `left` columns left-aligned, the rest
    right-aligned (numbers and byte counts)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(row: Sequence[str]) -> str:
        pairs = enumerate(zip(row, widths, strict=True))
        padded = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in pairs]
        return (indent + "  ".join(padded)).rstrip()

    rules = ["-" * w for w in widths]
    return "\n".join([line(headers), line(rules), *(line(row) for row in cells)])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
