"""Start and stop the HTTP front (`http_server.py`, beside this) as a child of `memstep serve`.

The parent binds the HTTP socket itself, before any model loads, so a port in use or a refused
address fails at once with a one-line error; the child inherits the listening socket.  The API
key and the front's CURVE keys travel in the child's environment, never on its command line.
With `count` > 1 (`--api-server-count`, as vLLM's) that many children accept on the one socket
(pre-fork, as gunicorn's workers): each parses, encodes and streams its own connections, a ZMQ
client of the core of its own, so the front's per-token work spreads over that many cores.
Their latency histograms are merged: each writes them to a folder they share, and `/metrics`
from any front sums them all (the front's own gauges stay the answering front's).
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile

import attrs
import zmq

from memstep.core.config import ConfigError
from memstep.serving.core_config import is_loopback
from memstep.serving.http_front.http_limits import HttpLimits
from memstep.serving.http_front.metrics import MULTIPROC_ENV
from memstep.serving.http_front.tool_parsers import ToolFormat

READY_TIMEOUT_S = 60.0
GPU_HOST_FRONTS = 2  # `--api-server-count auto` on a GPU host with MIN_CPUS_FOR_FRONTS or more
MIN_CPUS_FOR_FRONTS = 8


def default_front_count(on_gpu: bool, num_cpus: int) -> int:
    """`--api-server-count auto`: two fronts on a GPU host with CPUs to spare, else one.  A GPU
    serves streams fast enough that one front's writes show: on the seed experiment (an H100, 60
    req/s, ~300 streams) one front spent ~12 ms of CPU a step writing every stream's chunk, and a
    new request and a first token waited behind it (HTTP/ZMQ TTFT 1.26x); two made it 1.09x. On
    a CPU the model, not the front, sets the pace, and cores are few."""
    return GPU_HOST_FRONTS if on_gpu and num_cpus >= MIN_CPUS_FOR_FRONTS else 1


@attrs.frozen(kw_only=True)
class HttpConfig:
    """Where the HTTP front listens.  A non-loopback host needs an API key."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    api_key: str | None = None
    api_server_count: int = 1  # front processes on the one socket

    def __attrs_post_init__(self) -> None:
        if self.api_server_count < 1:
            raise ConfigError("api_server_count must be >= 1")
        if not (is_loopback(self.host) or self.api_key):
            raise ConfigError(
                f"refusing to serve HTTP on {self.host!r} without an API key: give --api-key "
                "(or MEMSTEP_API_KEY), or bind to a loopback address"
            )


def bind(cfg: HttpConfig) -> socket.socket:
    """The listening socket, or a ConfigError saying why it cannot be had."""
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    try:
        return socket.create_server((cfg.host, cfg.port), family=family, backlog=1024)
    except OSError as exc:
        raise ConfigError(f"cannot listen for HTTP on {cfg.host}:{cfg.port}: {exc}") from exc


def curve_client_keys() -> tuple[bytes, bytes]:
    """A fresh key pair for the front, to add to the core's allowed CURVE clients."""
    return zmq.curve_keypair()


class HttpFront:
    """The front's child processes (`count`, on one socket); `url` is where they answer."""

    def __init__(
        self, sock: socket.socket, zmq_address: str, model: str, count: int = 1, **options: object
    ):
        host, port = sock.getsockname()[:2]
        self.url = f"http://{_url_host(host)}:{port}"
        # several fronts write their latency histograms to one folder, so that the front that
        # answers a scrape shows every front's (prometheus_client's multiprocess mode)
        self.shared_dir = tempfile.mkdtemp(prefix="memstep-metrics-") if count > 1 else None
        if self.shared_dir is not None:
            options = {**options, "metrics_dir": self.shared_dir}
        children = [_Child(sock, zmq_address, model, options) for _ in range(max(1, count))]
        self.children = children

    @property
    def proc(self) -> subprocess.Popen:
        return self.children[0].proc

    @property
    def pids(self) -> list[int]:
        return [child.proc.pid for child in self.children]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until every child serves; RuntimeError if one exits or stays silent."""
        try:
            for child in self.children:
                child.wait_ready(timeout)
        except RuntimeError:
            self.stop()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        for child in self.children:
            child.stop(timeout)
        if self.shared_dir is not None:
            shutil.rmtree(self.shared_dir, ignore_errors=True)


class _Child:
    """One front process on the inherited socket."""

    def __init__(self, sock: socket.socket, zmq_address: str, model: str, options: dict):
        read_fd, write_fd = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "memstep.serving.http_front.http_server",
            "--zmq",
            _reachable(zmq_address),
        ]
        cmd += ["--model-name", model, "--fd", str(sock.fileno()), "--ready-fd", str(write_fd)]
        cmd += ["--log-level", str(options.get("log_level", "warning"))]
        cmd += ["--log-format", str(options.get("log_format", "console"))]
        limits = options.get("limits")
        if isinstance(limits, HttpLimits):
            cmd += limits.as_argv()
        tool_format = options.get("tool_format")
        if isinstance(tool_format, ToolFormat):
            cmd += tool_format.as_flags()
        if options.get("core_max_frame_bytes"):
            cmd += ["--core-max-frame-bytes", str(options["core_max_frame_bytes"])]
        env = dict(os.environ)
        if options.get("api_key"):
            env["MEMSTEP_API_KEY"] = str(options["api_key"])
        if options.get("curve"):
            env["MEMSTEP_FRONT_CURVE"] = str(options["curve"])
        if options.get("metrics_dir"):
            env[MULTIPROC_ENV] = str(options["metrics_dir"])
        self.proc = subprocess.Popen(cmd, env=env, pass_fds=(sock.fileno(), write_fd))
        os.close(write_fd)
        self._ready_fd = read_fd

    def wait_ready(self, timeout: float) -> None:
        """Block until the front serves; RuntimeError if it exits or stays silent."""
        try:
            ready, _, _ = select.select([self._ready_fd], [], [], timeout)
            line = os.read(self._ready_fd, 64) if ready else b""
        finally:
            os.close(self._ready_fd)
        if not line:
            self.stop()
            raise RuntimeError(f"the HTTP front did not start (exit code {self.proc.returncode})")

    def stop(self, timeout: float = 10.0) -> None:
        stop_process(self.proc, timeout)


def stop_process(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, then SIGKILL after `timeout`; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _reachable(endpoint: str) -> str:
    """The core's endpoint as a local client dials it (a wildcard bind becomes loopback)."""
    for wildcard in ("0.0.0.0", "[::]", "*"):
        endpoint = endpoint.replace(f"//{wildcard}:", "//127.0.0.1:")
    return endpoint


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
