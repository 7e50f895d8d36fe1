"""The core process holds the engine through a narrow surface: every attribute it reaches
through the engine (`self.engine.x`, `engine.x`) is counted over its modules, and the count
stays at or under `MAX_NAMES`.  A server that reaches past the surface (into the engine's
scheduler, block manager or executor) adds a name, and a planted one fails the check."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the modules of the core process's loop, its parts, and what it hands the engine to
CORE_PROCESS = [
    "serving/core_process.py",
    "serving/core_admission.py",
    "serving/core_answers.py",
    "serving/core_replies.py",
    "serving/reattach.py",
]
MAX_NAMES = 10
# the engine's parts: a front that reaches one of these reads past the snapshot
PARTS = {"scheduler", "blocks", "executor", "executor_factory", "requests", "book", "sinks"}


def engine_names(source: str) -> set[str]:
    """Every attribute reached through an engine: `self.engine.x` or a name `engine`'s `x`."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (
            isinstance(base, ast.Name)
            and base.id == "engine"
            or isinstance(base, ast.Attribute)
            and base.attr == "engine"
        ):
            names.add(node.attr)
    return names


def surface(paths: list[str], root: Path = ROOT) -> set[str]:
    return set().union(*(engine_names((root / p).read_text()) for p in paths))


def problems(names: set[str]) -> list[str]:
    found = [f"the core process reaches the engine's {n}" for n in sorted(names & PARTS)]
    if len(names) > MAX_NAMES:
        found.append(f"{len(names)} names reached through the engine (at most {MAX_NAMES})")
    return found


def test_the_core_process_reaches_the_engine_through_few_names():
    names = surface(CORE_PROCESS)
    assert problems(names) == [], sorted(names)
    assert {"add", "abort", "launch", "finish", "snapshot"} <= names  # the walk finds them


def test_a_server_reaching_into_the_scheduler_is_caught(tmp_path):
    for rel in CORE_PROCESS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text())
    breach = "\n\ndef waiting(self):\n    return len(self.engine.scheduler.waiting)\n"
    server = tmp_path / CORE_PROCESS[0]
    server.write_text(server.read_text() + breach)
    found = problems(surface(CORE_PROCESS, tmp_path))
    assert "the core process reaches the engine's scheduler" in found
    aliased = "engine = self.engine\nengine.blocks.num_used\n"
    assert engine_names(aliased) == {"blocks"}
    many = {f"name_{i}" for i in range(MAX_NAMES + 1)}
    assert problems(many) == [f"{MAX_NAMES + 1} names reached through the engine (at most 10)"]
