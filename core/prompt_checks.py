"""What makes a prompt runnable: checked by the engine as a request comes in, by the server
before a tokenize reply, and by the CLI before the model loads."""

from __future__ import annotations

from memstep.core.grammar import grammar_error
from memstep.core.sampling_params import InvalidRequest, SamplingParams


def check_prompt(ids: list[int], params: SamplingParams, vocab: int, max_len: int) -> None:
    """InvalidRequest for a prompt the engine cannot run: empty, ids outside the vocabulary (its
    own, its logit_bias's or stop_token_ids'), or longer (with its max_tokens) than the context.
    The CLI calls it before the model loads."""
    if not ids:
        raise InvalidRequest("prompt is empty")
    bad = outside_vocabulary(ids, vocab)
    if bad is not None:
        raise InvalidRequest(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
    if len(ids) >= max_len:
        raise InvalidRequest(f"prompt has {len(ids)} tokens; this model's context is {max_len}")
    named = [*(t for t, _ in params.logit_bias), *params.stop_token_ids]
    outside = outside_vocabulary(named, vocab)
    if outside is not None:
        raise InvalidRequest(
            f"token id {outside} of logit_bias or stop_token_ids is outside the vocabulary "
            f"[0, {vocab})"
        )
    if len(ids) + params.max_tokens > max_len:
        raise InvalidRequest(
            f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the context "
            f"of {max_len} tokens"
        )


def check_constraint(params: SamplingParams) -> None:
    """InvalidRequest for a constraint the grammar engine cannot run: it does not compile, or
    its compile crashed or outran its budget in a check worker (core/grammar_check.py).  The
    server starts the check ahead (`Server._generate`), so that it waits here for nothing."""
    if params.constraint is None:
        return
    error = grammar_error(*params.constraint)
    if error:
        name = "guided_" + params.constraint[0]
        raise InvalidRequest(f"{name} does not compile: {error}")


def outside_vocabulary(ids: list, vocab: int) -> object | None:
    """The first of `ids` that is not a token id of a vocabulary of `vocab`, or None."""
    if not ids or set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < vocab:
        return None  # at C speed, the common case
    return next((t for t in ids if not _is_token(t, vocab)), None)


def _is_token(t: object, vocab: int) -> bool:
    return isinstance(t, int) and 0 <= t < vocab
