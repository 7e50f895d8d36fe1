"""A `serve` command line copied from vLLM's docs means the same here: the model as a positional
argument, `--host`/`--port` for HTTP, vLLM's common flags taken with vLLM's meaning or refused by
name, and a device that is not there a one-line error."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from memstep.cli import vllm_flags
from memstep.cli.main import build_parser, config_from_args
from memstep.core.config import ConfigError

VLLM_DOCS = "--host 127.0.0.1 --port {port} --max-model-len 2048 --gpu-memory-utilization 0.9 "
VLLM_DOCS += "--enable-prefix-caching --served-model-name x --api-key k --generation-config auto"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not healthy: {log.read_text()}")


def test_a_serve_line_from_vllms_docs_serves_http_on_its_port(tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "memstep.cli.main", "serve", "smollm2"]
    cmd += VLLM_DOCS.format(port=port).split()
    cmd += ["--zmq-port", "0", "--no-record", "--num-threads", "1", "--standby-executor", "off"]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log)
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in sdk.models.list()] == ["x"]  # --served-model-name
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        chat = sdk.chat.completions.create(model="x", messages=ask, temperature=0, max_tokens=12)
        assert "Paris" in chat.choices[0].message.content
        assert httpx.get(url + "/v1/models").status_code == 401  # --api-key
        text = log.read_text()
        assert "sampling defaults" in text and "temperature=0.2" in text  # the card's, logged
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _args(line: str):
    args = build_parser("serve").parse_args(["serve", *line.split()])
    args.log_level = "info"
    vllm_flags.apply(args)
    return args


def test_vllm_flags_take_vllms_meaning(tmp_path):
    args = _args("random:tiny --enforce-eager --no-enable-prefix-caching --port 9001")
    cfg = config_from_args(args)
    assert (cfg.model, cfg.cuda_graphs, cfg.enable_prefix_caching) == ("random:tiny", False, False)
    assert (args.http_port, args.port) == (9001, 5557)  # --port is HTTP; ZMQ keeps 5557
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert config_from_args(_args(f"--chat-template {template}")).chat_template == (
        template.read_text()
    )
    quiet = _args("--uvicorn-log-level debug --disable-log-requests")
    assert vllm_flags.front_log_level(quiet) == "warning"
    assert vllm_flags.front_log_level(_args("--uvicorn-log-level trace")) == "debug"


def test_the_former_http_flags_still_work_with_a_warning(capsys):
    with pytest.warns(DeprecationWarning) as warned:
        args = _args("--http-port 9002 --http-host ::1")
    said = {str(w.message) for w in warned}
    assert said == {
        "--http-port is deprecated; use --port",
        "--http-host is deprecated; use --host",
    }
    assert (args.http_port, args.http_host) == (9002, "::1")
    assert "use --host" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line, says",
    [
        ("--trust-remote-code", "no remote code runs here"),
        ("smollm2 --model random:tiny", "two models given"),
    ],
)
def test_refused_flags_say_why(line, says):
    with pytest.raises(ConfigError, match=says):
        _args(line)


@pytest.mark.parametrize("command", ["serve", "generate --prompt hi"])
def test_a_device_that_is_not_there_is_one_line(command):
    """On this CPU-only torch `--device cuda` ends in one line, before anything loads (it was
    1,697 lines from serve's executor, a 40-line traceback from generate)."""
    cmd = [sys.executable, "-m", "memstep.cli.main", *command.split(), "--device", "cuda"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("memstep: error: --device cuda:")
