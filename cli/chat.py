"""Chat with the model in the terminal: each answer streams as it is generated.

The conversation is kept (every turn is sent again, so the prefix cache reuses its KV pages);
`/reset` forgets it (the --system message stays), `/exit` or Ctrl-D ends; Ctrl-C stops the
answer being written (what it wrote stays in the conversation), not the chat.  The model runs in
this process, as with `generate`; `--record PATH` keeps the session's event log.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from memstep.cli.generate import (
    Answer,
    add_sampling_arguments,
    in_process_engine,
    model_defaults,
    preflight_tokenizer,
    sampling_params,
)
from memstep.cli.help_format import groups
from memstep.cli.main import add_engine_arguments, config_from_args
from memstep.core.engine import Engine
from memstep.core.sampling_params import InvalidRequest, SamplingParams
from memstep.replay.recorder import add_record_arguments, open_recorder

EXAMPLES = """examples:
  memstep chat
  memstep chat --system "Answer in one sentence." --greedy
"""
PROMPT = "> "
HELP = "/reset forgets the conversation, Ctrl-C stops an answer, /exit (or Ctrl-D) ends"


def add_arguments(p: argparse.ArgumentParser) -> None:
    common = groups(p)["common"]
    common.add_argument("--system", metavar="TEXT", help="a system message (default: none)")
    add_sampling_arguments(common, max_tokens=256)
    add_engine_arguments(p)
    add_record_arguments(p, more=groups(p)["debugging"])


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, max_num_seqs=1)
    params = sampling_params(args, model_defaults(cfg))
    preflight_tokenizer(cfg)  # a bad model or context fails before the weights load
    recorder = open_recorder(args)
    engine = in_process_engine(cfg, recorder)
    try:
        Session(engine, params, args.system).run(sys.stdin, sys.stdout)
    finally:
        engine.shutdown()
        if recorder:
            recorder.close()
    return 0


class Session:
    """One conversation: its messages, and the loop that reads a line and streams the answer."""

    def __init__(self, engine: Engine, params: SamplingParams, system: str | None):
        self.engine = engine
        self.params = params
        self.opening = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.opening)

    def run(self, lines: TextIO, out: TextIO) -> None:
        out.write(f"memstep chat with {self.engine.source.label}: {HELP}\n")
        while (line := _read(lines, out)) is not None:
            text = line.strip()
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                self.messages = list(self.opening)
                out.write("(conversation forgotten)\n")
            elif text:
                self.answer(text, out)

    def answer(self, text: str, out: TextIO) -> None:
        """Stream the model's answer to `text` and keep both turns; a turn that does not fit
        the context is refused with a line that says so, and forgotten."""
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.engine.tokenizer.encode_chat(messages)
        answer = Answer(self.engine, stoppable=True)
        try:
            reply, _ = answer.run(ids, self.params, out)
        except InvalidRequest as exc:
            out.write(f"(not sent: {exc}; /reset starts over)\n")
            return
        if answer.stopped:
            out.write("(stopped)\n")
        self.messages = [*messages, {"role": "assistant", "content": reply}]


def _read(lines: TextIO, out: TextIO) -> str | None:
    """The next line typed at the prompt (with line editing on a terminal); None at the end."""
    if lines is sys.stdin and sys.stdin.isatty():
        try:
            return input(PROMPT) + "\n"
        except EOFError:
            out.write("\n")
            return None
    out.write(PROMPT)
    out.flush()
    return lines.readline() or None
