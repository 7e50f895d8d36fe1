"""A request's structured-output constraint, as the grammar engine (llguidance) reads it.

A constraint is recorded as the user gave it (a JSON schema, a regex, choices, an EBNF/Lark
grammar, or "any JSON object"), in `SamplingParams`; `grammar_of` turns it into llguidance's
grammar text and `compile_error` checks that text compiles.  Before either, the constraint must
keep the bounds of events/grammar_limits.py (pure Python, no compile).  The core asks
`ConstraintBook.error`, which runs `compile_error` in a worker process
(core/grammar_check.py: a crash or stall of the native engine is that request's 400) and keeps
each verdict, in a cache with a byte budget, so that a request whose grammar cannot compile is
refused at the door with the reason, and the executor compiles only what compiles.  No torch
here: the core checks, the executor (executors/runtime/guide.py) matches.
"""

from __future__ import annotations

import functools
import json
import time
from collections import OrderedDict
from typing import Any, Generic, TypeVar

import attrs

from memstep.core.grammar_check import Check, GrammarChecker
from memstep.events.grammar_limits import check_limits, limits_error

KINDS = ("json", "json_object", "regex", "choice", "grammar")
ANY_OBJECT = '{"type": "object"}'
# compact JSON (no free whitespace): fewer tokens, and a model cannot pad forever with spaces
JSON_OPTIONS = {"whitespace_flexible": False}
VERDICT_CACHE_BYTES = 16 * 1024 * 1024  # the core's verdicts, keyed by the constraint's text
# a compile against the model's tokenizer past this is refused: the executor's step would wait
# as long for it, every stream with it
COMPILE_BUDGET_S = 1.0
OVER_BUDGET = "compile, more than the budget"  # such a verdict depends on the load: not kept

V = TypeVar("V")


class TextCache(Generic[V]):
    """A least-recently-used map from a constraint to a value, bounded by the bytes of its
    keys and values (`size_of`) rather than by a count: a thousand 1 MiB texts never live
    together under a 16 MiB budget."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self.entries: OrderedDict[tuple[str, str], tuple[V, int]] = OrderedDict()

    def get(self, key: tuple[str, str]) -> V | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        return entry[0]

    def put(self, key: tuple[str, str], value: V, value_bytes: int) -> None:
        size = len(key[0]) + len(key[1]) + value_bytes
        old = self.entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old[1]
        if size > self.budget_bytes:
            return
        self.entries[key] = (value, size)
        self.num_bytes += size
        while self.num_bytes > self.budget_bytes:
            _, (_, dropped) = self.entries.popitem(last=False)
            self.num_bytes -= dropped

    def __len__(self) -> int:
        return len(self.entries)


def grammar_of(kind: str, text: str) -> str:
    """llguidance's grammar for a constraint; raises ValueError on a malformed one or one past
    the bounds of events/grammar_limits.py."""
    from llguidance import LLMatcher

    from memstep.core.gbnf import any_to_lark

    check_limits(kind, text)
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        choices = json.loads(text)
        if not choices:
            raise ValueError("guided_choice is empty")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, choices)))
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(any_to_lark(text))
    raise ValueError(f"unknown constraint kind {kind!r}")


@attrs.frozen
class TokenizerSpec:
    """The model whose tokenizer a check worker compiles against (as the executor will), as
    JSON for the worker's command line."""

    model: str
    weights_seed: int
    tokenizer: str | None
    vocab_size: int
    eos: tuple[int, ...] = attrs.field(converter=tuple)

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))


def compile_error(kind: str, text: str, tokenizer: Any = None) -> str:
    """Why the constraint cannot compile, or "" when it can (in this process: what the check
    workers run).  With the model's `tokenizer`, the grammar is compiled as the executor will
    compile it, within COMPILE_BUDGET_S (the executor's step waits for its compile)."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_of(kind, text)
    except (ValueError, TypeError, RecursionError) as exc:
        return str(exc)[:500] or type(exc).__name__
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or tokenizer is None:
        return messages[0][:500] if is_error else ""
    start = time.perf_counter()
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    seconds = time.perf_counter() - start
    if matcher.is_error():
        return matcher.get_error().strip().splitlines()[0][:500]
    if seconds > COMPILE_BUDGET_S:
        return f"took {seconds:.1f} s to {OVER_BUDGET} of {COMPILE_BUDGET_S:g} s"
    return ""


class ConstraintBook:
    """The core's verdicts on constraints: the bounds checked here, the compile in a worker
    process (`checker`), each answer kept (`verdicts`, a byte budget).  `start` begins a check
    without waiting (the server's loop polls it), `error` waits for one."""

    def __init__(self, budget_bytes: int = VERDICT_CACHE_BYTES):
        self.verdicts: TextCache[str] = TextCache(budget_bytes)
        self._checker: GrammarChecker | None = None
        self.num_refused = 0
        self.model: TokenizerSpec | None = None  # None: checked without a tokenizer
        self.running: dict[tuple[str, str], Check] = {}  # one check per constraint at a time

    @property
    def checker(self) -> GrammarChecker:
        if self._checker is None:
            args = [] if self.model is None else [self.model.to_json()]
            self._checker = GrammarChecker(args=args)
        return self._checker

    def use_model(self, model: TokenizerSpec) -> None:
        """Check against `model`'s tokenizer from now on (the engine's): verdicts reached
        against another are dropped, and so are the workers that hold it."""
        if model == self.model:
            return
        self.close()
        self.running = {}
        self.model = model
        self.verdicts = TextCache(self.verdicts.budget_bytes)

    def known(self, kind: str, text: str) -> str | None:
        """The verdict already reached ("" compiles), or None."""
        return self.verdicts.get((kind, text))

    def start(self, kind: str, text: str) -> Check:
        """A check of the constraint; settled at once where the verdict is known or the bounds
        refuse it, else settled by `poll`."""
        verdict = self.known(kind, text)
        if verdict is None:
            verdict = limits_error(kind, text) or None
        if verdict is not None:
            return Check(kind, text, verdict)
        running = self.running.get((kind, text))
        if running is None or running.is_done:
            running = self.running[(kind, text)] = self.checker.submit(kind, text)
        return running

    def poll(self, timeout: float = 0.0) -> None:
        if self._checker is not None:
            self._checker.poll(timeout)

    def keep(self, check: Check) -> str:
        """Keep a settled check's verdict; the verdict."""
        assert check.error is not None
        self.running.pop((check.kind, check.text), None)
        if check.lasting and OVER_BUDGET not in check.error:  # a slow moment is not remembered
            self.verdicts.put((check.kind, check.text), check.error, len(check.error))
        if check.error:
            self.num_refused += 1
        return check.error

    def error(self, kind: str, text: str) -> str:
        """Why the constraint cannot run, or "": waits for its check."""
        check = self.start(kind, text)
        if not check.is_done:
            self.checker.wait(check)
        return self.keep(check)

    def close(self) -> None:
        if self._checker is not None:
            self._checker.close()
            self._checker = None


@functools.cache
def constraint_book() -> ConstraintBook:
    """This process's book (one core per process; its workers start at the first check)."""
    return ConstraintBook()


def grammar_error(kind: str, text: str) -> str:
    """Why the constraint cannot run, or "" when it can (this process's book)."""
    return constraint_book().error(kind, text)
