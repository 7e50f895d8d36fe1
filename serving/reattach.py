"""The requests a resumed server (`serve --resume LOG`) carries over from the server that died.

`Reattach.adopt` re-admits the log's unfinished requests into the new engine and keeps each
request that a client named (`RequestNamed`), finished or not, until that client sends an
`AttachRequest`: it gets the output from the index it names, then the rest as it is produced.
Until then a carried request runs with no one listening and its output is kept here.  A client
may know more tokens than the damaged log kept; its attach then waits until the engine has
recomputed that far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import structlog

from memstep.core.detokenizer import ByteText
from memstep.core.engine import Engine, UnknownRequest
from memstep.core.output_book import stop_end
from memstep.core.outputs import RequestOutput
from memstep.core.sampling_params import InvalidRequest
from memstep.core.snapshot import Admitted
from memstep.events.wire import AttachRequest
from memstep.replay.resume import Carried, ResumePoint

log = structlog.get_logger("memstep.server.reattach")


@attrs.define
class Detached:
    """A carried request no client has attached to: what it has produced so far."""

    engine_id: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # None while the engine still runs it
    waiting: tuple[list[bytes], AttachRequest] | None = None  # an attach ahead of the tokens

    @property
    def can_hand_over(self) -> bool:
        assert self.waiting is not None
        return self.finish_reason is not None or len(self.token_ids) >= self.waiting[1].from_index

    def tail(
        self,
        start: int,
        decode: Callable[[list[int]], str],
        token_bytes: Sequence[bytes] | None = None,
    ) -> tuple[list[int], str]:
        """Tokens from `start` on, and the text they add to what the first `start` give."""
        shown = released_text(decode, self.token_ids[:start], token_bytes)
        text = self.text[len(shown) :] if self.text.startswith(shown) else self.text
        return self.token_ids[start:], text


class Reattach:
    """Carried requests by the client's id (until attached) and by engine id (while running)."""

    def __init__(self) -> None:
        self.held: dict[str, Detached] = {}  # by client id
        self.running: dict[str, Detached] = {}  # by engine id: unfinished, fed by `deliver`
        self.ambiguous: set[str] = set()  # client ids two carried requests share

    def adopt(self, engine: Engine, point: ResumePoint) -> None:
        """Re-admit the unfinished requests of `point` into `engine`; hold the named ones."""
        for req in point.requests:
            admitted = None if req.is_finished else self._readmit(engine, req)
            if req.client_id is None or admitted is None and not req.is_finished:
                continue
            if req.client_id in self.held:
                self.ambiguous.add(req.client_id)
            if admitted is None:
                held = self._finished(engine, req)
            else:
                held = self.running[req.request_id] = Detached(
                    req.request_id,
                    len(admitted.prompt_token_ids),
                    admitted.output_token_ids,
                    admitted.text,
                    None,
                )
            self.held[req.client_id] = held
        log.info("resumed", readmitted=len(self.running), attachable=len(self.held))

    def take(self, msg: AttachRequest) -> Detached:
        """The request a client attaches to, no longer held for anyone else."""
        if msg.request_id in self.ambiguous:
            raise InvalidRequest(f"two unfinished requests were named {msg.request_id!r}")
        held = self.held.get(msg.request_id)
        if held is None:
            raise UnknownRequest(f"no carried request named {msg.request_id!r}")
        if msg.from_index < 0 or held.finish_reason and msg.from_index > len(held.token_ids):
            raise InvalidRequest(f"from_index {msg.from_index} is outside the output")
        return self.held.pop(msg.request_id)

    def release(self, held: Detached) -> None:
        """The server answers it from now on."""
        self.running.pop(held.engine_id, None)

    def deliver(self, out: RequestOutput) -> Detached | None:
        """Keep the output of a carried request; the request if an attach waited for it."""
        held = self.running.get(out.request_id)
        if held is None:
            return None
        held.token_ids.extend(out.new_token_ids)
        held.text += out.new_text
        if out.finished:
            held.finish_reason = out.finish_reason or "stop"
            self.running.pop(out.request_id)
        return held if held.waiting is not None and held.can_hand_over else None

    def _readmit(self, engine: Engine, req: Carried) -> Admitted | None:
        """Queue an unfinished request again, named by its client's id if it had one."""
        try:
            return engine.add(
                req.prompt_token_ids,
                req.params,
                client_id=req.client_id,
                arrival_time=req.arrival_time,
                request_id=req.request_id,
                output_token_ids=req.output_token_ids,
            )
        except InvalidRequest as exc:
            log.warning("not resumed", request_id=req.request_id, reason=str(exc))
            return None

    def _finished(self, engine: Engine, req: Carried) -> Detached:
        text = _finished_text(engine.tokenizer.decode, req)
        ids = list(req.output_token_ids)
        return Detached(req.request_id, len(req.prompt_token_ids), ids, text, req.finish_reason)


def released_text(
    decode: Callable[[list[int]], str], ids: list[int], token_bytes: Sequence[bytes] | None = None
) -> str:
    """The text a stream of `ids` has shown, by the engine's own rule (core/detokenizer.py):
    with fixed bytes an id (`token_bytes`), all but the start of a character that a later byte
    may complete; else up to the last token that does not end inside a character."""
    if token_bytes is not None:
        return ByteText(token_bytes).extend(ids)
    num = len(ids)
    while num and decode(ids[:num]).endswith("\ufffd"):
        num -= 1
    return decode(ids[:num]) if num else ""


def _finished_text(decode: Callable[[list[int]], str], req: Carried) -> str:
    """A finished request's text: its tokens read, cut at a stop string as the engine cut it
    (`stop_end`: none is matched before `min_tokens` tokens, the first check's text being
    the tokens' before it)."""
    ids = req.output_token_ids
    text = decode(ids)
    params = req.params
    if not params.stop or req.finish_reason != "stop":
        return text
    start = len(decode(ids[: params.min_tokens - 1])) if params.min_tokens > 1 else 0
    end = stop_end(text, params, start)
    return text if end is None else text[:end]
