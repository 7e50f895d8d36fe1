"""Structured outputs in the executor: each constrained request's grammar matcher, and the
token bitmask the sampler applies.

A matcher's state is never kept for its own sake: `Guide.mask_into` brings it to the request's
output tokens before each mask (rolling back what the tokens no longer hold, feeding what they
gained), so replay, executor recovery, resume and preemption by recompute, which rebuild a
request's tokens, rebuild its matcher too, and a speculative step's drafts are fed and rolled
back like any other tokens.  `GrammarBook` compiles each distinct grammar once, against the
model's tokenizer, and hands each request a copy.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

import attrs
import torch

from memstep.core.grammar import TextCache, grammar_of
from memstep.core.grammar_tokenizer import ll_tokenizer
from memstep.core.model_source import ModelSource


def mask_words(vocab_size: int) -> int:
    """32-bit words of one row's bitmask (bit t of word t // 32 allows token t)."""
    return (vocab_size + 31) // 32


class Guide:
    """One request's matcher and the output tokens it has consumed (`fed`)."""

    def __init__(self, matcher: Any, eos: int, stand_in: int | None = None):
        self.matcher = matcher
        self.fed: list[int] = []
        self.eos = eos
        self.stand_in = stand_in  # the grammar's end where the model's is not in its vocabulary
        self.ahead: tuple[int, Any] | None = None  # (output length, its mask): `masks_ahead`
        # why the grammar engine cannot enforce the constraint (its parser's error), or "":
        # the request ends with an error (`RunningRequest.failure`), never with text outside it
        self.failure = ""

    def sync(self, output: list[int]) -> bool:
        """Bring the matcher to `output`; False where a token of it breaks the grammar (a
        draft the grammar refuses: rows past it sample nothing that is kept), or where the
        grammar engine failed on it (`failure`)."""
        try:
            return self._sync(output)
        except BaseException as exc:  # pyo3's PanicException is a BaseException
            self.fail(exc)
            return False

    def fail(self, exc: BaseException) -> None:
        """Keep a failure of the grammar engine on this request as its `failure`; what is not
        the engine's (an interrupt, an exit) goes on up."""
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise exc
        self.failure = self.failure or f"the grammar engine failed: {_first_line(str(exc))}"

    def _sync(self, output: list[int]) -> bool:
        fed, m = self.fed, self.matcher
        keep = _common_prefix(fed, output)
        if keep < len(fed) and not m.rollback(len(fed) - keep):
            m.reset()  # cannot roll back that far: rebuild from the tokens
            keep = _feed(m, output[:keep])
        del fed[keep:]
        took = _feed(m, output[keep:])
        fed.extend(output[keep : keep + took])
        self.note_failure()
        return keep + took == len(output)

    def note_failure(self) -> None:
        """Keep the matcher's error, if it has one: a refused draft leaves none, llguidance's
        parser past its limits (a row of Earley items past 2,000) does."""
        if not self.failure and self.matcher.is_error():
            self.failure = _first_line(self.matcher.get_error())

    def mask_into(self, output: list[int], words: Any) -> None:
        """The mask of the token after `output` into `words` (int32 [mask_words] on the CPU).

        A grammar at a dead end (no token allowed, the end of sequence included) allows the end
        of sequence, so the request finishes ("stop") instead of sampling from nothing."""
        if not self.sync(output):
            words.fill_(-1)  # a refused draft's later rows: any mask, the row is rejected
            return
        try:
            self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        except BaseException as exc:
            self.fail(exc)
        self.note_failure()
        self.open_dead_end(words)

    def take_ahead(self, output: list[int]) -> Any | None:
        """The mask `masks_ahead` made for `output`, once; None where none was made, or it was
        made for other tokens (a preemption's recompute, a rejected draft, a step it missed)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[0] != len(output) or self.fed != output:
            return None
        return ahead[1]

    def open_dead_end(self, words: Any) -> None:
        """A mask that allows nothing allows the end of sequence (`mask_into`); one that allows
        the grammar's stand-in end (`grammar_ends`) allows the model's in its place."""
        end = self.stand_in
        if end is not None and bool(words[end // 32] & _bit(end % 32)):
            words[end // 32] &= ~_bit(end % 32)
            words[self.eos // 32] |= _bit(self.eos % 32)
        if not bool(words.any()):
            words[self.eos // 32] = _bit(self.eos % 32)


def masks_into(
    guided: list[tuple[Guide, list[int], int]], words: Any, threads: int | None = None
) -> None:
    """Each guide's mask of the token after its output into its row of `words` ([R, W] int32
    on the host), the matchers run at once on `threads` of llguidance's own (`mask_pool`: no
    GIL; None its default); row by row (`Guide.mask_into`) with `threads` 0, or where a guide
    serves several rows, as a speculative step's drafts do (a matcher is at one state at a
    time)."""
    if threads == 0 or len({id(guide) for guide, _, _ in guided}) < len(guided):
        for guide, output, i in guided:
            guide.mask_into(output, words[i])
        return
    ready = []
    for guide, output, i in guided:
        if guide.sync(output):
            ready.append((guide, i))
        else:
            words[i].fill_(-1)  # a refused draft's later rows: any mask, the row is rejected
    pairs = [(guide.matcher, i) for guide, i in ready]
    try:
        if pairs:  # (llguidance refuses an empty batch)
            pool = mask_pool(threads)
            pool.unsafe_compute_mask_ptr(pairs, words.data_ptr(), words.shape[1] * 4, len(words))
    except BaseException as exc:  # which matcher failed is not said: each finds out alone
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        for guide, i in ready:
            guide.mask_into(guide.fed, words[i])
        return
    for guide, i in ready:
        guide.note_failure()
        guide.open_dead_end(words[i])


def masks_ahead(pending: list[tuple[Guide, list[int]]], words: int, threads: int | None) -> None:
    """Each guide's mask of the token after its `output`, kept on the guide (`Guide.ahead`) for
    the step that will need it: run on a thread of its own (`Sampler.mask_ahead`) between a step
    and the next, while the core plans that one."""
    block = torch.full((len(pending), words), -1, dtype=torch.int32)
    masks_into([(guide, output, i) for i, (guide, output) in enumerate(pending)], block, threads)
    for (guide, output), row in zip(pending, block, strict=True):
        guide.ahead = (len(output), row)


@functools.cache
def mask_pool(threads: int | None = None) -> Any:
    """llguidance's thread pool for a batch of masks (None: its default, most of the cores)."""
    from llguidance import LLExecutor

    return LLExecutor(threads)


def _bit(i: int) -> int:
    """Bit i of an int32 word, as a signed value."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0][:300] if error.strip() else "grammar engine error"


def _common_prefix(a: list[int], b: list[int]) -> int:
    if a == b[: len(a)]:
        return len(a)
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _feed(matcher: Any, tokens: list[int]) -> int:
    return matcher.try_consume_tokens(tokens) if tokens else 0


@attrs.define
class CompileStats:
    compiled: int = 0
    hits: int = 0
    compile_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        total = self.compiled + self.hits
        return self.hits / total if total else 0.0


MATCHER_CACHE_BYTES = 256 * 1024 * 1024  # the compiled matchers kept, estimated (`matcher_bytes`)
# a compiled matcher's host bytes per byte of its grammar's text: SmolLM2's matchers measured
# 43 to 73 times their grammar, rounded up
MATCHER_BYTES_PER_GRAMMAR_BYTE = 96
MATCHER_BASE_BYTES = 16 * 1024


def matcher_bytes(grammar: str) -> int:
    """A compiled matcher's host bytes, estimated from its grammar's text (llguidance does not
    say): what the matcher cache's budget counts."""
    return MATCHER_BASE_BYTES + MATCHER_BYTES_PER_GRAMMAR_BYTE * len(grammar)


class GrammarUnavailable(RuntimeError):
    """The grammar engine cannot run for this model (its tokenizer); a constrained request
    ends with the reason."""


class GrammarBook:
    """The grammar engine's view of the model's tokenizer (built at the first constrained
    request: about a second for a 49k vocabulary) and a compiled matcher per distinct
    constraint, copied for each request (`guide`); the matchers kept are the most recently
    used within `budget_bytes` (`matcher_bytes` each), so that distinct schemas, one after
    another, never grow the executor past it."""

    def __init__(
        self,
        source: ModelSource,
        vocab_size: int,
        eos: tuple[int, ...],
        budget_bytes: int = MATCHER_CACHE_BYTES,
    ):
        self.source = source
        self.vocab_size = vocab_size
        self.eos = eos
        self._tokenizer: Any = None
        self._building: threading.Thread | None = None  # `prepare`
        self._unusable: str | None = None  # why the tokenizer could not be built
        self._lock = threading.Lock()
        self._compiled: TextCache[Any] = TextCache(budget_bytes)
        self.stats = CompileStats()

    @property
    def num_bytes(self) -> int:
        """The kept matchers' estimated bytes (within the budget)."""
        return self._compiled.num_bytes

    @property
    def budget_bytes(self) -> int:
        return self._compiled.budget_bytes

    def guide(self, constraint: tuple[str, str]) -> Guide:
        template = self._compiled.get(constraint)
        if template is None:
            template = self._compile(constraint)
        else:
            self.stats.hits += 1
        end = self.tokenizer().eos_token
        stand_in = None if end in self.eos else end
        return Guide(template.deep_copy(), self.eos[0] if self.eos else 0, stand_in)

    def _compile(self, constraint: tuple[str, str]) -> Any:
        from llguidance import LLMatcher

        tokenizer = self.tokenizer()  # built once, not counted as a grammar's compile time
        start = time.perf_counter()
        grammar = grammar_of(*constraint)
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():  # the core checked it compiles: only a broken engine gets here
            raise RuntimeError(f"grammar does not compile: {matcher.get_error()}")
        self.stats.compiled += 1
        self.stats.compile_seconds += time.perf_counter() - start
        self._compiled.put(constraint, matcher, matcher_bytes(grammar))
        return matcher

    def prepare(self) -> None:
        """Build the grammar engine's tokenizer on a thread of its own, while the executor
        loads and warms up: made at the first constrained request instead, it held the step
        thread about a second (SmolLM2's), every stream with it."""
        self._building = threading.Thread(target=self.wait, name="grammar-tokenizer")
        self._building.start()

    def wait(self) -> None:
        """The tokenizer built (or found unusable: a model whose tokenizer llguidance cannot
        read still serves, and only its constrained requests fail, each with the reason)."""
        with contextlib.suppress(GrammarUnavailable):
            self.tokenizer()

    def tokenizer(self) -> Any:
        building = self._building
        if building is not None and building is not threading.current_thread():
            building.join()
            self._building = None
        with self._lock:
            if self._tokenizer is None and self._unusable is None:
                try:
                    self._tokenizer = ll_tokenizer(self.source, self.vocab_size, self.eos)
                except ValueError as exc:  # llguidance's word on a tokenizer it cannot read
                    self._unusable = f"the model's tokenizer cannot drive constraints: {exc}"
            if self._unusable is not None:
                raise GrammarUnavailable(self._unusable)
        return self._tokenizer
