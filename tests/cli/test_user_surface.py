"""What a new user meets first: help text, flag order, one-line errors, fast failures, logs."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import pytest

from memstep.api.client import Client
from memstep.cli.main import COMMANDS, build_parser
from memstep.cli.serve import ServerProcess


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command's parser, sub-commands (bench offline, bench serve) included."""
    found = []
    for name in COMMANDS:
        top = build_parser(name)
        stack = [(name, _choices(top)[name])]
        while stack:
            label, parser = stack.pop()
            found.append((label, parser))
            for sub_name, sub in _choices(parser).items():
                stack.append((f"{label} {sub_name}", sub))
    return found


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subs[0].choices) if subs else {}


def _undocumented(parsers: list[tuple[str, argparse.ArgumentParser]]) -> list[str]:
    """Flags whose help is missing, or that take a value and print no default."""
    missing = []
    for label, parser in parsers:
        formatter = parser.formatter_class(prog="x")
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            text = formatter._get_help_string(action) if action.help else ""  # type: ignore[attr-defined]
            needs_default = action.nargs != 0 and action.default is not argparse.SUPPRESS
            if not text or (needs_default and "default" not in text):
                missing.append(f"{label} {action.option_strings[0]}")
    return missing


def test_every_flag_says_what_it_does_and_its_default():
    assert _undocumented(_parsers()) == []


def test_the_help_check_fires_on_a_flag_without_help_or_default():
    parser = argparse.ArgumentParser()  # the plain formatter prints no defaults
    parser.add_argument("--silent", type=int, default=3)
    parser.add_argument("--no-default-shown", type=int, default=3, help="says what, not the 3")
    parser.add_argument("--switch", action="store_true", help="a switch needs no default")
    assert _undocumented([("x", parser)]) == ["x --silent", "x --no-default-shown"]


def test_global_flags_are_accepted_after_the_command():
    after = build_parser("inspect").parse_args(["inspect", "x.memlog", "--log-level", "debug"])
    before = build_parser("inspect").parse_args(["--log-format", "json", "inspect", "x.memlog"])
    neither = build_parser("inspect").parse_args(["inspect", "x.memlog"])
    assert (after.log_level, after.log_format) == ("debug", "console")
    # not given: the command's own level, set in main (info; generate and chat: warning)
    assert (before.log_level, before.log_format) == (None, "json")
    assert (neither.log_level, neither.log_format) == (None, "console")


def test_max_model_len_beyond_the_model_is_a_one_line_error():
    cmd = [sys.executable, "-m", "memstep.cli.main", "generate", "--model", "random:tiny"]
    cmd += ["--prompt", "hi", "--max-model-len", "100000"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_model_len 100000 exceeds the model's context" in lines[0]


def test_client_fails_fast_when_nothing_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    start = time.monotonic()
    client = Client(f"tcp://127.0.0.1:{port}", connect_timeout=1.0)
    with pytest.raises(ConnectionError, match="nothing accepts connections"):
        client.health()
    client.close()
    assert time.monotonic() - start < 5.0


def test_serve_logs_each_request_a_stats_line_and_where_its_log_goes():
    args = ["--model", "random:tiny", "--num-threads", "1", "--stats-interval", "0.2"]
    with ServerProcess(["--log-format", "json", *args], log_level="info") as server:
        server.wait_ready()
        with Client(server.address, timeout=20) as client:
            first = client.generate("abc", max_tokens=40, ignore_eos=True, temperature=0.0)
            client.generate("abcd", max_tokens=3, ignore_eos=True, temperature=0.0)
        time.sleep(0.5)
        text = server.log()
        log_path = server.dir / "events.memlog"
    assert f"memstep serve: recording the event log to {log_path}" in text
    timing = first.timing  # type: ignore[union-attr]
    assert timing.queue_s is not None and 0 <= timing.queue_s <= timing.ttft_s
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    done = [e for e in events if e.get("event") == "request finished"]
    assert [(e["prompt_tokens"], e["completion_tokens"], e["finish_reason"]) for e in done] == [
        (3, 40, "length"),
        (4, 3, "length"),
    ]
    assert all(0 < e["ttft_s"] <= e["e2e_s"] for e in done)
    stats = [e for e in events if e.get("event") == "stats"]
    assert stats, "no stats line while busy"
    keys = {"running", "waiting", "kv_pages_used", "kv_pages_total", "live_bytes"}
    keys |= {"reserved_bytes", "host_rss_bytes", "tokens_per_s"}
    assert keys <= set(stats[0]) and stats[0]["kv_pages_total"] > 0
    assert max(s["tokens_per_s"] for s in stats) > 0
