"""tools/gpu_plan.sh names the `-m gpu` test files (a device machine lacks `openai`, so collecting
all of tests/ there fails): its two lists together are every file with a gpu mark."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def planned(name: str) -> set[str]:
    text = (ROOT / "tools" / "gpu_plan.sh").read_text()
    match = re.search(rf"^{name}=\(([^)]*)\)", text, re.MULTILINE)
    assert match, f"{name} not in tools/gpu_plan.sh"
    return set(match.group(1).split())


def test_the_gpu_plan_names_every_gpu_test_file_once():
    marked = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", p.read_text()) and p != Path(__file__).resolve()
    }
    free, smol = planned("GPU_FREE"), planned("GPU_SMOL")
    assert not free & smol
    assert free | smol == marked
