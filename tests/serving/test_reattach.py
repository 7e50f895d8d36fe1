"""What a reconnecting client may ask of a carried request, and the text its tail continues with
(a byte-level decoder, so that one character can span tokens)."""

from __future__ import annotations

import attrs
import pytest

from memstep.core.engine import UnknownRequest
from memstep.core.sampling_params import InvalidRequest, SamplingParams
from memstep.events.wire import AttachRequest
from memstep.replay.resume import Carried
from memstep.serving.reattach import Detached, Reattach, _finished_text, released_text

WORD = list("hé!".encode())  # [104, 195, 169, 33]: "é" is two tokens


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def _held(finish_reason: str | None) -> Reattach:
    reattach = Reattach()
    reattach.held["c1"] = Detached("req-1", 3, list(WORD), "hé!", finish_reason)
    return reattach


def test_a_tail_continues_the_text_the_client_was_shown():
    held = Detached("req-1", 3, list(WORD), "hé!", "stop")
    assert released_text(decode, WORD[:2]) == "h", "half a character is held back"
    assert held.tail(2, decode) == ([169, 33], "é!")
    assert held.tail(1, decode) == ([195, 169, 33], "é!")
    assert held.tail(0, decode) == (WORD, "hé!")
    assert held.tail(4, decode) == ([], "")


def test_with_fixed_bytes_a_tail_follows_the_byte_detokenizer_s_rule():
    """A byte no later byte can complete (0xff) was shown by the stream as U+FFFD: the tail
    does not give it again (the decoder's rule, holding back any text ending in U+FFFD, did)."""
    table = [bytes([i]) for i in range(256)]
    ids = [104, 255, 33]
    held = Detached("req-1", 3, ids, "h\ufffd!", "stop")
    assert released_text(decode, ids[:2], table) == "h\ufffd"
    assert held.tail(2, decode, table) == ([33], "!")
    assert released_text(decode, WORD[:2], table) == "h", "half a character is held back"
    assert held.tail(2, decode) == ([33], "\ufffd!"), "the decoder's rule, for a decoder"


def test_a_finished_carried_request_s_text_is_cut_where_the_engine_cut_it():
    """As the engine: before the first stop string, after it with include_stop_str_in_output,
    and none matched before min_tokens tokens (the first check reads past their first 3)."""
    ids = list(b"ab. cd. ef")

    def carried(**params) -> Carried:
        sp = SamplingParams(stop=(".",), max_tokens=16, seed=1, **params)
        return Carried("req-1", [1], sp, ids, 0.0, "c1", "stop")

    assert _finished_text(decode, carried()) == "ab"
    assert _finished_text(decode, carried(include_stop_str_in_output=True)) == "ab."
    assert _finished_text(decode, carried(min_tokens=4)) == "ab. cd"
    assert _finished_text(decode, attrs.evolve(carried(), finish_reason="length")) == "ab. cd. ef"


def test_attach_refuses_what_it_cannot_serve():
    with pytest.raises(UnknownRequest):
        _held(None).take(AttachRequest("c2"))
    with pytest.raises(InvalidRequest, match="from_index -1"):
        _held(None).take(AttachRequest("c1", from_index=-1))
    with pytest.raises(InvalidRequest, match="from_index 5"):
        _held("stop").take(AttachRequest("c1", from_index=5))
    ahead = _held(None).take(AttachRequest("c1", from_index=5))  # running: it waits
    assert ahead.engine_id == "req-1"
    reattach = _held(None)
    reattach.take(AttachRequest("c1"))
    with pytest.raises(UnknownRequest):
        reattach.take(AttachRequest("c1"))  # handed to one client only
    reattach = _held(None)
    reattach.ambiguous.add("c1")
    with pytest.raises(InvalidRequest, match="two unfinished requests"):
        reattach.take(AttachRequest("c1"))
