"""Serve the engine over the ZeroMQ client API and OpenAI-compatible HTTP, with the model in an
executor process.

`memstep serve` (or `python -m memstep.cli.serve`) loads the tokenizer in the core, spawns the
executor process (which loads the model) and the HTTP front process (a ZMQ client of the core,
`serving/http_front/http_server.py`), then answers clients until SIGINT or SIGTERM.  A lost executor
is replaced (`--max-executor-restarts` within `--executor-restart-window` seconds); past that budget
serve exits with code 3, for a supervisor to restart it.  `ServerProcess` runs the same command as a
child process, for tests and `bench serve`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import structlog
import zmq

from memstep.cli import serve_replicas, vllm_flags
from memstep.cli.curve_keys import attach_dashed_keys, is_z85_key
from memstep.cli.help_format import groups
from memstep.cli.main import add_engine_arguments, config_from_args
from memstep.core import collector
from memstep.core.chat_template import ChatTemplate
from memstep.core.config import ConfigError, EngineConfig
from memstep.core.device_limits import cuda_device_bytes
from memstep.core.engine import Engine
from memstep.core.executor import ExecutorFactory
from memstep.core.logging import setup_logging
from memstep.core.model_config import ModelConfig
from memstep.core.model_source import is_hub_id, model_config, resolve
from memstep.core.recovery import ExecutorDown
from memstep.core.shapes import max_model_len
from memstep.executors.process.remote import ProcessExecutor
from memstep.executors.process.standby import StandbyExecutors
from memstep.replay.recorder import add_record_arguments, open_recorder
from memstep.replay.recording import load
from memstep.replay.resume import resume_point
from memstep.router.lifeline import follow_parent
from memstep.serving.core_config import ServerConfig
from memstep.serving.core_process import Server
from memstep.serving.http_front import tool_parsers
from memstep.serving.http_front.http_front import (
    HttpConfig,
    HttpFront,
    bind,
    curve_client_keys,
    default_front_count,
    stop_process,
)
from memstep.serving.http_front.http_limits import HttpLimits

log = structlog.get_logger("memstep.serve")
EXIT_ENGINE_DEAD = 3  # the executor was lost more often than the restart budget allows
EXECUTOR_RUNTIME_BYTES = 384 << 20  # an executor process beside its weights and KV: torch, buffers
STANDBY_ROOM = 4  # auto keeps a standby when available memory is this many times its size


EXAMPLES = """examples:
  memstep serve                                   SmolLM2 on the CPU: HTTP :8000/v1, ZMQ :5557
  memstep serve ./Llama-3.1-8B --device cuda --served-model-name llama --port 8000
  memstep serve --config serve.yaml --port 6000   flags from a file; the command line wins
  memstep serve --resume memstep-logs/LOG.memlog  pick up where a dead server stopped
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, hd = ServerConfig(), HttpConfig()
    g = groups(p)
    common = g["common"]
    common.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the model, as vLLM's (default: --model)"
    )
    common.add_argument(
        "--host",
        dest="http_host",
        default=hd.host,
        metavar="HOST",
        help="HTTP address; non-loopback needs --api-key",
    )
    common.add_argument(
        "--port",
        dest="http_port",
        type=int,
        default=hd.port,
        metavar="PORT",
        help="HTTP port; 0: a free one",
    )
    common.add_argument(
        "--zmq-host", dest="host", default=d.host, help="ZMQ address; non-loopback needs CURVE"
    )
    common.add_argument(
        "--zmq-port", dest="port", type=int, default=d.port, help="ZMQ port; 0: a free one"
    )
    common.add_argument("--no-http", dest="http", action="store_false", help="serve ZMQ only")
    common.add_argument(
        "--api-key",
        default=os.environ.get("MEMSTEP_API_KEY"),
        metavar="KEY",
        help="required as 'Bearer KEY' (default: $MEMSTEP_API_KEY)",
    )
    common.add_argument("--api-key-file", type=Path, metavar="FILE", help="the API key's file")
    common.add_argument(
        "--served-model-name", metavar="NAME", help="the model's name in the API (default: --model)"
    )
    common.add_argument(
        "--resume",
        type=Path,
        metavar="LOG",
        help="resume a dead server's log (default: a fresh start)",
    )
    _add_model_arguments(common)
    add_record_arguments(p, by_default=True, group=common, more=g["debugging"], durability=True)
    add_engine_arguments(p)
    perf = g["performance"]
    perf.add_argument(
        "--standby-executor",
        choices=["auto", "on", "off"],
        default="auto",
        help="a loaded spare executor (auto: if memory allows)",
    )
    perf.add_argument(
        "--api-server-count",
        type=_front_count,
        default="auto",
        metavar="N",
        help="HTTP front processes, as vLLM's (auto: 2 on a GPU)",
    )
    perf.add_argument(
        "--max-waiting-requests",
        type=int,
        default=d.max_waiting_requests,
        metavar="N",
        help="past N waiting, refuse: 'overloaded' (HTTP 503); 0: no bound",
    )
    _add_curve_arguments(g["distributed"])
    serve_replicas.add_replica_arguments(g["distributed"], g["debugging"])
    _add_debugging_arguments(g["debugging"], d)
    add_limit_arguments(g["debugging"])
    vllm_flags.add_arguments(g["debugging"])
    _add_vllm_tool_arguments(g["debugging"])


def _add_model_arguments(g: Any) -> None:
    g.add_argument(
        "--revision",
        metavar="REV",
        help="a hub id's branch, tag or commit, as vLLM's (default: main)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(tool_parsers.PARSERS),
        metavar="NAME",
        help=f"format: {', '.join(sorted(tool_parsers.PARSERS))} (default: the chat template's)",
    )


def _add_vllm_tool_arguments(g: Any) -> None:
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's: tool_choice auto reads calls from replies (memstep always does)",
    )


def _with_revision(args: argparse.Namespace) -> None:
    """`--revision R` of a hub id: the model becomes `ID@R` (resolved at that revision wherever
    it is loaded, and recorded so in the log), served under the plain id."""
    if args.revision is None:
        return
    hub_id = args.model.partition("@")[0]  # a replica's argv holds the model with it already
    if not is_hub_id(hub_id):
        raise ConfigError(f"--revision goes with a hub id (owner/name), not {args.model!r}")
    args.served_model_name = args.served_model_name or hub_id
    args.model = f"{hub_id}@{args.revision}"


def _tool_format(args: argparse.Namespace, engine: Engine) -> tool_parsers.ToolFormat:
    """How the model calls tools: `--tool-call-parser`, else what its chat template teaches."""
    template = engine.tokenizer.hf_config().get("chat_template")
    compiled = ChatTemplate(template, "") if isinstance(template, str) else None
    renders = compiled is not None and compiled.renders_tools()
    system = compiled is None or compiled.takes_system_turn()
    fmt = tool_parsers.choose(args.tool_call_parser, template, renders, system)
    log.info("tool calls", parser=fmt.parser.name, tools_in_template=fmt.in_template)
    return fmt


def _add_curve_arguments(g: Any) -> None:
    g.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="a file with the z85 secret key (default: no CURVE)",
    )
    g.add_argument(
        "--curve-client-keys",
        metavar="KEYS",
        help="allowed public keys: a,b, a file or a folder",
    )


def _add_debugging_arguments(g: Any, d: ServerConfig) -> None:
    g.add_argument(
        "--dead-exit-s",
        type=float,
        default=d.dead_exit_s,
        metavar="S",
        help="once no executor starts: answer health (dead) this long, then exit 3",
    )
    g.add_argument(
        "--max-frame-bytes",
        type=int,
        default=d.max_frame_bytes,
        metavar="N",
        help="larger client frames get a frame_too_large error",
    )
    g.add_argument(
        "--executor-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds without a heartbeat before an executor counts as dead",
    )
    g.add_argument("--ready-file", type=Path, help="write {endpoint, pids} here when serving")
    g.add_argument(
        "--max-new-while-recovering",
        type=int,
        default=d.max_new_while_recovering,
        metavar="N",
        help="new requests queued while an executor restarts, then 'recovering'",
    )
    g.add_argument(
        "--stats-interval",
        type=float,
        default=d.stats_interval_s,
        metavar="S",
        help="seconds between 'stats' log lines while busy; 0: none",
    )


def add_limit_arguments(h: Any) -> None:
    """The HTTP front's limits (serving/http_front/http_limits.py, docs/limits.md)."""
    d = HttpLimits()
    helps = {
        "max_request_bytes": "larger request bodies get 413 request_too_large",
        "max_connections": "connections past this are closed as they open",
        "header_timeout_s": "seconds a connection has to send a whole request head",
        "body_timeout_s": "seconds a request has to send its body (then 408)",
        "keepalive_timeout_s": "an idle keep-alive connection closes after this many seconds",
        "request_timeout_s": "a request's deadline, arrival to last byte (then 504)",
        "log_lines_per_s": "the front's warnings past this rate are counted, not written",
    }
    for field in attrs.fields(HttpLimits):
        name = field.name.removesuffix("_s") if "timeout" in field.name else field.name
        flag = "--" + name.replace("_", "-")
        default = getattr(d, field.name)
        help = helps[field.name]
        h.add_argument(flag, dest=field.name, type=type(default), default=default, help=help)


def _http_limits(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(**{f.name: getattr(args, f.name) for f in attrs.fields(HttpLimits)})


def _api_key(args: argparse.Namespace) -> str | None:
    """The API key from --api-key-file, else --api-key (with a warning when given inline)."""
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read --api-key-file: {exc}") from exc
        if not lines or not lines[0].strip():
            raise ConfigError(f"{args.api_key_file} holds no API key")
        return lines[0].strip()
    if args.api_key and "--api-key" in " ".join(sys.argv):
        log.warning(
            "API key given inline: any local user can read it in /proc/PID/cmdline or ps; "
            "give --api-key-file (or MEMSTEP_API_KEY) instead"
        )
    return args.api_key


def _front_count(value: str) -> int | str:
    return value if value == "auto" else int(value)


def front_count(given: int | str, device: str) -> int:
    """`--api-server-count`: as given, or with "auto" by the host (`default_front_count`)."""
    if given != "auto":
        return int(given)
    on_gpu = cuda_device_bytes(device) is not None
    return default_front_count(on_gpu, os.cpu_count() or 1)


def run(args: argparse.Namespace) -> int:
    vllm_flags.apply(args)
    _with_revision(args)
    args.api_server_count = front_count(args.api_server_count, args.device)
    if serve_replicas.wants_replicas(args):
        return _serve_replicas(args)
    server_cfg = _server_config(args)
    args.api_key = _api_key(args)
    http_cfg = HttpConfig(
        host=args.http_host,
        port=args.http_port,
        api_key=args.api_key,
        api_server_count=args.api_server_count,
    )
    http_sock = bind(http_cfg) if args.http else None  # fails here, before any model loads
    check_port_free(server_cfg.host, server_cfg.port)
    front_keys = curve_client_keys() if http_sock is not None and server_cfg.uses_curve else None
    if front_keys is not None:
        keys = server_cfg.curve_client_keys | {front_keys[0]}
        server_cfg = attrs.evolve(server_cfg, curve_client_keys=keys)
    point = resume_point(load(args.resume)) if args.resume else None
    cfg = config_from_args(args)
    cfg = point.config(cfg) if point is not None else cfg
    model = model_config(resolve(cfg.model, cfg.random_weights_seed, cfg.tokenizer))
    max_model_len(cfg, model)  # a ConfigError beyond the model's context, before it loads
    link = {"resumed_from": point.link()} if point is not None else None
    recorder = open_recorder(args, header=link)
    sinks = [recorder] if recorder is not None else []
    factory = _executor_factory(args, cfg, model)
    engine = Engine(cfg, executor_factory=factory, sinks=sinks)
    front = None
    try:
        server = Server(engine, server_cfg, recorder)
        if point is not None:
            server.resume(point)
            print(
                f"memstep serve: resumed {len(point.unfinished)} unfinished requests from "
                f"{args.resume}",
                flush=True,
            )
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: server.stop())
            if http_sock is not None:
                front = _start_front(args, http_sock, server, front_keys)
            _announce(server, args.ready_file, front, recorder)
            collector.tune_for_core()
            server.serve_forever()
        finally:
            if front is not None:
                front.stop()
            server.close()
    finally:
        _shutdown(engine)
        if isinstance(factory, StandbyExecutors):
            factory.close()
        if recorder is not None:
            recorder.close()
    return 0 if engine.death is None else EXIT_ENGINE_DEAD


def _serve_replicas(args: argparse.Namespace) -> int:
    """`--data-parallel-size N` or `--replica`: replicas behind a router (cli/serve_replicas.py)."""
    args.api_key = _api_key(args)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parts = serve_replicas.ServeParts(parser, _http_limits(args), ServerProcess, load_key)
    return serve_replicas.run(args, parts)


def _server_config(args: argparse.Namespace) -> ServerConfig:
    keys = load_keys(args.curve_client_keys) if args.curve_client_keys else frozenset()
    if args.curve_secret_key and is_z85_key(args.curve_secret_key):
        log.warning(
            "CURVE secret key given inline: any local user can read it in /proc/PID/cmdline "
            "or ps; give --curve-secret-key a file readable only by you instead"
        )
    return ServerConfig(
        host=args.host,
        port=args.port,
        max_frame_bytes=args.max_frame_bytes,
        curve_secret_key=load_key(args.curve_secret_key) if args.curve_secret_key else None,
        curve_client_keys=keys,
        stats_interval_s=args.stats_interval,
        dead_exit_s=args.dead_exit_s,
        max_new_while_recovering=args.max_new_while_recovering,
        max_waiting_requests=args.max_waiting_requests,
    )


def _start_front(
    args: argparse.Namespace, sock: Any, server: Server, keys: tuple[bytes, bytes] | None
) -> HttpFront:
    curve = None
    if keys is not None:
        assert server.cfg.curve_secret_key is not None
        server_public = zmq.curve_public(server.cfg.curve_secret_key).decode()
        curve = f"{server_public} {keys[0].decode()} {keys[1].decode()}"
    front = HttpFront(
        sock,
        server.endpoint,
        args.served_model_name or server.engine.cfg.model,
        count=args.api_server_count,
        api_key=args.api_key,
        curve=curve,
        log_level=vllm_flags.front_log_level(args),
        log_format=getattr(args, "log_format", "console"),
        limits=_http_limits(args),
        core_max_frame_bytes=server.cfg.max_frame_bytes,
        tool_format=_tool_format(args, server.engine),
    )
    sock.close()  # the child holds it now
    front.wait_ready()
    log.info("http fronts", count=args.api_server_count)
    return front


def check_port_free(host: str, port: int) -> None:
    """A ConfigError now if the ZMQ port is taken, rather than once the model has loaded (the
    Server binds it after the engine starts); a race with another binder is still caught there."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        raise ConfigError(f"cannot listen on tcp://{host}:{port}: {exc}") from exc


def _executor_factory(
    args: argparse.Namespace, cfg: EngineConfig, model: ModelConfig
) -> ExecutorFactory:
    """Executor processes; with a loaded standby (executors/process/standby.py) if asked, or
    by default on the CPU when the free memory holds it."""
    factory = functools.partial(
        ProcessExecutor,
        heartbeat_timeout=args.executor_timeout,
        log_level=getattr(args, "log_level", "warning"),  # set by the top-level parser
        log_format=getattr(args, "log_format", "console"),
    )
    on, why = args.standby_executor == "on", "--standby-executor on"
    if args.standby_executor == "auto":
        on, why = standby_fits(cfg, model)
    log.info("standby executor", on=on, why=why)
    return StandbyExecutors(factory) if on else factory


def standby_fits(cfg: EngineConfig, model: ModelConfig) -> tuple[bool, str]:
    """Whether `auto` keeps a standby: on the CPU, when the memory available now holds
    STANDBY_ROOM times a standby's estimated size (float32 weights, the KV budget, the runtime);
    on CUDA never (a second copy of the weights on the device)."""
    if cuda_device_bytes(cfg.device) is not None:
        return False, "CUDA: a standby would hold a second copy of the weights on the device"
    need = model.num_params * 4 + cfg.cpu_kv_cache_bytes + EXECUTOR_RUNTIME_BYTES
    free = available_memory_bytes()
    verdict = "holds" if free >= STANDBY_ROOM * need else "does not hold"
    return free >= STANDBY_ROOM * need, (
        f"{free / 2**30:.1f} GiB available {verdict} {STANDBY_ROOM} x a standby's "
        f"{need / 2**30:.2f} GiB"
    )


def available_memory_bytes() -> int:
    """The host's MemAvailable (/proc/meminfo); 0 where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _shutdown(engine: Engine) -> None:
    try:
        engine.shutdown()
    except ExecutorDown as exc:  # lost at the very end: Engine.shutdown has closed it
        print(f"memstep serve: executor lost at shutdown: {exc}", file=sys.stderr)


def _announce(
    server: Server, ready_file: Path | None, front: HttpFront | None, recorder: Any
) -> None:
    info = {
        "endpoint": server.endpoint,
        "core_pid": os.getpid(),
        "executor_pid": server.engine.snapshot().executor_pid,
        "http_url": front.url if front is not None else None,
        "http_pid": front.proc.pid if front is not None else 0,
        "http_pids": front.pids if front is not None else [],
    }
    print(f"memstep serve: ready on {server.endpoint}", flush=True)
    if recorder is not None:
        print(f"memstep serve: recording the event log to {recorder.path}", flush=True)
    if front is not None:
        print(f"memstep serve: OpenAI-compatible HTTP API on {front.url}/v1", flush=True)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(ready_file)


# --- CURVE keys ----------------------------------------------------------------------------


def load_key(text: str) -> bytes:
    """A z85 key given inline, in a plain file, or as the secret of a zmq certificate file."""
    if is_z85_key(text):
        return text.encode()
    path = Path(text)
    if not path.is_file():
        raise ConfigError(f"{text!r} is neither a z85 CURVE key nor a file")
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError):
        secret = path.read_text().strip().encode()
    key = secret or public
    if key is None or not is_z85_key(key.decode()):
        raise ConfigError(f"{path} holds no z85 CURVE key")
    return key


def load_keys(text: str) -> frozenset[bytes]:
    """Public keys: comma-separated, a file with one a line, or a folder of certificates."""
    path = Path(text)
    if path.is_dir():
        import zmq.auth

        return frozenset(zmq.auth.load_certificate(f)[0] for f in sorted(path.glob("*.key")))
    items = path.read_text().split() if path.is_file() else text.split(",")
    keys = [item.strip() for item in items if item.strip()]
    bad = [k for k in keys if not is_z85_key(k)]
    if bad or not keys:
        raise ConfigError(f"not z85 CURVE public keys: {bad or text!r}")
    return frozenset(k.encode() for k in keys)


# --- as a child process ----------------------------------------------------------------------


class ServerProcess:
    """`memstep serve` in a child process on a free port; owns the process and its log file."""

    def __init__(
        self,
        args: list[str],
        log_level: str = "warning",
        http: bool = False,
        env: dict[str, str] | None = None,
        group: bool = False,
    ):
        """`env`: the child's environment (default: this one's); `group`: in a process group
        of its own, as a shell starts it (Ctrl-C reaches all)."""
        self.dir = Path(tempfile.mkdtemp(prefix="memstep-serve-"))
        self.ready_file = self.dir / "ready.json"
        self.log_path = self.dir / "server.log"
        self.info: dict[str, Any] = {}
        cmd = [sys.executable, "-m", "memstep.cli.serve", "--log-level", log_level]
        cmd += ["--zmq-port", "0", "--ready-file", str(self.ready_file), *args]
        cmd += ["--port", "0"] if http else ["--no-http"]
        if "--record" not in args and "--no-record" not in args:
            cmd += ["--record", str(self.dir / "events.memlog")]  # recorded, as by default
        if "--standby-executor" not in args:  # a second loading executor would skew benchmarks
            cmd += ["--standby-executor", "off"]
        with self.log_path.open("wb") as log_file:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                process_group=0 if group else None,
            )

    @property
    def address(self) -> str:
        return str(self.info["endpoint"])

    @property
    def http_url(self) -> str:
        return str(self.info["http_url"])

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"memstep serve exited ({self.proc.returncode}):\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"memstep serve not ready in {timeout} s:\n{self.log()}")
            time.sleep(0.1)
        self.info = json.loads(self.ready_file.read_text())
        return self.info

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20_000:]

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; the executor exits with its parent."""
        return stop_process(self.proc, timeout)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server and remove its temp dir (with the log)."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memstep.cli.serve", description=__doc__)
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    p.add_argument("--log-level", default="warning")
    add_arguments(p)
    args = p.parse_args(attach_dashed_keys(sys.argv[1:] if argv is None else argv))
    setup_logging(args.log_format, args.log_level)
    follow_parent()  # a local replica ends with its router (router/lifeline.py)
    try:
        return run(args)
    except (ConfigError, ValueError, FileNotFoundError, zmq.ZMQError) as exc:
        print(f"memstep serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
