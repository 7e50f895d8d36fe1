"""The docs hold together: every relative link between README.md and docs/ reaches a file (and
a heading, where it names one), and every `memstep COMMAND --flag` they show exists in that
command's parser. Measurements live in docs/benchmarks.md: no docstring of the code carries a
dated entry, and a benchmark's docstring stays short. Each check is also run on a planted
mistake, to prove it fires."""

from __future__ import annotations

import argparse
import ast
import functools
import re
from pathlib import Path

import pytest

from memstep.cli.main import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`([^`]+)`")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MAX_BENCHMARK_DOC_LINES = 30
COMMAND = re.compile(r"(?:^|[\s/])memstep((?:\s+--?[\w-]+(?:[ =][\w.-]+)?)*)\s+([\w-]+)(.*)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_and_code(text: str) -> tuple[list[str], list[str]]:
    """The page's lines outside fenced code, and its code: each fenced line (a line ending in
    a backslash joined to the next) and each inline code span."""
    prose: list[str] = []
    code: list[str] = []
    fenced = False
    for line in text.replace("\\\n", " ").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif fenced:
            code.append(line)
        else:
            prose.append(line)
            code.extend(INLINE_CODE.findall(line))
    return prose, code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces
    as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose, _ = prose_and_code(page.read_text())
    found: set[str] = set()
    for line in prose:
        if m := re.match(r"#{1,6}\s+(.*)", line):
            name = slug(m.group(1))
            n = 0
            while (unique := name if n == 0 else f"{name}-{n}") in found:
                n += 1
            found.add(unique)
    return found


def broken_links(page: Path) -> list[str]:
    """Relative links of `page` (outside code) whose file or heading does not exist."""
    prose, _ = prose_and_code(page.read_text())
    broken = []
    for line in prose:
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    return broken


@functools.cache
def command_parser(words: tuple[str, ...]) -> argparse.ArgumentParser:
    """The parser of `memstep WORDS...`: a command, then sub-commands as far as they go."""
    parser = build_parser(words[0])
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def words_and_flags(rest: str) -> tuple[list[str], list[str]]:
    """From what follows a command's name: its sub-commands (leading plain words that name
    one) are decided by the caller; here, the leading words and every `--flag` named."""
    rest = rest.split("#", 1)[0]
    leading = re.match(r"((?:\s+[a-z][\w-]*)*)", rest).group(1).split()  # type: ignore[union-attr]
    flags = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest)
    return leading, flags


def unknown_flags(page: Path) -> list[str]:
    """Each `memstep COMMAND ... --flag` in the page's code whose parser lacks the flag."""
    _, code = prose_and_code(page.read_text())
    unknown = []
    for line in code:
        for m in COMMAND.finditer(line):
            global_flags, command, rest = m.groups()
            if command not in COMMANDS:
                continue
            words = [command]
            leading, flags = words_and_flags(rest)
            for word in leading:
                parser = command_parser(tuple(words))
                sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
                if not sub or word not in sub[0].choices:
                    break
                words.append(word)
            known = command_parser(tuple(words))._option_string_actions
            flags += re.findall(r"--[\w-]+", global_flags)
            unknown += [
                f"{page.name}: memstep {' '.join(words)} {f}" for f in flags if f not in known
            ]
    return unknown


def docstrings(path: Path) -> list[str]:
    """The module's, classes' and functions' docstrings of a Python file."""
    tree = ast.parse(path.read_text(), str(path))
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [
        d
        for node in ast.walk(tree)
        if isinstance(node, kinds)
        if (d := ast.get_docstring(node, clean=False))
    ]


def dated_docstrings(paths: list[Path]) -> list[str]:
    return [f"{p.name}: {m}" for p in paths for d in docstrings(p) for m in DATE.findall(d)]


def long_module_docstrings(paths: list[Path]) -> list[str]:
    return [
        f"{p.name}: {n} lines"
        for p in paths
        if (n := len((ast.get_docstring(ast.parse(p.read_text())) or "").splitlines()))
        > MAX_BENCHMARK_DOC_LINES
    ]


def code_files() -> list[Path]:
    """The package's, the benchmarks' and the tests' Python files (not a virtualenv's)."""
    folders = [d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith((".", "build"))]
    return [ROOT / "__init__.py", *(p for d in folders for p in d.rglob("*.py"))]


def test_no_docstring_carries_a_dated_measurement():
    assert dated_docstrings(code_files()) == []


def test_every_benchmark_docstring_stays_short():
    assert long_module_docstrings(sorted((ROOT / "benchmarks").glob("*.py"))) == []


def test_a_planted_dated_entry_and_a_long_benchmark_docstring_are_caught(tmp_path):
    bench = tmp_path / "bench_x.py"
    body = "\n".join(f"line {i}" for i in range(MAX_BENCHMARK_DOC_LINES))
    bench.write_text(
        f'"""What it does.\n{body}\n"""\n\n\ndef f():\n    """Took 3 ms (2026-12-02)."""\n'
    )
    assert long_module_docstrings([bench]) == [f"bench_x.py: {MAX_BENCHMARK_DOC_LINES + 1} lines"]
    assert dated_docstrings([bench]) == ["bench_x.py: 2026-12-02"]


def test_every_link_between_the_pages_reaches_a_file_and_heading():
    assert [b for page in pages() for b in broken_links(page)] == []


def test_every_flag_a_page_shows_exists():
    assert [u for page in pages() for u in unknown_flags(page)] == []


def test_the_readme_shows_the_quick_start_and_stays_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 180
    for shown in (
        "make run",
        "memstep serve",
        "curl ",
        "from openai import",
        "from memstep import LLM",
    ):
        assert shown in text, shown
    assert "memstep replay" in text


def test_a_planted_broken_link_and_a_missing_heading_are_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Real heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [other](other.md), [real](other.md#real-heading), [self](#page),\n"
        "[gone](missing.md), [no heading](other.md#no-such-heading) and [web](https://x.org).\n"
        "```\n[in code](not-checked.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#no-such-heading (no such heading)",
    ]


def test_a_planted_unknown_flag_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Run `memstep serve --port 0 --no-such-flag` and `memstep --log-format json replay X`.\n"
        "```\nmemstep bench serve --request-rate 4 --not-a-bench-flag \\\n  --num-prompts 3\n"
        "memstep replay LOG --set k=v  # --comment-flag is not a flag\n```\n"
    )
    assert unknown_flags(page) == [
        "page.md: memstep serve --no-such-flag",
        "page.md: memstep bench serve --not-a-bench-flag",
    ]


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Recovery and resume", "recovery-and-resume"),
        ("Mixed steps (`bench_mixed.py`)", "mixed-steps-bench_mixedpy"),
    ],
)
def test_anchors_follow_githubs_rule(heading, anchor):
    assert slug(heading) == anchor
