"""A chat reply split, as it streams, into content and tool-call deltas as OpenAI sends them.

Content that cannot be part of a call leaves at once; only what could still start one is held
(a partial `<tool_call>` marker, or, at the very start of a reply, a partial `<|python_tag|>` or
a `{` that may open a Llama-3.1 bare JSON call). A call leaves as OpenAI streams one: a first
delta with its index, id, type, function name and empty arguments, as soon as the name is
known, then the arguments' text in fragments, exactly as the model writes them.

The non-streamed reply is parsed by the same machine (`split_reply`), so a stream's accumulated
calls equal the whole reply's. A call whose JSON puts its arguments before its name is held to
its end and leaves in one delta; text that looked like a call and is not one leaves as content.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
WHITESPACE = " \t\r\n"
PARTIAL, NO = "partial", "no"  # a header not yet complete, or one that cannot be
ARGUMENT_KEYS = ('"arguments"', '"parameters"')

Delta = dict[str, Any]  # {"content": str} or {"tool_calls": [one call's delta]}


class CallStream:
    """One choice's reply, fed as it streams (`feed`), then ended (`finish`); each returns the
    deltas to send now, in order."""

    def __init__(self) -> None:
        self.buf = ""  # text received and not yet given out or dropped
        self.mode = "start"  # start, text, header, arguments, tail
        self.bare = False  # the call being read is Llama's bare JSON (no <tool_call> block)
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
        buf = self.buf
        body = buf.lstrip(WHITESPACE)
        if self.mode == "start" and body[:1] in ("{", "<"):
            after = body.removeprefix(PYTHON_TAG)
            if after.startswith("{"):
                return self._open(buf, len(buf) - len(after), bare=True)
            if PYTHON_TAG.startswith(body):
                return False  # maybe the tag: wait
        at = buf.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._content(buf[:at].rstrip(WHITESPACE))
            return self._open(buf, at + len(TOOL_CALL_OPEN), bare=False)
        keep = _held_suffix(buf)
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
        head = call_header(self.buf)
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
        """A block or bare JSON that does not open as `{"name": ..., "arguments": ...}`."""
        if self.bare:  # Llama's call must open so: this is content
            self.out.append({"content": self.buf})
            self.buf, self.mode = "", "text"
            return False
        at = self.buf.find(TOOL_CALL_CLOSE)
        if at < 0:
            return False  # hold the block to its end
        block, self.buf = self.buf[:at], self.buf[at + len(TOOL_CALL_CLOSE) :]
        self.out += self._whole_call_or_text(block, closed=True)
        self.mode = "text"
        return True

    def _whole_call_or_text(self, block: str, closed: bool) -> list[Delta]:
        data = _json_object(block)
        if data is None or not isinstance(data.get("name"), str):
            text = block if self.bare else TOOL_CALL_OPEN + block
            return [{"content": text + (TOOL_CALL_CLOSE if closed else "")}]
        arguments = data.get("arguments", data.get("parameters", {}))
        return [{"tool_calls": [self._first_delta(data["name"], json.dumps(arguments))]}]

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
        """After the arguments: the call's closing `}` (and `</tool_call>`), dropped."""
        if self.bare:
            at = self.buf.find("}")
            if at < 0:
                return False
            self.buf, self.mode = self.buf[at + 1 :], "text"
            return True
        at = self.buf.find(TOOL_CALL_CLOSE)
        if at < 0:
            return False
        self.buf, self.mode = self.buf[at + len(TOOL_CALL_CLOSE) :], "text"
        return True


def split_reply(text: str, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """A whole reply's content and OpenAI tool_calls, as a stream of it would accumulate
    (`cut`: a forced call cut short, see `CallStream.finish`)."""
    stream = CallStream()
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


def call_header(text: str) -> tuple[str, int] | str:
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


def _held_suffix(text: str) -> int:
    """Characters at the end of `text` that may begin a `<tool_call>` marker."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


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
