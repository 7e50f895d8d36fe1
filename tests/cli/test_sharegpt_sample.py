"""`--dataset sharegpt` samples as vLLM's benchmark_serving.py does; goodput counts as vLLM's."""

from __future__ import annotations

import json
import random

import pytest

from memstep.cli.bench_serve import RequestResult, compute_metrics, parse_goodput
from memstep.cli.datasets import load_dataset, sample_sharegpt, sharegpt_pairs, token_totals
from memstep.cli.errors import UsageError
from memstep.core.tokenizer import ByteTokenizer

TOK = ByteTokenizer(512, (0,))  # one token a byte: lengths are easy to set


def conv(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


CONVERSATIONS = [
    conv(("gpt", "model opens " + "m" * 40), ("human", "then a human " + "h" * 20)),  # kept
    conv(("human", "a human asks"), ("gpt", "and is answered")),  # kept
    conv(("human", "alone, one turn")),  # fewer than two turns
    conv(("human", "abc"), ("gpt", "a reply long enough")),  # prompt of 3 tokens
    conv(("human", "long enough"), ("gpt", "abc")),  # reply of 3 tokens
    conv(("human", "p" * 1025), ("gpt", "a reply")),  # prompt over 1,024
    conv(("human", "q" * 1024), ("gpt", "r" * 1024)),  # 2,048 together: kept
    conv(("human", "s" * 1000), ("gpt", "t" * 1049)),  # 2,049 together
    conv(("system", "three turns"), ("human", "second turn"), ("gpt", "third turn")),  # kept
]
KEPT = {0, 1, 6, 8}


@pytest.fixture
def sharegpt_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(CONVERSATIONS))
    return path


def vllm_reference(path, n: int, seed: int) -> list[tuple[str, int, int]]:
    """vLLM's sample_sharegpt_requests, restated: global seed, then shuffle, then prune."""
    dataset = [d for d in json.loads(path.read_text()) if len(d["conversations"]) >= 2]
    pairs = [(d["conversations"][0]["value"], d["conversations"][1]["value"]) for d in dataset]
    random.seed(seed)
    random.shuffle(pairs)
    out: list[tuple[str, int, int]] = []
    for prompt, completion in pairs:
        if len(out) == n:
            break
        p_len, o_len = len(TOK.encode(prompt)), len(TOK.encode(completion))
        if p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > 2048:
            continue
        out.append((prompt, p_len, o_len))
    return out


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_the_sample_is_vllms_model_first_conversations_included(sharegpt_file, seed):
    got = sample_sharegpt(10, TOK, seed, path=sharegpt_file)
    assert [(s.prompt, s.prompt_len, s.output_len) for s in got] == vllm_reference(
        sharegpt_file, 10, seed
    )
    expected = {CONVERSATIONS[i]["conversations"][0]["value"] for i in KEPT}
    assert {s.prompt for s in got} == expected


def test_the_seed_decides_the_order(sharegpt_file):
    orders = {
        tuple(s.prompt for s in sample_sharegpt(10, TOK, k, path=sharegpt_file)) for k in range(6)
    }
    assert len(orders) > 1


def test_n_stops_at_the_first_n_kept_in_shuffled_order(sharegpt_file):
    two = sample_sharegpt(2, TOK, 3, path=sharegpt_file)
    assert [s.prompt for s in two] == [p for p, _, _ in vllm_reference(sharegpt_file, 2, 3)]
    assert [s.prompt for s in two] == [
        s.prompt for s in sample_sharegpt(9, TOK, 3, path=sharegpt_file)[:2]
    ]


def test_human_first_drops_the_conversations_a_model_or_system_opens(sharegpt_file):
    every = sharegpt_pairs(path=sharegpt_file)
    human = sharegpt_pairs(human_first=True, path=sharegpt_file)
    assert len(every) == 8 and len(human) == 6  # the one-turn conversation is in neither
    assert CONVERSATIONS[0]["conversations"][0]["value"] in {p for p, _ in every}
    assert CONVERSATIONS[0]["conversations"][0]["value"] not in {p for p, _ in human}
    kept = sample_sharegpt(10, TOK, 0, human_first=True, path=sharegpt_file)
    assert {s.prompt for s in kept} == {
        CONVERSATIONS[i]["conversations"][0]["value"] for i in (1, 6)
    }


def test_a_json_dataset_path_is_read_as_sharegpt_and_totals_are_the_asked_lengths(sharegpt_file):
    samples = load_dataset(str(sharegpt_file), 10, TOK, 0)
    assert len(samples) == len(KEPT)
    totals = token_totals(samples)
    assert totals == (sum(s.prompt_len for s in samples), sum(s.output_len for s in samples))
    assert totals[0] == sum(
        len(TOK.encode(CONVERSATIONS[i]["conversations"][0]["value"])) for i in KEPT
    )


# --- goodput ---------------------------------------------------------------------------------


RESULTS = [  # ttft s, latency s, output tokens: TPOT = (latency - ttft) / (tokens - 1)
    RequestResult(prompt_len=4, output_len=11, ttft=0.1, latency=0.1 + 10 * 0.04),  # good
    RequestResult(prompt_len=4, output_len=11, ttft=0.6, latency=0.6 + 10 * 0.01),  # TTFT too long
    RequestResult(prompt_len=4, output_len=11, ttft=0.2, latency=0.2 + 10 * 0.06),  # TPOT too long
    RequestResult(prompt_len=4, output_len=1, ttft=0.3, latency=0.3),  # one token: TPOT 0, good
    RequestResult(prompt_len=4, error="overloaded: refused"),  # failed: never good
]


def test_goodput_counts_requests_that_met_every_bound():
    m = compute_metrics(RESULTS, 2.0, parse_goodput(["ttft:500", "tpot:50"]))
    assert m["good_requests"] == 2 and m["request_goodput"] == pytest.approx(1.0)
    assert compute_metrics(RESULTS, 2.0, {"ttft": 500})["good_requests"] == 3
    assert compute_metrics(RESULTS, 2.0, {"tpot": 50})["good_requests"] == 3
    assert compute_metrics(RESULTS, 2.0, {"e2el": 650})["good_requests"] == 2
    assert compute_metrics(RESULTS, 2.0, {"ttft": 1e9, "tpot": 1e9})["good_requests"] == 4
    assert "request_goodput" not in compute_metrics(RESULTS, 2.0)


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "ttft:-5", "ttft:0", "latency:5", "tpot:x"])
def test_a_malformed_goodput_bound_is_a_usage_error(bad):
    with pytest.raises(UsageError, match="--goodput"):
        parse_goodput(["tpot:50", bad])


# --- the HTTP client's SSE reader --------------------------------------------------------------


def test_sse_events_split_across_reads_come_out_whole():
    from memstep.cli.bench_openai import Streamed, _take_events, split_events

    body = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\r\n\r\n'
    body += b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    body += b"data: [DONE]"  # a last event without its blank line
    out, tail = Streamed(0.0), b""
    for i in range(0, len(body), 7):  # reads that end mid-event
        events, tail = split_events(tail + body[i : i + 7])
        _take_events(out, events, chat=False)
    _take_events(out, [tail], chat=False)
    assert len(out.arrivals) == 2 and (out.prompt_tokens, out.completion_tokens) == (3, 2)
