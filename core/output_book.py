"""A request's output bookkeeping: each step's sampled tokens appended until a stop condition,
the text they add (detokenised), stop strings cut, and the `RequestOutput` a step hands back.

The engine calls `OutputBook.advance` once a step with the executor's per-request results; every
running request passes here every step, so it calls little.  Finishing a request (its pages, its
record) stays the engine's: the book calls `finish` back.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from memstep.core import request_log
from memstep.core.config import EngineConfig
from memstep.core.draft_length import adapt
from memstep.core.outputs import RequestOutput
from memstep.core.request import Request
from memstep.core.sampling_params import SamplingParams
from memstep.core.scheduler import StepBatch
from memstep.events.plan import SeqResult
from memstep.events.types import DraftLengthChanged

log = structlog.get_logger("memstep.engine")

Finish = Callable[[Request, str], None]


class OutputBook:
    """Moves requests on by what the executor computed and sampled; `emit` records, `finish`
    ends a request (the engine's `_finish`)."""

    def __init__(
        self,
        cfg: EngineConfig,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        emit: Callable[[object], None],
        finish: Finish,
    ):
        self.cfg = cfg
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.emit = emit
        self.finish = finish
        self.num_failed = 0  # requests the executor could not go on with (`fail`)

    def advance(
        self, step: int, batch: StepBatch, results: list[SeqResult]
    ) -> tuple[list[RequestOutput], list[list], list[Request]]:
        """Move each scheduled request on by the tokens it computed and sampled: this step's
        outputs, the record of sampled tokens, and the requests with a block newly full of
        computed KV.  Every running request passes here every step, so it calls little."""
        by_id = {r.request_id: r for r in results}
        bs = self.cfg.block_size
        adapts_k = batch.kind == "spec" and self.cfg.speculative_adaptive_k
        outputs: list[RequestOutput] = []
        sampled: list[list] = []
        filled: list[Request] = []
        for s in batch.seqs:
            req = s.request
            res = by_id.get(req.request_id)
            # full blocks of computed KV (drafts past a stop are not tokens); the prefix cache
            # holds them all once a step is done, so only a step that fills one offers it more
            # (a running request's blocks fill one in `block_size` steps)
            num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
            computed = req.num_computed
            full_before = min(computed, num_tokens) // bs
            computed += s.num_tokens
            if res is None:
                req.num_computed = computed
            else:
                req.num_computed = computed = computed + len(res.token_ids) - 1
                req.num_proposed += res.num_proposed
                req.num_accepted += res.num_accepted
                if adapts_k:
                    self._adapt_k(step, req, res)
                out = self.append(step, req, res.token_ids, res.logprobs)
                sampled.append([req.request_id, out.new_token_ids])
                outputs.append(out)
                num_tokens += len(out.new_token_ids)
            if min(computed, num_tokens) // bs > full_before:
                filled.append(req)
        return outputs, sampled, filled

    def _adapt_k(self, step: int, req: Request, res: SeqResult) -> None:
        old = req.draft_length or self.cfg.num_speculative_tokens
        new = adapt(req, res.num_proposed, res.num_accepted, self.cfg.num_speculative_tokens)
        if new is not None:
            self.emit(DraftLengthChanged(step, req.request_id, old, new))

    def append(
        self, step: int, req: Request, tokens: list[int], logprobs: list[list]
    ) -> RequestOutput:
        """Append sampled tokens one by one until a stop condition; the output of this step."""
        p = req.params
        out_ids = req.output_token_ids
        old_len = len(req.detok.text) if p.stop else 0
        reason = None
        num_new = 0
        eos = () if p.ignore_eos else self.eos_token_ids
        # max_tokens, or the context: prompt + output reaching max_model_len
        limit = min(p.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        for tok in tokens:
            out_ids.append(tok)
            num_new += 1
            if tok in eos or tok in p.stop_token_ids:
                reason = "stop"
            elif len(out_ids) >= limit:
                reason = "length"
            if reason:
                break
        if len(out_ids) == num_new:
            request_log.first_token(step, req)
        if num_new < len(tokens):
            tokens, logprobs = tokens[:num_new], logprobs[:num_new]
        if logprobs:
            req.output_logprobs.extend(logprobs)
        text = req.detok.extend(out_ids, final=reason is not None)
        if p.stop and reason in (None, "length") and len(out_ids) >= p.min_tokens:
            end = stop_end(req.detok.text, p, old_len)
            if end is not None:
                text, reason = req.detok.text[old_len:end], "stop"
        out = RequestOutput(req.request_id, tokens, text, logprobs=logprobs)
        if p.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            out.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        if reason:
            self.finish(req, reason)
            out.finished, out.finish_reason = True, reason
            out.prompt_tokens = req.num_prompt_tokens
            out.cached_tokens = req.num_cached_tokens
            out.completion_tokens = len(req.output_token_ids)
            out.num_proposed, out.num_accepted = req.num_proposed, req.num_accepted
        return out

    def fail(self, step: int, req: Request, why: str) -> RequestOutput:
        """End a request the executor cannot go on with (StepResult.failed: a grammar the engine
        cannot enforce), with finish reason "error": never text outside its constraint."""
        log.warning("request failed", step=step, request_id=req.request_id, reason=why)
        self.num_failed += 1
        self.finish(req, "error")
        return RequestOutput(
            req.request_id,
            [],
            "",
            finished=True,
            finish_reason="error",
            error=why,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=len(req.output_token_ids),
        )


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, int] | None:
    """Where the first stop string that ends past `start` (the text's length before this step)
    begins and ends (the longest of those that begin there): one that ended by then was matched
    then, or not at all (before `min_tokens`)."""
    begin = max(0, start - max(len(s) for s in stops) + 1)
    hits = [(i, -len(s)) for s in stops if (i := text.find(s, begin)) >= 0]
    if not hits:
        return None
    at, minus = min(hits)
    return at, at - minus


def stop_end(text: str, params: SamplingParams, start: int) -> int | None:
    """Where the output `text` ends at the first of `params.stop` that ends past `start`: before
    it, or after it with `include_stop_str_in_output`; None where none does."""
    cut = _find_stop(text, params.stop, start)
    if cut is None:
        return None
    return cut[1] if params.include_stop_str_in_output else cut[0]
