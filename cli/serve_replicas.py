"""`memstep serve --data-parallel-size N` and `--replica tcp://HOST:PORT`: replicas behind a router.

Local replicas are `memstep serve --no-http` children, each with its own executor, event log
(`LOG` with `.replicaN` before `.memlog`) and recovery; on CUDA each takes a GPU in turn, and
replicas sharing a GPU split `--gpu-memory-utilization` between them.  Remote replicas are
`memstep serve` engines started elsewhere, reached over the ZMQ API (with CURVE:
`--replica-server-key` and `--replica-client-key`).  The router (`router/router.py`) answers on
`--zmq-port`, records its own log at `--record`, and the HTTP front is its client, as of one core.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import zmq

from memstep.core.config import ConfigError
from memstep.core.device_limits import cuda_device_bytes
from memstep.replay.recorder import DEFAULT_KEEP, DEFAULT_RECORD_DIR, prune
from memstep.router.lifeline import replica_env
from memstep.router.policy import POLICIES
from memstep.router.router import Router, RouterConfig
from memstep.serving.core_config import is_loopback
from memstep.serving.http_front.http_front import HttpConfig, HttpFront, bind
from memstep.serving.http_front.http_limits import HttpLimits

READY_TIMEOUT_S = 600.0
# flags of the router or of the front, never passed on to a local replica
NOT_FOR_REPLICAS = {
    "host",
    "port",
    "http_host",
    "http_port",
    "http",
    "api_key",
    "api_key_file",
    "resume",
    "record",
    "ready_file",
    "api_server_count",
    "curve_secret_key",
    "curve_client_keys",
    "data_parallel_size",
    "replica",
    "routing_policy",
    "replica_timeout",
    "replica_server_key",
    "replica_client_key",
    "served_model_name",
    "config",
    "config_file",
    "help",
    "help_all",
    "log_level",
    "log_format",
    "run",
    "command",
    "max_request_bytes",
    "max_connections",
    "header_timeout_s",
    "body_timeout_s",
    "keepalive_timeout_s",
    "request_timeout_s",
    "log_lines_per_s",
}


def add_replica_arguments(g: Any, more: Any) -> None:
    """`--data-parallel-size` in `g` (shown by --help), the rest in `more` (--help-all)."""
    g.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="N replicas behind one router (docs/replicas.md)",
    )
    more.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="tcp://HOST:PORT",
        help="a `memstep serve` engine elsewhere, routed to as a replica (repeatable)",
    )
    more.add_argument(
        "--routing-policy",
        choices=POLICIES,
        default="prefix",
        help="prefix: the longest prefix sent before, else least loaded (default: %(default)s)",
    )
    more.add_argument(
        "--replica-timeout",
        type=float,
        default=RouterConfig().replica_timeout_s,
        metavar="S",
        help="a replica whose connection carries nothing (heartbeats included) this long is lost",
    )
    more.add_argument("--replica-server-key", metavar="KEY", help="--replica's CURVE public key")
    more.add_argument(
        "--replica-client-key",
        metavar="FILE",
        help="the router's CURVE secret key (its public key allowed by each --replica)",
    )


def wants_replicas(args: argparse.Namespace) -> bool:
    return args.data_parallel_size > 1 or bool(args.replica)


@attrs.frozen
class ServeParts:
    """What `memstep serve` (cli/serve.py) lends the replicas' start."""

    parser: argparse.ArgumentParser  # serve's flags: a replica is given those it takes
    limits: HttpLimits
    spawn: Callable[..., Any]  # ServerProcess: `memstep serve` as a child
    load_key: Callable[[str], bytes]  # a CURVE key inline or from a file


def run(args: argparse.Namespace, parts: ServeParts) -> int:
    """Start the replicas, the router and the front; serve until SIGINT or SIGTERM."""
    if args.resume is not None:
        raise ConfigError("--resume is for one engine; resume each replica's log on its own")
    http_cfg = HttpConfig(
        host=args.http_host,
        port=args.http_port,
        api_key=args.api_key,
        api_server_count=args.api_server_count,
    )
    http_sock = bind(http_cfg) if args.http else None
    router_cfg = _router_config(args, parts.load_key)
    router_log, replica_logs = log_paths(args.record, _num_local(args), args.record_keep)
    local = [_start_replica(args, parts, i, replica_logs[i]) for i in range(_num_local(args))]
    router = front = None
    try:
        endpoints = [p.wait_ready(READY_TIMEOUT_S)["endpoint"] for p in local] + args.replica
        router = Router(endpoints, router_cfg, router_log)
        if not router.wait_live(READY_TIMEOUT_S):
            print("memstep serve: warning: not every replica answers yet", flush=True)
        check_same_model(router.models())
        if http_sock is not None:
            model = args.served_model_name or args.model
            front = HttpFront(
                http_sock,
                router.endpoint,
                model,
                count=args.api_server_count,
                api_key=args.api_key,
                limits=parts.limits,
            )
            http_sock.close()
            front.wait_ready()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: router.stop() if router is not None else None)
        _announce(args.ready_file, router, front, local, router_log, replica_logs)
        router.serve_forever()
    finally:
        if front is not None:
            front.stop()
        if router is not None:
            router.close()
        for p in local:
            p.close()
    return 0


def check_same_model(models: dict[int, str]) -> None:
    """A ConfigError unless every replica serves the same model: migration relies on it."""
    if len(set(models.values())) > 1:
        listed = ", ".join(f"{i}: {m}" for i, m in sorted(models.items()))
        raise ConfigError(f"the replicas serve different models ({listed})")


def log_paths(
    record: str | None, num_local: int, keep: int = DEFAULT_KEEP
) -> tuple[Path | None, list[Path | None]]:
    """The router's log and each local replica's beside it (`.replicaN.memlog`); in the default
    folder, the logs of the newest `keep` runs are kept."""
    if record is None:
        return None, [None] * num_local
    path = Path(record.replace("{time}", time.strftime("%Y%m%d-%H%M%S")))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.parent == DEFAULT_RECORD_DIR:
        prune(path.parent, (keep - 1) * (num_local + 1) + 1)  # each run: num_local + 1 logs
    if path.exists():
        raise ConfigError(f"{path} exists; a log is never overwritten, choose another path")
    stem = path.name.removesuffix(".memlog")
    return path, [path.with_name(f"{stem}.replica{i}.memlog") for i in range(num_local)]


def _num_local(args: argparse.Namespace) -> int:
    return args.data_parallel_size if args.data_parallel_size > 1 or not args.replica else 0


def _start_replica(
    args: argparse.Namespace, parts: ServeParts, index: int, log: Path | None
) -> Any:
    argv = replica_argv(args, parts.parser)
    argv += ["--record", str(log)] if log is not None else ["--no-record"]
    env = replica_env(dict(os.environ))  # the replica ends when this process does
    if _on_cuda(args):
        gpus = _num_gpus()
        per_gpu = math.ceil(args.data_parallel_size / gpus)
        env["CUDA_VISIBLE_DEVICES"] = _visible(index % gpus)
        share = args.gpu_memory_utilization / per_gpu
        argv += ["--gpu-memory-utilization", f"{share:.4f}"]
    level = getattr(args, "log_level", "warning")
    return parts.spawn(argv, log_level=level if isinstance(level, str) else "warning", env=env)


def replica_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The flags given to this serve that a local replica takes: engine, executor, limits."""
    argv: list[str] = []
    seen: set[str] = set()  # a deprecated alias (another action, the same dest) is not passed on
    for action in parser._actions:
        dest = action.dest
        if dest in NOT_FOR_REPLICAS or not action.option_strings or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if dest in seen or value == action.default:
            seen.add(dest)
            continue
        if dest == "gpu_memory_utilization" and _on_cuda(args):  # its share, given apart
            continue
        flag = _flag(action, value)
        seen.update([dest] if flag else [])
        argv += flag
    return argv


def _flag(action: argparse.Action, value: Any) -> list[str]:
    """The command-line words that give `action` this value."""
    option = next(o for o in action.option_strings if o.startswith("--"))
    if action.nargs == 0:  # a switch: given when its value is the one it sets
        return [option] if value == action.const else []
    if isinstance(value, list):  # a repeatable flag
        return [word for item in value for word in (option, str(item))]
    if isinstance(value, tuple):  # a comma list, as 5,12
        return [option, ",".join(map(str, value))]
    return [option, str(value)]


def _on_cuda(args: argparse.Namespace) -> bool:
    return cuda_device_bytes(args.device) is not None


def _num_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return len(visible.split(","))
    import torch

    return max(1, torch.cuda.device_count())


def _visible(index: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index] if visible else str(index)


def _router_config(args: argparse.Namespace, load_key: Callable[[str], bytes]) -> RouterConfig:
    if not is_loopback(args.host):
        raise ConfigError("the router's ZMQ endpoint has no CURVE yet: give a loopback --zmq-host")
    curve: tuple[bytes | None, bytes | None, bytes | None] = (None, None, None)
    if not args.replica_server_key:
        check_replicas_local(args.replica)
    if args.replica_server_key:
        if not args.replica_client_key:
            raise ConfigError("--replica-server-key needs --replica-client-key")
        secret = load_key(args.replica_client_key)
        curve = (load_key(args.replica_server_key), zmq.curve_public(secret), secret)
    return RouterConfig(
        host=args.host,
        port=args.port,
        policy=args.routing_policy,
        replica_timeout_s=args.replica_timeout,
        seed=getattr(args, "seed", None),
        replica_curve=curve,
    )


def check_replicas_local(endpoints: list[str]) -> None:
    """A ConfigError for a `--replica` off this machine without CURVE: prompts and tokens would
    cross the network in clear, to whoever answers at that address."""
    for endpoint in endpoints:
        scheme, _, rest = endpoint.partition("://")
        host = rest.rpartition(":")[0].strip("[]")
        if scheme == "tcp" and not is_loopback(host):
            raise ConfigError(
                f"--replica {endpoint} is not on this machine and would be reached in clear: "
                "give --replica-server-key and --replica-client-key (CURVE)"
            )


def _announce(
    ready_file: Path | None,
    router: Router,
    front: Any,
    local: list,
    router_log: Path | None,
    replica_logs: list[Path | None],
) -> None:
    import json

    print(
        f"memstep serve: router ready on {router.endpoint} ({len(router.replicas)} replicas, "
        f"policy {router.cfg.policy})",
        flush=True,
    )
    if router_log is not None:
        print(f"memstep serve: recording the router's log to {router_log}", flush=True)
    if front is not None:
        print(f"memstep serve: OpenAI-compatible HTTP API on {front.url}/v1", flush=True)
    if ready_file is None:
        return
    info = {
        "endpoint": router.endpoint,
        "core_pid": os.getpid(),
        "http_url": front.url if front is not None else None,
        "http_pids": front.pids if front is not None else [],
        "router_log": str(router_log) if router_log else None,
        "replica_logs": [str(p) if p else None for p in replica_logs],
        "replicas": [
            {
                "endpoint": p.info["endpoint"],
                "core_pid": p.info["core_pid"],
                "executor_pid": p.info["executor_pid"],
            }
            for p in local
        ],
    }
    tmp = ready_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(ready_file)
