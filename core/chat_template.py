"""A model's chat template: untrusted Jinja code, rendered in a sandbox, content kept apart.

The template comes from the model file, so it is treated as code from a stranger. It runs in
jinja2's immutable sandbox, as Hugging Face runs it, made stricter in two ways: an attribute that
starts with an underscore (the way out to `__globals__`, `__subclasses__`, ...) raises at once
instead of rendering as an empty string, and `include`, `import` and `extends` read no file.
A trial render at load turns a template that breaks those rules into a `ModelError`, before the
first request.

`parts` renders a conversation with each message's content swapped for a placeholder, so that
the tokenizer can tell the template's own text (where control tokens belong) from the content
(which must stay plain text, whatever it looks like).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from memstep.core.model_source import ModelError
from memstep.core.sampling_params import InvalidRequest

Messages = list[dict[str, str]]

# rendered at load: every template must accept it; some refuse a system turn on purpose
TRIAL = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "What is 2 + 2?"},
]
TRIAL_WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, *TRIAL]
TRIAL_TOOL = {
    "type": "function",
    "function": {"name": "probe", "description": "A probe.", "parameters": {"type": "object"}},
}


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with unsafe attribute access an error instead of ''."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe"
        )


def _no_files(name: str) -> NoReturn:
    raise SecurityError(f"a chat template may not load {name!r} (include, import, extends)")


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)


def _tojson(x: Any, indent: int | None = None, ensure_ascii: bool = False, **kw: Any) -> str:
    # Hugging Face's filter: plain json.dumps, not jinja2's HTML-escaped one
    return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, **kw)


def _environment() -> jinja2.Environment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        loader=jinja2.FunctionLoader(_no_files),
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


class ChatTemplate:
    """One compiled, checked template; `bos` and `eos` are the texts the template knows as
    `bos_token` and `eos_token` (Mistral's ends an assistant turn with the latter)."""

    def __init__(self, source: str, bos: str, eos: str = ""):
        self._bos, self._eos = bos, eos
        if not isinstance(source, str):  # e.g. a tokenizer_config.json list of named templates
            raise ModelError(f"the model's chat template is a {type(source).__name__}, not text")
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ModelError(f"the model's chat template does not compile: {exc}") from None
        self._check()

    def _check(self) -> None:
        """Trial renders: an unsafe or broken template fails at load, not at the first request."""
        for messages in (TRIAL, TRIAL_WITH_SYSTEM):
            try:
                self._render(messages)
            except SecurityError as exc:
                raise ModelError(f"the model's chat template is unsafe, refused: {exc}") from None
            except Exception as exc:  # foreign code: any error; a system turn may be refused
                if messages is TRIAL:
                    raise ModelError(f"the model's chat template does not render: {exc}") from None
        try:
            self.parts(TRIAL)
        except InvalidRequest as exc:
            raise ModelError(f"the model's chat template is not usable: {exc}") from None

    def _render(self, messages: Messages, extra: dict[str, Any] | None = None) -> str:
        fixed = {"messages": messages, "add_generation_prompt": True}
        fixed |= {"bos_token": self._bos, "eos_token": self._eos}
        return self._template.render({**(extra or {}), **fixed})

    def render(self, messages: Messages, extra: dict[str, Any] | None = None) -> str:
        """The prompt text, with the generation prompt; `extra` are more of the template's
        variables (vLLM's chat_template_kwargs, e.g. `enable_thinking`), never the four the
        engine sets. A template error is the request's fault."""
        fixed = {"messages", "add_generation_prompt", "bos_token", "eos_token"}
        taken = sorted(set(extra or {}) & fixed)
        if taken:
            raise InvalidRequest(f"chat_template_kwargs may not set {taken[0]}")
        try:
            return self._render(messages, extra)
        except SecurityError as exc:
            raise InvalidRequest(f"the chat template did something unsafe: {exc}") from None
        except Exception as exc:  # the template is foreign code: whatever it raises, refuse
            raise InvalidRequest(f"the chat template refused these messages: {exc}") from None

    def renders_tools(self) -> bool:
        """Whether the template writes a `tools` variable into the prompt (Qwen's, Llama 3.1's,
        Mistral's do): a trial conversation renders otherwise with a tool than without."""
        try:
            return self._render(TRIAL, {"tools": [TRIAL_TOOL]}) != self._render(TRIAL)
        except Exception:  # foreign code: a template that fails on tools does not render them
            return False

    def takes_system_turn(self) -> bool:
        """Whether a conversation may open with a system turn (Mixtral's template refuses one)."""
        try:
            self._render(TRIAL_WITH_SYSTEM)
        except Exception:  # foreign code: whatever it raises, it refused
            return False
        return True

    def parts(
        self, messages: Messages, extra: dict[str, Any] | None = None
    ) -> list[tuple[str, bool]]:
        """(text, is_content) pieces whose joined text is `render(messages, extra)`."""
        nonce = secrets.token_hex(8)
        stand_ins = [{**m, "content": f"memstep_{nonce}_{i}_"} for i, m in enumerate(messages)]
        # [template text, message index, template text, ..., template text]
        pieces = re.split(f"memstep_{nonce}_([0-9]+)_", self.render(stand_ins, extra))
        want = self.render(messages, extra)
        for shape in (str, str.strip):  # a template may trim the content (Llama 3 does)
            parts = [
                (shape(messages[int(p)]["content"]), True) if k % 2 else (p, False)
                for k, p in enumerate(pieces)
            ]
            if "".join(text for text, _ in parts) == want:
                return [(text, is_content) for text, is_content in parts if text]
        raise InvalidRequest("the chat template changes message content beyond trimming it")
