"""`bench serve`: arrivals, metrics, and whole runs against a real server."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import pytest

from memstep.cli import bench_serve, serve
from memstep.cli.bench_serve import RequestResult, arrival_gaps, compute_metrics, server_flags
from memstep.cli.main import build_parser, config_from_args
from memstep.cli.serve import ServerProcess
from memstep.core.config import EngineConfig

TINY = ["--model", "random:tiny", "--num-threads", "1"]


def test_arrivals_at_inf_rate_all_start_at_once():
    assert arrival_gaps(5, math.inf, 1.0, 0) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_are_gamma_with_mean_one_over_rate(burstiness):
    gaps = arrival_gaps(20_000, 4.0, burstiness, seed=1)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)  # burstier: more variance
    assert gaps == arrival_gaps(20_000, 4.0, burstiness, seed=1) != arrival_gaps(20_000, 4.0, 1, 2)


def test_metrics_follow_vllms_definitions():
    results = [
        RequestResult(prompt_len=10, output_len=3, ttft=0.1, itl=[0.02, 0.04], latency=0.16),
        RequestResult(prompt_len=20, output_len=1, ttft=0.3, itl=[], latency=0.3),
        RequestResult(prompt_len=5, error="invalid_request: too long"),
    ]
    m = compute_metrics(results, duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 4)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.0
    assert m["total_token_throughput"] == 17.0
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["mean_tpot_ms"] == pytest.approx(30)  # (160 - 100) / 2; one-token requests skipped
    assert m["mean_itl_ms"] == pytest.approx(30) and m["p99_itl_ms"] == pytest.approx(39.8)
    assert m["mean_e2el_ms"] == pytest.approx(230) and m["p99_e2el_ms"] == pytest.approx(298.6)


def test_server_flags_rebuild_the_same_engine_config():
    cfg = EngineConfig(
        model="random:tiny",
        max_num_seqs=4,
        cuda_graphs=False,
        num_threads=1,
        piecewise_graphs=False,
        debug_kill_executor_at=(5, 12),
        debug_kill_restarted_executor=True,
    )
    flags = server_flags(cfg)
    assert flags[:2] == ["--model", "random:tiny"] and "--no-cuda-graphs" in flags
    assert "--no-piecewise-graphs" in flags and "--debug-kill-restarted-executor" in flags
    assert "True" not in flags and "False" not in flags  # switches take no value
    assert "5,12" in flags  # step numbers as the flag takes them
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    assert config_from_args(p.parse_args(flags)) == cfg


def test_memstep_bench_serve_reaches_this_module():
    args = build_parser("bench").parse_args(["bench", "serve", "--num-prompts", "3", "--port", "9"])
    assert args.bench_run is bench_serve.run
    assert (args.num_prompts, args.port, args.request_rate) == (3, 9, math.inf)


def test_bench_serve_starts_its_own_server_and_reports(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--dataset", "synthetic", "--num-prompts", "8", "--request-rate", "50"]
    argv += ["--max-output-len", "16", "--ignore-eos", "--json", str(out), *TINY]
    argv += ["--goodput", "ttft:600000", "tpot:600000"]  # every request meets these
    assert bench_serve.main(argv) == 0
    printed = capsys.readouterr().out
    assert "Successful requests:                    8" in printed
    assert "Workload output tokens (asked):         128" in printed
    assert "Good requests (ttft:600000 tpot:600000):8" in printed
    for line in ("Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "P99 E2EL (ms):"):
        assert line in printed
    data = json.loads(out.read_text())
    assert (data["completed"], data["failed"], data["total_output_tokens"]) == (8, 0, 8 * 16)
    assert data["workload_input_tokens"] > 0 and data["request_goodput"] == 8 / data["duration_s"]
    assert data["total_input_tokens"] == sum(data["requests"]["input_lens"]) > 0
    assert all(len(itl) == 15 for itl in data["requests"]["itls"])  # one delta per token
    assert 0 < data["median_ttft_ms"] <= data["median_e2el_ms"]


def test_bench_serve_against_a_running_server_with_a_jsonl_dataset(tmp_path, capsys):
    rows = [{"prompt": f"prompt number {i}", "output_len": 4 + i} for i in range(6)]
    rows.append({"prompt": "x" * 600, "output_len": 4})  # over the 512-token context: fails
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps(r) for r in rows))
    with ServerProcess(TINY) as server:
        server.wait_ready()
        port = server.address.rsplit(":", 1)[1]
        argv = ["--dataset", str(dataset), "--num-prompts", "7", "--port", port, "--ignore-eos"]
        assert bench_serve.main([*argv, "--model", "random:tiny"]) == 0
    printed = capsys.readouterr().out
    assert "Successful requests:                    6" in printed
    assert "Failed requests:                        1" in printed
    assert f"Total generated tokens:                 {sum(4 + i for i in range(6))}" in printed


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_bench_serve_fails_fast_when_the_server_cannot_be_reached(capsys):
    argv = ["--dataset", "synthetic", "--num-prompts", "3", "--port", str(_free_port())]
    start = time.monotonic()
    assert bench_serve.main([*argv, "--timeout", "2", *TINY]) == 1
    assert time.monotonic() - start < 30
    captured = capsys.readouterr()
    assert "cannot be reached" in captured.err and "Serving Benchmark" not in captured.out


def test_bench_serve_fails_fast_when_the_first_request_fails(tmp_path, capsys):
    dataset = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "x" * 600, "output_len": 4}, {"prompt": "fine", "output_len": 4}]
    dataset.write_text("\n".join(json.dumps(r) for r in rows))
    assert bench_serve.main(["--dataset", str(dataset), "--num-prompts", "2", *TINY]) == 1
    captured = capsys.readouterr()
    assert "the first request failed" in captured.err and "Serving Benchmark" not in captured.out


def test_bench_serve_records_the_log_with_a_real_tokenizer_and_a_concurrency_cap(tmp_path, capsys):
    from memstep.cli.main import main as cli_main
    from memstep.core.tokenizer import load_tokenizer_file
    from memstep.events.types import RequestAdded, RequestFinished
    from memstep.replay.recording import load

    tok = tmp_path / "tokenizer.json"
    assert cli_main(["export-tokenizer", "--out", str(tok)]) == 0
    prompts = ["The weather today is", "Write a short poem about memory.", "Hello, world!"]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": p, "output_len": 5}) for p in prompts))
    log, out = tmp_path / "server.memlog", tmp_path / "bench.json"
    argv = ["--dataset", str(dataset), "--num-prompts", "5", "--ignore-eos", "--json", str(out)]
    argv += ["--tokenizer", str(tok), "--record", str(log), "--max-concurrency", "1", *TINY]
    assert bench_serve.main(argv) == 0
    captured = capsys.readouterr()
    assert "yielded 3 prompts of the 5 asked" in captured.err
    assert "Maximum request concurrency:            1" in captured.out
    bpe = load_tokenizer_file(tok, (2,))
    data = json.loads(out.read_text())
    assert data["requests"]["input_lens"] == [len(bpe.encode(p)) for p in prompts]
    recording = load(log)  # kept after the server stopped
    assert recording.config["tokenizer"] == str(tok) and recording.was_shut_down
    added = [r for r in recording.records if isinstance(r, RequestAdded)]
    assert [r.prompt_token_ids for r in added[1:]] == [bpe.encode(p) for p in prompts]
    # one in flight at a time: each request is added after the one before it finished
    events = [r for r in recording.records if isinstance(r, RequestAdded | RequestFinished)]
    kinds = ["added" if isinstance(r, RequestAdded) else "finished" for r in events]
    assert kinds == ["added", "finished"] * len(added)
    capsys.readouterr()
    assert cli_main(["replay", str(log)]) == 0  # the config's tokenizer rebuilds the same run
    assert "identical" in capsys.readouterr().out.lower()
