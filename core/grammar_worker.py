"""A grammar check worker's process (`python -m memstep.core.grammar_worker [MODEL]`): it builds
the model's tokenizer for the grammar engine first (MODEL: core/grammar.py's TokenizerSpec as
JSON; none: checks without a tokenizer), says it is ready, then answers each check with
core/grammar.py's `compile_error` (core/grammar_check.py speaks to it)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from memstep.core.grammar import TokenizerSpec, compile_error
from memstep.core.grammar_check import check_worker
from memstep.core.grammar_tokenizer import ll_tokenizer
from memstep.core.model_source import resolve


def build_tokenizer(spec: TokenizerSpec) -> Any:
    """The grammar engine's tokenizer of the model `spec` names (what the executor builds)."""
    source = resolve(spec.model, spec.weights_seed, spec.tokenizer)
    return ll_tokenizer(source, spec.vocab_size, spec.eos)


def worker_check(argv: list[str]) -> Callable[[str, str], str]:
    """The check a worker runs: against the model's tokenizer where `argv` names one."""
    if not argv:
        return compile_error
    tokenizer = build_tokenizer(TokenizerSpec(**json.loads(argv[0])))
    return lambda kind, text: compile_error(kind, text, tokenizer)


if __name__ == "__main__":
    check_worker(sys.stdin.buffer, sys.stdout.buffer, worker_check(sys.argv[1:]))
