"""A chat reply split, as it streams, into content and tool-call deltas as OpenAI sends them.

The machinery is shared by every tool-call format (tool_parsers/ beside it); a format says only how
its calls are written (`CallSyntax`): the marker that opens a call or a list of calls, what may
open one with no marker at the very start of a reply (a bare JSON call), how a call's header
reads (`{"name": ..., "arguments": ` or Mistral's `name[ARGS]`), and what follows its arguments.

Content that cannot be part of a call leaves at once; only what could still start one is held
(a partial marker, or, at the very start of a reply, what may open a bare call). A call leaves
as OpenAI streams one: a first delta with its index, id, type, function name and empty
arguments, as soon as the name is known, then the arguments' text in fragments, exactly as the
model writes them.

The non-streamed reply is parsed by the same machine (`split_reply`), so a stream's accumulated
calls equal the whole reply's. A call whose JSON puts its arguments before its name is held to
its end and leaves in one delta; text that looked like a call and is not one leaves as content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import attrs

WHITESPACE = " \t\r\n"
PARTIAL, NO = "partial", "no"  # a header not yet complete, or one that cannot be
ARGUMENT_KEYS = ('"arguments"', '"parameters"')
TEXT, HEADER = "text", "header"  # the modes a tail moves on to

Delta = dict[str, Any]  # {"content": str} or {"tool_calls": [one call's delta]}
Header = tuple[str, int] | str  # (the name, where the arguments' value may begin), PARTIAL, NO
Tail = tuple[int, str] | None  # (characters dropped, the next mode: TEXT or HEADER), None: wait


@attrs.frozen
class CallSyntax:
    """How one format writes its calls: what `CallStream` needs to read them."""

    open: str  # the marker before a call (or a list of calls), anywhere in a reply
    close: str  # the marker after each marked call; "" where there is none
    header: Callable[[str], Header]  # a call's header at the start of the text
    tail: Callable[[str], Tail]  # what follows a marked call's arguments
    # where, in a reply's start (whitespace stripped), a bare call's header begins: an offset,
    # PARTIAL while it may still, NO where it cannot (then only the marker opens a call)
    bare_start: Callable[[str], int | str]
    bare_tail: Callable[[str], Tail]  # what follows a bare call's arguments


class CallStream:
    """One choice's reply in the format `syntax`, fed as it streams (`feed`), then ended
    (`finish`); each returns the deltas to send now, in order."""

    def __init__(self, syntax: CallSyntax) -> None:
        self.syntax = syntax
        self.buf = ""  # text received and not yet given out or dropped
        self.mode = "start"  # start, text, header, arguments, tail
        self.bare = False  # the call being read opened with no marker
        self.num_calls = 0
        self.depth = 0  # the arguments' JSON nesting, while `mode` is "arguments"
        self.in_string = self.escaped = False
        self.begun = False  # the arguments' value has begun
        self.out: list[Delta] = []

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        while self._step():
            pass
        out, self.out = self.out, []
        return _merged(out)

    def finish(self, cut: bool = False) -> list[Delta]:
        """What is left: held text as content (whitespace only where no call was made), a
        call held whole, or the end of a call's arguments cut short (`max_tokens`).  With `cut`
        (a forced call that `max_tokens` cut short) what was held is dropped instead: such a
        reply is the calls whose name was complete, never the call's markup as content."""
        out = self.feed("")
        rest, self.buf = self.buf, ""
        if cut:
            return _merged(out)
        if self.mode == "header" and rest:
            out += self._whole_call_or_text(rest, closed=False)
        elif self.mode in ("start", "text") and rest and (rest.strip() or not self.num_calls):
            out.append({"content": rest})
        return _merged(out)

    def _step(self) -> bool:
        """Move on through `buf` as far as it allows; whether anything moved."""
        if self.mode == "arguments":
            return self._step_arguments()
        if self.mode == "header":
            return self._step_header()
        if self.mode == "tail":
            return self._step_tail()
        return self._step_text()

    def _step_text(self) -> bool:
        buf, opener = self.buf, self.syntax.open
        body = buf.lstrip(WHITESPACE)
        if self.mode == "start" and body:
            found = self.syntax.bare_start(body)
            if found == PARTIAL:
                return False  # maybe a bare call: wait
            if isinstance(found, int):
                return self._open(buf, len(buf) - len(body) + found, bare=True)
        at = buf.find(opener)
        if at >= 0:
            self._content(buf[:at].rstrip(WHITESPACE))
            return self._open(buf, at + len(opener), bare=False)
        keep = _held_suffix(buf, opener)
        sent = self._content(buf[: len(buf) - keep])
        self.buf = buf[sent:]
        return False

    def _content(self, text: str) -> int:
        """Give out `text` as content but its trailing whitespace (it may precede a call); how
        many characters were given."""
        send = text.rstrip(WHITESPACE)
        if send:
            self.out.append({"content": send})
            self.mode = "text"
        return len(send)

    def _open(self, buf: str, at: int, bare: bool) -> bool:
        self.buf, self.mode, self.bare = buf[at:], "header", bare
        return True

    def _step_header(self) -> bool:
        head = self.syntax.header(self.buf)
        if head == PARTIAL:
            return False
        if isinstance(head, str):  # NO
            return self._step_unheaded()
        name, end = head
        self.out.append({"tool_calls": [self._first_delta(name, "")]})
        self.buf, self.mode = self.buf[end:], "arguments"
        self.depth, self.in_string, self.escaped, self.begun = 0, False, False, False
        return True

    def _step_unheaded(self) -> bool:
        """A marked call or bare JSON that does not open as its header should."""
        if self.bare:  # a bare call must open so: this is content
            self.out.append({"content": self.buf})
            self.buf, self.mode = "", "text"
            return False
        close = self.syntax.close
        at = self.buf.find(close) if close else -1
        if at < 0:
            return False  # hold the block to its end (of the reply, where it has no close)
        block, self.buf = self.buf[:at], self.buf[at + len(close) :]
        self.out += self._whole_call_or_text(block, closed=True)
        self.mode = "text"
        return True

    def _whole_call_or_text(self, block: str, closed: bool) -> list[Delta]:
        """A whole call (or a JSON list of them) read at once; else the text as content."""
        data = _json_value(block)
        calls = data if isinstance(data, list) else [data]
        if not calls or not all(_is_call(c) for c in calls):
            text = block if self.bare else self.syntax.open + block
            return [{"content": text + (self.syntax.close if closed else "")}]
        return [
            {"tool_calls": [self._first_delta(c["name"], json.dumps(_arguments_of(c)))]}
            for c in calls
        ]

    def _first_delta(self, name: str, arguments: str) -> dict[str, Any]:
        self.num_calls += 1
        return {
            "index": self.num_calls - 1,
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    def _arguments(self, text: str) -> Delta:
        return {"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": text}}]}

    def _step_arguments(self) -> bool:
        """Give out the arguments' text up to where their JSON value ends."""
        buf = self.buf
        if not self.begun:
            buf = self.buf = buf.lstrip(WHITESPACE)
            if not buf:
                return False
            self.begun = True
        end, ended = self._scan(buf)
        if end:
            self.out.append(self._arguments(buf[:end]))
        self.buf = buf[end:]
        if ended:
            self.mode = "tail"
        return ended

    def _scan(self, buf: str) -> tuple[int, bool]:
        """Characters of `buf` that belong to the arguments' value (all of it, or up to the
        value's end), with the nesting carried over from the last fragment; whether the value
        ended."""
        for i, ch in enumerate(buf):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1, True
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.depth = 0
                    return i + 1, True
            elif self.depth == 0 and ch in ",}" + WHITESPACE:
                return i, True  # a bare number or literal ended
        return len(buf), False

    def _step_tail(self) -> bool:
        """After the arguments: what closes the call (`}`, a close marker), dropped; then
        text, or the next call's header where the format lists calls."""
        tail = (self.syntax.bare_tail if self.bare else self.syntax.tail)(self.buf)
        if tail is None:
            return False
        dropped, self.mode = tail
        self.buf = self.buf[dropped:]
        return True


def split_reply(
    text: str, syntax: CallSyntax, cut: bool = False
) -> tuple[str, list[dict[str, Any]]]:
    """A whole reply's content and OpenAI tool_calls, as a stream of it would accumulate
    (`cut`: a forced call cut short, see `CallStream.finish`)."""
    stream = CallStream(syntax)
    content, calls = [], []
    for delta in [*stream.feed(text), *stream.finish(cut)]:
        if "content" in delta:
            content.append(delta["content"])
            continue
        for part in delta["tool_calls"]:
            if "id" in part:
                calls.append({k: v for k, v in part.items() if k != "index"})
                calls[-1]["function"] = dict(part["function"])
            else:
                calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    return "".join(content), calls


def call_header(text: str) -> Header:
    """`{"name": "<name>", "arguments": ` (or "parameters") at the start of `text`, with any
    whitespace between: (the name, where the value may begin), PARTIAL while `text` may still
    become one, or NO."""
    at = 0
    name = ""
    for part in ("{", '"name"', ":", None, ",", ARGUMENT_KEYS, ":"):
        at = _skip_space(text, at)
        if at == len(text):
            return PARTIAL
        if part is None:
            found = _json_string(text, at)
            if isinstance(found, str):
                return found
            name, at = found
            continue
        options = (part,) if isinstance(part, str) else part
        rest = text[at:]
        hit = next((o for o in options if rest.startswith(o)), None)
        if hit is None:
            return PARTIAL if any(o.startswith(rest) for o in options) else NO
        at += len(hit)
    return name, at


def _json_string(text: str, at: int) -> tuple[str, int] | str:
    """The JSON string that starts at `at`: (its value, where it ends), PARTIAL or NO."""
    if text[at] != '"':
        return NO
    i, escaped = at + 1, False
    while i < len(text):
        ch = text[i]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            try:
                return json.loads(text[at : i + 1]), i + 1
            except json.JSONDecodeError:
                return NO
        i += 1
    return PARTIAL


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in WHITESPACE:
        at += 1
    return at


def block_tail(close: str) -> Callable[[str], Tail]:
    """The tail of a call in a block: through its close marker, then text."""

    def tail(text: str) -> Tail:
        at = text.find(close)
        return None if at < 0 else (at + len(close), TEXT)

    return tail


def object_tail(text: str, more: str = "", end: str = "") -> Tail:
    """The tail of a call written as a JSON object: its `}`; then the next call's header after
    a `more` separator (Llama's `;`, a list's `,`), or text (past an `end`, a list's `]`).
    Waits where what follows the `}` is not yet known."""
    at = text.find("}")
    if at < 0:
        return None
    rest = text[at + 1 :]
    after = _skip_space(rest, 0)
    if after == len(rest) and (more or end):
        return None
    following = rest[after : after + 1]
    if more and following == more:
        return at + 2 + after, HEADER
    if end and following == end:
        return at + 2 + after, TEXT
    return at + 1, TEXT


def json_bare_start(tag: str) -> Callable[[str], int | str]:
    """A bare JSON call at a reply's start, after an optional `tag` (Llama's
    `<|python_tag|>`)."""

    def bare_start(body: str) -> int | str:
        after = body.removeprefix(tag)
        if after.startswith("{"):
            return len(body) - len(after)
        return PARTIAL if tag.startswith(body) else NO

    return bare_start


def _held_suffix(text: str, marker: str) -> int:
    """Characters at the end of `text` that may begin `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _is_call(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("name"), str)


def _arguments_of(call: dict[str, Any]) -> Any:
    return call.get("arguments", call.get("parameters", {}))


def _merged(deltas: list[Delta]) -> list[Delta]:
    """Consecutive content, and consecutive fragments of one call's arguments, as one delta."""
    out: list[Delta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and "content" in delta and "content" in last:
            out[-1] = {"content": last["content"] + delta["content"]}
        elif last is not None and _fragment(delta) and _fragment(last):
            (a,), (b,) = last["tool_calls"], delta["tool_calls"]
            if a["index"] == b["index"]:
                joined = a["function"]["arguments"] + b["function"]["arguments"]
                out[-1] = {"tool_calls": [{"index": a["index"], "function": {"arguments": joined}}]}
                continue
            out.append(delta)
        else:
            out.append(delta)
    return out


def _fragment(delta: Delta) -> bool:
    return "tool_calls" in delta and "id" not in delta["tool_calls"][0]
