"""Serving benchmark: load through the client API, reporting vLLM's serving metrics.

Requests arrive with gamma-distributed gaps, as in vLLM's `benchmark_serving`: shape
`burstiness`, mean 1 / `request_rate` (burstiness 1 is a Poisson process; a rate of inf sends
everything at once).  Every request streams, and every time is taken at the client: TTFT from
sending to the first delta, ITL between deltas, TPOT = (E2E - TTFT) / (output tokens - 1).
Without --host/--port the benchmark starts its own `memstep serve` with the engine flags given
(`--record PATH` keeps that server's event log).  `--backend openai|openai-chat` sends the same
load over HTTP (`cli/bench_openai.py`), to that server's HTTP front or to any OpenAI-compatible
server at `--base-url`.  Before the load one probe request (the first sample, two tokens) must
succeed: an unreachable server or a failing first request ends the benchmark at once with a
one-line reason and exit code 1, not a table of zeros.  The report gives the workload's token
totals as asked beside those served, and with `--goodput ttft:MS tpot:MS e2el:MS` (vLLM's flag)
the requests that met every bound given, and their rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import numpy as np

from memstep.api.client import AsyncClient, Client, ServerError
from memstep.cli import bench_openai, traffic_replay
from memstep.cli.datasets import DATASETS, Sample, load_dataset, token_totals
from memstep.cli.errors import UsageError
from memstep.cli.main import add_engine_arguments, config_from_args
from memstep.cli.serve import ServerProcess
from memstep.core.config import EngineConfig
from memstep.core.model_source import model_config, resolve
from memstep.core.tokenizer import load_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf: all")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    p.add_argument(
        "--dataset",
        default="sharegpt",
        help=f"{', '.join(DATASETS)} (sharegpt: vLLM's sample), a ShareGPT .json file, a .jsonl "
        "file, or a serve log (.memlog) whose requests are sent again at their recorded pace "
        "(see --speed)",
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="service-level bounds, as vLLM's: ttft, tpot and/or e2el in milliseconds; a request "
        "is good if it meets every one given (e.g. --goodput ttft:500 tpot:50)",
    )
    p.add_argument(
        "--speed", type=float, default=1.0, help="replay a .memlog this many times faster"
    )
    p.add_argument("--sample-seed", type=int, default=0, help="seed of sampling and arrivals")
    p.add_argument("--max-output-len", type=int, help="cap each request's output length")
    p.add_argument("--ignore-eos", action="store_true", help="always generate the full length")
    p.add_argument("--json", type=Path, help="write the metrics and per-request data here")
    p.add_argument("--host", help="an already running server (default: start one)")
    p.add_argument("--port", type=int, help="its port (default 5557 with --host)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds of server silence")
    p.add_argument("--record", type=Path, help="keep the event log of the server bench starts")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument(
        "--backend",
        choices=bench_openai.BACKENDS,
        default="zmq",
        help="zmq: memstep's client API; openai: /v1/completions; openai-chat: "
        "/v1/chat/completions (default: %(default)s)",
    )
    p.add_argument(
        "--base-url", help="an OpenAI-compatible server: http://127.0.0.1:8000/v1, /v1 optional"
    )
    p.add_argument(
        "--max-concurrency", type=int, help="at most this many requests in flight (default: all)"
    )
    add_engine_arguments(p)


class BenchFailed(RuntimeError):
    """The benchmark cannot give meaningful numbers; the message says why, in one line."""


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if str(args.dataset).endswith(".memlog"):
        return _replay_log(args, cfg)
    slo = parse_goodput(getattr(args, "goodput", None))
    samples = _samples(args, cfg)
    try:
        results, duration = _serve_and_load(args, cfg, samples)
        if not any(r.ok for r in results):
            raise BenchFailed(f"every request failed; the first: {results[0].error}")
    except BenchFailed as exc:
        print(f"memstep bench serve: error: {exc}", file=sys.stderr)
        return 1
    metrics = compute_metrics(results, duration, slo)
    metrics["workload_input_tokens"], metrics["workload_output_tokens"] = token_totals(samples)
    print(report(metrics, args, resolve(cfg.model, cfg.random_weights_seed, cfg.tokenizer).label))
    if args.json:
        data = {**metrics, "config": _run_config(args, cfg), "requests": _per_request(results)}
        args.json.write_text(json.dumps(data, indent=2))
    return 0


def server_root(base_url: str) -> str:
    """The server's root from a base URL given with or without `/v1` (`serve` prints it with)."""
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


def _serve_and_load(
    args: argparse.Namespace, cfg: EngineConfig, samples: list[Sample]
) -> tuple[list[RequestResult], float]:
    http = getattr(args, "backend", "zmq") != "zmq"
    if args.base_url:
        url = server_root(args.base_url)
        asyncio.run(check_http(url, min(args.timeout, PROBE_TIMEOUT_S)))
        return _run_load(args, url, samples)
    if args.host or args.port:
        address = f"tcp://{args.host or '127.0.0.1'}:{args.port or 5557}"
        check_server(address, samples[0], min(args.timeout, PROBE_TIMEOUT_S))
        return _run_load(args, address, samples)
    with _own_server(args, cfg, http) as server:
        check_server(server.address, samples[0], args.timeout)
        return _run_load(args, server.http_url if http else server.address, samples)


@contextlib.contextmanager
def _own_server(args: argparse.Namespace, cfg: EngineConfig, http: bool = False) -> Any:
    """A `memstep serve` of this config, ready; --record keeps its log."""
    record = ["--record", str(args.record)] if getattr(args, "record", None) else []
    with ServerProcess(server_flags(cfg) + record, http=http) as server:
        try:
            server.wait_ready(timeout=600)
        except (RuntimeError, TimeoutError) as exc:
            last = str(exc).strip().splitlines()[-1]
            raise BenchFailed(f"the server did not start: {last}") from exc
        yield server


PROBE_TIMEOUT_S = 30.0  # a server given by --host/--port is already up: silence means unreachable


def check_server(address: str, sample: Sample, timeout: float) -> None:
    """One short request (the first sample's prompt, two tokens) that must come back."""
    with Client(address, timeout=timeout) as client:
        try:
            client.generate(sample.prompt, max_tokens=2, ignore_eos=True, temperature=0.0)
        except (TimeoutError, ConnectionError) as exc:
            raise BenchFailed(f"server {address} cannot be reached: {exc}") from exc
        except ServerError as exc:
            raise BenchFailed(f"the first request failed: {exc}") from exc


async def check_http(url: str, timeout: float) -> None:
    """The OpenAI-compatible server at `url` must answer /v1/models."""
    async with bench_openai.session(timeout) as http:
        try:
            await bench_openai.model_id(http, url)
        except (bench_openai.HttpError, *bench_openai.HTTP_ERRORS) as exc:
            raise BenchFailed(f"server {url} cannot be reached: {exc!r}") from exc


def _replay_log(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """Send a serve log's requests again (cli/traffic_replay.py), over ZMQ."""
    if args.backend != "zmq" or args.base_url:
        raise UsageError(
            "--dataset RUN.memlog replays over memstep's ZMQ API (the recorded token ids and "
            "seeds): give --host/--port, not --backend openai* or --base-url"
        )
    path = Path(args.dataset)
    recorded = traffic_replay.load_recorded(path)
    if args.host or args.port:
        address = f"tcp://{args.host or '127.0.0.1'}:{args.port or 5557}"
        results, duration = asyncio.run(
            traffic_replay.replay(address, recorded, args.speed, args.timeout, args.disable_tqdm)
        )
    else:
        with _own_server(args, cfg) as server:
            results, duration = asyncio.run(
                traffic_replay.replay(
                    server.address, recorded, args.speed, args.timeout, args.disable_tqdm
                )
            )
    data = traffic_replay.summary(recorded, results, duration)
    print(traffic_replay.report(data, path, args.speed))
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
    return 0


def _samples(args: argparse.Namespace, cfg: EngineConfig) -> list[Sample]:
    source = resolve(cfg.model, cfg.random_weights_seed, cfg.tokenizer)
    mc = model_config(source)
    tokenizer = load_tokenizer(source, mc.vocab_size, mc.eos_token_ids)
    samples = load_dataset(args.dataset, args.num_prompts, tokenizer, args.sample_seed)
    if not samples:
        raise FileNotFoundError(f"dataset {args.dataset!r} yielded no prompts")
    if len(samples) < args.num_prompts:
        print(
            f"memstep bench serve: warning: dataset {args.dataset!r} yielded {len(samples)} "
            f"prompts of the {args.num_prompts} asked",
            file=sys.stderr,
        )
    if args.max_output_len:
        cap = args.max_output_len
        samples = [attrs.evolve(s, output_len=min(s.output_len, cap)) for s in samples]
    return samples


def server_flags(cfg: EngineConfig) -> list[str]:
    """`memstep serve` flags for every engine setting that differs from the default."""
    flags: list[str] = []
    default = EngineConfig()
    for field in attrs.fields(EngineConfig):
        value = getattr(cfg, field.name)
        if value == getattr(default, field.name):
            continue
        if value is False:  # a setting on by default: a store_false flag
            flags.append("--no-" + field.name.replace("_", "-"))
        elif value is True:  # store_true
            flags.append("--" + field.name.replace("_", "-"))
        elif isinstance(value, tuple):  # step numbers, as 5,12
            flags += ["--" + field.name.replace("_", "-"), ",".join(map(str, value))]
        else:
            flags += ["--" + field.name.replace("_", "-"), str(value)]
    return flags


# --- the load ------------------------------------------------------------------------------


@attrs.define
class RequestResult:
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = attrs.Factory(list)
    latency: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, mean=1/rate), or 0."""
    if math.isinf(rate):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


def _run_load(
    args: argparse.Namespace, address: str, samples: list[Sample]
) -> tuple[list[RequestResult], float]:
    gaps = arrival_gaps(len(samples), args.request_rate, args.burstiness, args.sample_seed)
    return asyncio.run(benchmark(address, samples, gaps, args.ignore_eos, args))


async def benchmark(
    address: str, samples: list[Sample], gaps: list[float], ignore_eos: bool, args: Any
) -> tuple[list[RequestResult], float]:
    """Send every sample after its gap; the results in sample order and the wall time."""
    from tqdm import tqdm

    bar = tqdm(total=len(samples), desc="requests", disable=getattr(args, "disable_tqdm", False))
    limit = asyncio.Semaphore(getattr(args, "max_concurrency", None) or len(samples) or 1)
    async with _backend(address, args) as send, _frozen_heap():
        try:
            start = time.perf_counter()
            tasks = []
            for sample, gap in zip(samples, gaps, strict=True):
                await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(_limited(limit, send, sample, ignore_eos, bar)))
            results = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
        finally:
            bar.close()
    return list(results), duration


@contextlib.asynccontextmanager
async def _frozen_heap() -> Any:
    """The collector leaves what the client holds before the load alone, as in vLLM's
    benchmark: a full collection walks every object (the samples, the libraries' modules), and a
    client that stops for it (a tenth of a second, measured) delays every arrival it owes."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.asynccontextmanager
async def _backend(address: str, args: Any) -> Any:
    """The function that runs one request over the chosen API, and its connection."""
    backend = getattr(args, "backend", "zmq")
    timeout = getattr(args, "timeout", 600.0)
    if backend == "zmq":
        client = AsyncClient(address, timeout=timeout)
        try:
            yield functools.partial(_one, client)
        finally:
            await client.close()
        return
    async with bench_openai.session(timeout) as http:
        model = await bench_openai.model_id(http, address)
        yield functools.partial(_one_openai, http, address, model, backend == "openai-chat")


async def _limited(limit: asyncio.Semaphore, send: Any, *args: Any) -> RequestResult:
    async with limit:
        return await send(*args)


async def _one_openai(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    chat: bool,
    sample: Sample,
    ignore_eos: bool,
    bar: Any,
) -> RequestResult:
    """One request over HTTP, timed as `_one` times one over ZMQ."""
    result = RequestResult(prompt_len=sample.prompt_len)
    body = bench_openai.request_body(chat, model, sample.prompt, sample.output_len, ignore_eos)
    try:
        got = await bench_openai.stream(http, url, chat, body)
        times = got.arrivals
        result.ttft = times[0] - got.start if times else 0.0
        result.itl = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
        result.latency = time.perf_counter() - got.start
        result.prompt_len, result.output_len = got.prompt_tokens, got.completion_tokens
    except (bench_openai.HttpError, *bench_openai.HTTP_ERRORS) as exc:
        result.error = str(exc)
    bar.update(1)
    return result


async def _one(client: AsyncClient, sample: Sample, ignore_eos: bool, bar: Any) -> RequestResult:
    result = RequestResult(prompt_len=sample.prompt_len)
    start = last = time.perf_counter()
    try:
        stream = await client.generate(
            sample.prompt,
            stream=True,
            max_tokens=sample.output_len,
            ignore_eos=ignore_eos,
            temperature=0.0,
        )
        async for _ in stream:
            now = time.perf_counter()
            if result.ttft == 0.0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
        assert stream.result is not None
        result.latency = time.perf_counter() - start
        result.prompt_len = stream.result.usage.prompt_tokens
        result.output_len = stream.result.usage.completion_tokens
    except (ServerError, TimeoutError) as exc:
        result.error = str(exc)
    bar.update(1)
    return result


# --- the numbers ---------------------------------------------------------------------------


SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0}; a UsageError names a bad one."""
    slo: dict[str, float] = {}
    for pair in pairs or []:
        key, _, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if key not in SLO_KEYS or not ms > 0:
            raise UsageError(
                f"--goodput {pair!r}: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)} "
                "and MS a positive number of milliseconds"
            )
        slo[key] = ms
    return slo


def is_good(r: RequestResult, slo: dict[str, float]) -> bool:
    """Whether a finished request met every bound, as vLLM counts goodput (a one-token reply's
    TPOT is 0)."""
    tpot = (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0
    ms = {"ttft": r.ttft * 1000, "tpot": tpot * 1000, "e2el": r.latency * 1000}
    return all(ms[key] <= bound for key, bound in slo.items())


def compute_metrics(
    results: list[RequestResult], duration: float, slo: dict[str, float] | None = None
) -> dict[str, Any]:
    """vLLM's serving metric set; times in milliseconds.  With `slo`, the requests that met it
    (`good_requests`) and their rate (`request_goodput`)."""
    done = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    metrics: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    if slo:
        good = sum(is_good(r, slo) for r in done)
        metrics |= {
            "goodput_slo_ms": slo,
            "good_requests": good,
            "request_goodput": good / duration,
        }
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1000
        metrics[f"mean_{name}_ms"] = float(ms.mean())
        metrics[f"median_{name}_ms"] = float(np.median(ms))
        metrics[f"p99_{name}_ms"] = float(np.percentile(ms, 99))
    return metrics


TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def report(m: dict[str, Any], args: argparse.Namespace, model: str) -> str:
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    lines = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        _row("Model", model),
        _row("Dataset", f"{args.dataset} ({args.num_prompts} prompts)"),
        _row("Request rate (req/s)", f"{rate} (burstiness {args.burstiness:g})"),
        _row("Maximum request concurrency", getattr(args, "max_concurrency", None)),
        _row("Successful requests", m["completed"]),
        _row("Failed requests", m["failed"]),
        _row("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
        _row("Total input tokens", m["total_input_tokens"]),
        _row("Total generated tokens", m["total_output_tokens"]),
    ]
    if "workload_input_tokens" in m:
        lines.append(_row("Workload input tokens (asked)", m["workload_input_tokens"]))
        lines.append(_row("Workload output tokens (asked)", m["workload_output_tokens"]))
    lines += [
        _row("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        _row("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
        _row("Total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}"),
    ]
    if "request_goodput" in m:
        bounds = " ".join(f"{k}:{v:g}" for k, v in m["goodput_slo_ms"].items())
        lines.append(_row(f"Good requests ({bounds})", m["good_requests"]))
        lines.append(_row("Request goodput (req/s)", f"{m['request_goodput']:.2f}"))
    for name, (title, short) in TITLES.items():
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms)"
            lines.append(_row(label, f"{m[f'{stat}_{name}_ms']:.2f}"))
    lines.append("=" * 50)
    return "\n".join(lines)


def _row(label: str, value: object) -> str:
    return f"{label + ':':<40}{value}"


def _run_config(args: argparse.Namespace, cfg: EngineConfig) -> dict[str, Any]:
    return {
        "num_prompts": args.num_prompts,
        "request_rate": str(args.request_rate),
        "burstiness": args.burstiness,
        "dataset": args.dataset,
        "max_output_len": args.max_output_len,
        "ignore_eos": args.ignore_eos,
        "max_concurrency": args.max_concurrency,
        "goodput": getattr(args, "goodput", None),
        "engine": cfg.to_dict(),
    }


def _per_request(results: list[RequestResult]) -> dict[str, list]:
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "errors": [r.error for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memstep.cli.bench_serve", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
