"""The package's import graph: no cycle between files, and no folder imports a folder above it.

Folders stand in floors (`FLOORS`): a file may import its own folder and the floors below.  Every
import counts, also those inside functions or under `TYPE_CHECKING`: a cycle hidden behind a
late import is still a cycle for a reader.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {
    "events": 0,
    "core": 1,
    "states": 2,
    "executors": 3,
    "replay": 4,
    "api": 5,  # what a user imports: LLM, the ZMQ clients
    "serving": 6,  # the core process's loop and the HTTP front process
    "router": 7,  # replicas behind one front: a client of each replica's core
    "train": 8,
    "cli": 9,
    "": 10,  # memstep/__init__.py: the package's front door
}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["memstep", *parts])


def package_files(root: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (tests and benchmarks are not the package)."""
    files = {"memstep": root / "__init__.py"}
    for folder in FLOORS:
        if folder:
            for path in (root / folder).rglob("*.py"):
                files[module_name(root, path)] = path
    return files


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The package modules `path` imports, `from memstep.x import y` resolved to a module y."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: the package, less one part per dot after the first
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    files = package_files(root)
    known = set(files)
    return {name: imports_of(path, name, known) for name, path in files.items()}


def floor_of(module: str) -> int:
    parts = module.split(".")
    return FLOORS[parts[1] if len(parts) > 1 and parts[1] in FLOORS else ""]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{src} -> {dst}"
        for src, dsts in graph.items()
        for dst in dsts
        if floor_of(dst) > floor_of(src)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph(ROOT)) == []


def test_no_folder_imports_a_folder_above_it():
    assert upward_imports(import_graph(ROOT)) == []


# executors/ in rooms (docs/architecture.md): the model knows no device, the two backends know
# nothing of each other, runtime/ assembles nothing (the process room picks CUDA's parts and the
# speculative decoder: executors/process/assemble.py), and only the process room (and the floors
# above executors) may use the process room; every module lives in a room
ROOMS = ("model", "runtime", "cpu", "cuda", "spec", "process")
ROOM_MAY_NOT_IMPORT = {
    "model": {"runtime", "cpu", "cuda", "spec", "process"},
    "cpu": {"cuda", "process"},
    "cuda": {"cpu", "process"},
    "runtime": {"cuda", "spec", "process"},
    "spec": {"process"},
    "process": set(),
}


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "executors" else None


def room_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Imports between executors' rooms that the rooms' rules forbid, and modules outside any
    room."""
    found = []
    for src, dsts in graph.items():
        room = room_of(src)
        if room is None:
            continue
        if room not in ROOMS:
            found.append(f"{src} is in no room")
            continue
        found += [f"{src} -> {dst}" for dst in dsts if room_of(dst) in ROOM_MAY_NOT_IMPORT[room]]
    return sorted(found)


def test_executors_rooms_keep_their_rules():
    assert room_breaches(import_graph(ROOT)) == []
    rooms = {p.parent.name for p in (ROOT / "executors").glob("*/__init__.py")}
    assert rooms == set(ROOMS)


def test_a_room_breach_is_caught(tmp_path):
    _write(
        tmp_path,
        {
            "executors/model/llama.py": "from memstep.executors.cpu.kernels import x\n",
            "executors/cpu/kernels.py": "x = 1\n",
            "executors/cuda/graphs.py": "from memstep.executors.cpu.kernels import x\n",
            "executors/runtime/worker.py": "import memstep.executors.process.main\n",
            # runtime/ assembling an executor from below: a lazy import still counts
            "executors/runtime/plan.py": "def f():\n    import memstep.executors.cuda.graphs\n",
            "executors/runtime/backends.py": "from memstep.executors.spec.decoder import d\n",
            "executors/spec/decoder.py": "d = 3\n",
            "executors/process/main.py": "from memstep.executors.runtime import worker\n",
            "executors/flat.py": "y = 2\n",
        },
    )
    assert room_breaches(import_graph(tmp_path)) == [
        "memstep.executors.cuda.graphs -> memstep.executors.cpu.kernels",
        "memstep.executors.flat is in no room",
        "memstep.executors.model.llama -> memstep.executors.cpu.kernels",
        "memstep.executors.runtime.backends -> memstep.executors.spec.decoder",
        "memstep.executors.runtime.plan -> memstep.executors.cuda.graphs",
        "memstep.executors.runtime.worker -> memstep.executors.process.main",
    ]


def test_every_package_folder_has_a_floor():
    folders = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/__init__.py")}
    assert folders - {"tests"} == set(FLOORS) - {""}


def _write(root: Path, files: dict[str, str]) -> None:
    (root / "__init__.py").write_text("")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)


def test_a_planted_cycle_and_an_upward_import_are_caught(tmp_path):
    _write(
        tmp_path,
        {
            "core/engine.py": "from memstep.core import scheduler\n",
            # a late import inside a function still closes the loop
            "core/scheduler.py": "def f():\n    from memstep.core.engine import x\n",
            "events/codec.py": "import memstep.cli.main\n",
            "cli/main.py": "from memstep.events.codec import y\n",
            "executors/worker.py": "from .kv import z\n",
            "executors/kv.py": "from memstep.core.engine import w\n",
        },
    )
    graph = import_graph(tmp_path)
    assert cycles(graph) == [
        ["memstep.cli.main", "memstep.events.codec"],
        ["memstep.core.engine", "memstep.core.scheduler"],
    ]
    assert upward_imports(graph) == ["memstep.events.codec -> memstep.cli.main"]
    assert graph["memstep.executors.worker"] == {"memstep.executors.kv"}


def documented_floors(text: str) -> dict[str, int]:
    """The room table of docs/architecture.md: `| floor | `room/` | ...` rows, by room."""
    rows = re.findall(r"^\| (\d+) \| `(\w+)/` \|", text, re.MULTILINE)
    return {room: int(floor) for floor, room in rows}


def floor_mismatches(documented: dict[str, int], floors: dict[str, int]) -> list[str]:
    rooms = sorted(set(documented) | {room for room in floors if room})
    return [
        f"{room}: documented {documented.get(room)}, tested {floors.get(room)}"
        for room in rooms
        if documented.get(room) != floors.get(room)
    ]


def test_the_documented_floors_are_the_tested_ones():
    documented = documented_floors((ROOT / "docs" / "architecture.md").read_text())
    assert floor_mismatches(documented, FLOORS) == []


def test_a_documented_floor_that_differs_is_caught():
    table = "| 0 | `events/` | records |\n| 6 | `core/` | the engine |\n"
    assert floor_mismatches(documented_floors(table), {"events": 0, "core": 1, "api": 2}) == [
        "api: documented None, tested 2",
        "core: documented 6, tested 1",
    ]
