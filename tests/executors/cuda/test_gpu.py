"""The CUDA executor on a real GPU: parity with Hugging Face, graphs against eager, memory after
capture, and the planted leaks. CPU runs skip this module; on a GPU machine:

    python -m pytest -q -m gpu tests/executors/cuda/test_gpu.py
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from half_schemas import check_constrained, half_schemas

from memstep.cli.traffic import random_params, rising_waves
from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events.plan import SeqPlan
from memstep.events.types import LeakSuspected, StepFinished, is_leak
from memstep.executors.cuda.decode import DecodeInputs
from memstep.executors.cuda.decode_ahead import Ahead
from memstep.executors.process.inprocess import local_engine
from memstep.executors.spec.eagle import SMOLLM2_HEAD

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SMOL = "random:smollm2-135m"
NEW_TOKENS = 64


def make_engine(dtype: str, sinks=(), **overrides) -> Engine:
    base = dict(
        model=SMOL,
        dtype=dtype,
        max_num_seqs=8,
        max_model_len=512,
        num_kv_blocks=1024,
        max_num_batched_tokens=512,
    )
    return local_engine(EngineConfig(**(base | overrides)), sinks=sinks)


def release(engine: Engine) -> None:
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def fp32_engine():
    engine = make_engine("float32")
    yield engine
    release(engine)


@pytest.fixture(scope="module")
def bf16_engine():
    engine = make_engine("bfloat16")
    yield engine
    release(engine)


def hf_model_of(engine: Engine, dtype: torch.dtype | None = None):
    pytest.importorskip("transformers")
    from memstep.executors.model.hf_reference import hf_llama

    worker = engine.executor.worker
    weights = worker.weights
    if dtype is not None:
        weights = {name: t.to(dtype) for name, t in weights.items()}
    return hf_llama(weights, worker.model_cfg)


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


# --- correctness -------------------------------------------------------------------------------


def test_greedy_matches_transformers_fp32_in_one_batch(fp32_engine):
    worker = fp32_engine.executor.worker
    assert worker.graphs is not None and worker.graphs.graphs, "decode graphs were captured"
    prompts = random_prompts([3, 9, 17, 26, 38, 51, 77, 120], worker.model_cfg.vocab_size, 1)
    replays = worker.graphs.num_replays

    ours = fp32_engine.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )

    assert worker.graphs.num_replays - replays >= NEW_TOKENS - 1, "decode ran from graphs"
    hf = hf_model_of(fp32_engine)
    for prompt, done in zip(prompts, ours, strict=True):
        assert done.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


def _feeds(prompts, conts, step: int, block_size: int, pages_per_seq: int):
    """Step 0 prefills each prompt; step j > 0 feeds cont[j-1] at its position."""
    feeds = []
    for i, (prompt, cont) in enumerate(zip(prompts, conts, strict=True)):
        table = list(range(i * pages_per_seq, (i + 1) * pages_per_seq))
        tokens = prompt if step == 0 else [cont[step - 1]]
        start = 0 if step == 0 else len(prompt) + step - 1
        seq = SeqPlan(f"s{i}", start, tokens, table, True, 0, len(prompt))
        feeds.append((seq, tokens))
    return feeds


def our_logits(engine: Engine, prompts, conts) -> list[torch.Tensor]:
    """[num_seqs, vocab] fp32 logits after the prefill and after each teacher-forced decode."""
    worker = engine.executor.worker
    pages = -(-(max(map(len, prompts)) + len(conts[0]) + 1) // worker.cfg.block_size)
    steps = []
    with torch.inference_mode():
        for step in range(len(conts[0]) + 1):
            feeds = _feeds(prompts, conts, step, worker.cfg.block_size, pages)
            assert worker.graphs.can_run(feeds) == (step > 0)
            hidden, last_rows = worker.forward(feeds)
            steps.append(worker.model.logits(hidden[last_rows]).float())
    return steps


def hf_logits(model, prompts, conts) -> list[torch.Tensor]:
    rows: list[list[torch.Tensor]] = [[] for _ in range(len(conts[0]) + 1)]
    with torch.inference_mode():
        for prompt, cont in zip(prompts, conts, strict=True):
            ids = torch.tensor([prompt + cont], device="cuda")
            logits = model(ids).logits[0].float()
            for step in range(len(cont) + 1):
                rows[step].append(logits[len(prompt) - 1 + step])
    return [torch.stack(r) for r in rows]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


BF16_LOGITS_TOLERANCE = 3e-2  # relative L2 error of bf16 logits against the fp32 reference


def test_bf16_logits_match_fp32_reference_within_tolerance(bf16_engine):
    vocab = bf16_engine.model_cfg.vocab_size
    prompts = random_prompts([5, 23, 40, 61], vocab, 2)
    conts = random_prompts([8] * 4, vocab, 3)

    ours = our_logits(bf16_engine, prompts, conts)

    ref = hf_logits(hf_model_of(bf16_engine, torch.float32), prompts, conts)
    errors = [relative_error(o, r) for o, r in zip(ours, ref, strict=True)]
    print(f"bf16 logits relative error per step (prefill, then decodes): {errors}")
    assert max(errors) < BF16_LOGITS_TOLERANCE


# fp8 K/V (3 mantissa bits) on top of bf16; an fp32 model with an fp8 cache measured 0.045 on CPU
FP8_KV_LOGITS_TOLERANCE = 8e-2


def test_fp8_kv_cache_logits_within_tolerance():
    """bf16 with `kv_cache_dtype="fp8"`: the prefill writes fp8 by the rotary kernel and reads
    it back for attention, the decodes replay graphs whose kernel reads fp8 tiles."""
    engine = make_engine("bfloat16", kv_cache_dtype="fp8")
    try:
        assert engine.executor.worker.kv[0][0].dtype == torch.float8_e4m3fn
        vocab = engine.model_cfg.vocab_size
        prompts = random_prompts([5, 23, 40, 61], vocab, 2)
        conts = random_prompts([8] * 4, vocab, 3)

        ours = our_logits(engine, prompts, conts)

        ref = hf_logits(hf_model_of(engine, torch.float32), prompts, conts)
        errors = [relative_error(o, r) for o, r in zip(ours, ref, strict=True)]
        print(f"fp8 KV logits relative error per step (prefill, then decodes): {errors}")
        assert max(errors) < FP8_KV_LOGITS_TOLERANCE
    finally:
        release(engine)


def test_fp32_prefill_and_graph_decode_logits_match_reference(fp32_engine):
    vocab = fp32_engine.model_cfg.vocab_size
    prompts = random_prompts([5, 23, 40], vocab, 4)
    conts = random_prompts([6] * 3, vocab, 5)

    ours = our_logits(fp32_engine, prompts, conts)

    ref = hf_logits(hf_model_of(fp32_engine), prompts, conts)
    errors = [relative_error(o, r) for o, r in zip(ours, ref, strict=True)]
    assert max(errors) < 1e-4, errors


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128)])
def test_packed_queries_by_varlen_flash_match_each_sequence_alone(heads, kv_heads, dim):
    """A bf16 step's packed group (a verify, a fresh prompt, a chunk continuing 100 cached
    tokens, decodes between them; SmolLM2's and Llama-3.1-8B's head shapes) by one flash
    call equals float32 attention of each sequence alone with its mask."""
    from memstep.events.plan import SeqPlan
    from memstep.executors.model.attention import PackedGroup, attention, has_varlen_flash
    from memstep.executors.runtime.batch_builder import build_batch

    assert has_varlen_flash()
    block = 16
    lens = [("d0", 40, 1), ("v0", 30, 4), ("f0", 0, 37), ("d1", 9, 1), ("c0", 100, 64)]
    feeds, page = [], 0
    for name, start, n in lens:
        pages = list(range(page, page + (start + n + block - 1) // block))
        page += len(pages)
        feeds.append((SeqPlan(name, start, [1] * n, pages, True, 0, start + n), [1] * n))
    batch, _ = build_batch(feeds, block, torch.device("cuda"))
    assert isinstance(batch.groups[-1], PackedGroup) and batch.groups[-1].first_row == -1
    torch.manual_seed(0)
    cache = (page, block, kv_heads, dim)
    k_cache = torch.randn(cache, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(cache, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch.num_tokens, heads, dim, device="cuda", dtype=torch.bfloat16)

    flash = attention(q, k_cache, v_cache, batch, dim**-0.5, device_kernels=True)
    alone = attention(q.float(), k_cache.float(), v_cache.float(), batch, dim**-0.5)

    packed = batch.groups[-1].rows
    assert relative_error(flash[packed].float(), alone[packed]) < 1e-2


@pytest.mark.parametrize("engine_name", ["fp32_engine", "bf16_engine"])
def test_graph_replay_equals_eager_decode(engine_name, request):
    engine = request.getfixturevalue(engine_name)
    worker = engine.executor.worker
    runner = worker.graphs
    vocab = engine.model_cfg.vocab_size
    prompts = random_prompts([7, 30, 19], vocab, 6)
    conts = random_prompts([1] * 3, vocab, 7)
    pages = 4
    with torch.inference_mode():
        worker.forward(_feeds(prompts, conts, 0, worker.cfg.block_size, pages))
        feeds = _feeds(prompts, conts, 1, worker.cfg.block_size, pages)
        k_before = worker.kv[0][0].clone()

        graphed = worker.model.logits(runner.run(feeds)[0]).clone()  # padded to 4 rows
        assert runner.padded_size(3) == 4 and 4 in runner.graphs
        runner.inputs.fill(feeds, 4)
        eager_same_kernels = worker.model.logits(runner.decode(4)[:3]).clone()
        worker.graphs = None  # the torch path of the model itself
        try:
            hidden, last_rows = worker.forward(feeds)
        finally:
            worker.graphs = runner
        eager_torch = worker.model.logits(hidden[last_rows])

    assert torch.equal(graphed, eager_same_kernels)
    tolerance = 1e-5 if engine.executor.worker.dtype == torch.float32 else 2e-2
    assert relative_error(graphed, eager_torch) < tolerance
    # only the three decoded slots of the KV cache changed: padding rows wrote nothing
    changed = (worker.kv[0][0] != k_before).any(dim=-1).any(dim=-1).nonzero().tolist()
    slots = sorted(page * worker.cfg.block_size + off for page, off in changed)
    expected = sorted(
        seq.block_table[seq.start_pos // worker.cfg.block_size] * worker.cfg.block_size
        + seq.start_pos % worker.cfg.block_size
        for seq, _ in feeds
    )
    assert slots == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_piecewise_graphs_equal_the_eager_forward_of_a_mixed_step(dtype):
    """Two decodes beside a continued 20-token chunk (22 tokens, the 32 bucket's graphs):
    logits through the captured pieces equal the eager forward's within the dtype's
    tolerance, and every bucket was captured, L + 1 graphs each."""
    engine = make_engine(dtype, piecewise_graphs=True)
    try:
        worker = engine.executor.worker
        pieces = worker.graphs.pieces
        assert sorted(pieces.graphs) == pieces.sizes
        assert all(len(g) == worker.model.num_layers + 1 for g in pieces.graphs.values())
        vocab, block = engine.model_cfg.vocab_size, worker.cfg.block_size
        prompts = random_prompts([7, 30, 19], vocab, 6)
        conts = random_prompts([1, 1, 20], vocab, 7)
        feeds = []  # two decodes and a 20-token chunk, at the end of each prompt
        for i, (prompt, cont) in enumerate(zip(prompts, conts, strict=True)):
            table = list(range(4 * i, 4 * i + 4))
            seq = SeqPlan(f"s{i}", len(prompt), cont, table, True, 0, len(prompt))
            feeds.append((seq, cont))
        with torch.inference_mode():
            worker.forward(_feeds(prompts, conts, 0, block, 4))
            assert sum(len(t) for _, t in feeds) == 22 and pieces.padded_size(22) == 32
            runs = pieces.num_runs
            hidden, rows = worker.forward(feeds)
            graphed = worker.model.logits(hidden[rows]).clone()
            assert pieces.num_runs == runs + 1
            worker.graphs.pieces = None
            try:
                hidden, rows = worker.forward(feeds)
            finally:
                worker.graphs.pieces = pieces
            eager = worker.model.logits(hidden[rows])
        tolerance = 1e-5 if dtype == "float32" else 2e-2
        assert relative_error(graphed, eager) < tolerance
    finally:
        release(engine)


def staggered_tokens(engine: Engine, num_requests: int, seed: int) -> dict[str, list[int]]:
    """Requests with random sampling and lengths, one joining every fifth step; the tokens
    each one got."""
    rng = random.Random(seed)
    vocab = engine.model_cfg.vocab_size
    queue = [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))], random_params(rng))
        for _ in range(num_requests)
    ]
    tokens: dict[str, list[int]] = {}
    step = 0
    while queue or engine.has_work():
        if queue and step % 5 == 0:
            prompt, params = queue.pop()
            engine.add_request(prompt, params, request_id=f"r{len(queue)}")
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("broken", [False, True])
def test_decode_ahead_changes_no_token(dtype, broken, monkeypatch):
    """The decode step replayed ahead, whether its plan takes all its rows, some (beside a new
    prompt's chunk, without a finished request) or none, leaves every request the tokens of
    running each step when its plan comes. Broken on purpose, by taking the replay's rows in
    order whatever the plan, the comparison fails."""
    if broken:

        def rows(self, feeds, block_size):
            return [i if i < len(self.request_ids) else None for i in range(len(feeds))]

        monkeypatch.setattr(Ahead, "rows", rows)
    runs: dict[bool, dict[str, list[int]]] = {}
    for ahead in (True, False):
        engine = make_engine(dtype, decode_ahead=ahead)
        try:
            runs[ahead] = staggered_tokens(engine, 40, seed=12)
            runner = engine.executor.worker.graphs
            if ahead:
                launched, used, joins = runner.num_ahead, runner.num_ahead_used, runner.num_joins
            else:
                assert runner.num_ahead == 0
        finally:
            release(engine)
    assert 0 < used < launched  # replays used, and replays dropped
    assert 0 < joins < used  # replays used in part, beside other feeds, and whole
    assert len(runs[False]) == 40
    assert (runs[True] == runs[False]) is not broken


# --- speculation -------------------------------------------------------------------------------

EAGLE_HEAD = str(SMOLLM2_HEAD)


def spec_run(method: str | None) -> tuple[dict[str, list[int]], list[StepFinished], int]:
    """4 greedy requests of 48 tokens (prompts that repeat themselves, so that n-grams draft),
    K = 2: each request's tokens, the steps, and the decode graphs' replays. 16 sequences a
    step, so that a verify step's 12 rows fit the decode graphs."""
    records: list[StepFinished] = []
    sink = lambda rec: records.append(rec) if isinstance(rec, StepFinished) else None  # noqa: E731
    spec = {} if method is None else {"speculative_method": method, "num_speculative_tokens": 2}
    if method == "eagle":
        spec["draft_model"] = EAGLE_HEAD
    engine = make_engine("float32", sinks=[sink], max_num_seqs=16, **spec)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        prompts = [p * 3 for p in random_prompts([7, 9, 11, 13], engine.model_cfg.vocab_size, 5)]
        done = engine.generate(prompts, params)
        tokens = {f"p{i}": c.token_ids for i, c in enumerate(done)}
        return tokens, records, engine.executor.worker.graphs.num_replays
    finally:
        release(engine)


@pytest.mark.parametrize("method", ["ngram", "eagle"])
@pytest.mark.parametrize("broken", [False, True])
def test_verify_steps_replay_the_decode_graphs_and_change_no_token(method, broken, monkeypatch):
    """A spec step's verify forward (each request's token and its drafts) runs as rows of a
    decode graph, a row per token attending up to its own position; in float32 every request
    gets the tokens of plain decoding. Broken on purpose (every row of a feed at the feed's
    first position, as if the offset were dropped), the tokens part."""
    plain, _, _ = spec_run(None)
    if broken:

        def fill(self, feeds, bs):
            ids = [t for _, tokens in feeds for t in tokens]
            starts = [seq.start_pos for seq, tokens in feeds for _ in tokens]
            tables = [seq.block_table for seq, tokens in feeds for _ in tokens]
            self.write(ids, starts, tables, bs)

        monkeypatch.setattr(DecodeInputs, "fill", fill)
    tokens, records, replays = spec_run(method)
    spec_steps = [r for r in records if r.kind == "spec"]
    assert sum(r.num_proposed for r in spec_steps) > 0
    assert replays >= len(spec_steps) - 1  # every step but the prompts' ran a graph
    if method == "ngram":
        assert sum(r.num_accepted for r in spec_steps) > 0
    assert (tokens == plain) is not broken


# --- memory ------------------------------------------------------------------------------------


def allocator_figures() -> tuple[int, int]:
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    return stats["segment.all.current"], stats["reserved_bytes.all.current"]


@pytest.mark.parametrize("schemas", [False, True])
@pytest.mark.parametrize("piecewise", [False, True])
def test_reserved_memory_after_warmup_and_capture_is_within_the_plan(piecewise, schemas):
    """Warm-up runs every shape serving allocates for (short chunks at the end of long
    contexts among them, whose packed attention gathers the most keys): the allocator's
    reserved peak stays within the profile's predicted peak, with the piecewise graphs' pool
    and buffers too. The executor runs in a process of its own, as served: this one's CUDA
    memory (other tests' engines) is not its. With `schemas`, traffic where half the requests
    carry a JSON schema is served after capture first (`_serve_half_schemas`); SmolLM2's
    tokenizer on the random model, since the grammars need JSON's tokens."""
    from memstep.core.model_source import shipped_gguf_path
    from memstep.executors.process.remote import ProcessExecutor

    cfg = EngineConfig(
        model=SMOL,
        tokenizer=str(shipped_gguf_path()) if schemas else None,
        dtype="bfloat16",
        max_num_seqs=32,
        max_model_len=512,
        num_kv_blocks=1024,
        piecewise_graphs=piecewise,
    )
    records: list = []
    engine = Engine(cfg, ProcessExecutor, sinks=[records.append])
    try:
        figures = engine.captured
        if schemas:
            _serve_half_schemas(engine, records, figures.predicted_peak_bytes)
        assert figures.reserved_peak_bytes <= figures.predicted_peak_bytes, figures
        assert figures.reserved_within_plan
    finally:
        release(engine)


@pytest.mark.parametrize("rows", [1, 42, 64])
def test_a_filter_pass_allocates_no_more_than_the_plan_adds_for_it(rows):
    """The sort of a top-p/top-k pass allocates scratch outside the sampler's buffers; the
    memory plan adds `filter_scratch_bytes` for it. The bound holds at one row, at a whole
    pass, and at more rows than one pass takes (two passes, one after the other)."""
    from memstep.executors.runtime.sampler import Row, Sampler, filter_scratch_bytes

    vocab = 49152
    sampler = Sampler(64, vocab, torch.device("cuda"), in_place_logits=True)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=0)
    logits = torch.randn(rows, vocab, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sampler.distribution(logits, [Row(params, 3, [1, 2, 3], 1) for _ in range(rows)])
    torch.cuda.synchronize()
    scratch = torch.cuda.max_memory_allocated() - base
    assert 0 < scratch <= filter_scratch_bytes(64, vocab), scratch


GRID = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "grid": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "maxItems": 6,
        },
        "note": {"type": "string", "maxLength": 24},
    },
    "required": ["color", "grid", "note"],
    "additionalProperties": False,
}


def _serve_half_schemas(engine: Engine, records: list, predicted: int) -> None:
    """48 requests, the odd ones with `GRID` (the bitmask filled on the host, copied to its
    device buffer and applied every step): every step's reserved bytes and allocator segments
    stay those of the first, within the plan, with no leak report, and each constrained text
    validates."""
    done = engine.generate(*half_schemas(48, GRID, 120))
    check_constrained(done, GRID)
    steps = [r.memory for r in records if isinstance(r, StepFinished)]
    assert len(steps) > 20
    shape = {(m.reserved_bytes, m.num_segments) for m in steps}
    assert shape == {(steps[0].reserved_bytes, steps[0].num_segments)}, shape
    assert [r for r in records if is_leak(r)] == []
    assert steps[0].reserved_bytes <= predicted, (steps[0].reserved_bytes, predicted)


@pytest.mark.parametrize("piecewise", [False, True])
def test_no_new_allocator_segments_after_warmup_and_capture(piecewise):
    leaks: list[LeakSuspected] = []
    sink = lambda rec: leaks.append(rec) if is_leak(rec) else None  # noqa: E731
    engine = make_engine("bfloat16", sinks=[sink], max_num_seqs=32, piecewise_graphs=piecewise)
    try:
        segments, reserved = allocator_figures()

        steps = rising_waves(engine, num_requests=400, max_concurrency=32, seed=8)

        assert steps > 300
        runner = engine.executor.worker.graphs
        assert runner.num_replays > steps // 2
        assert (runner.pieces is not None and runner.pieces.num_runs > 10) is piecewise
        assert allocator_figures() == (segments, reserved)
        assert leaks == []
    finally:
        release(engine)


@pytest.mark.parametrize("plant", ["no_spec_hidden_states", "sampler_scratch"])
def test_planted_leaks_are_flagged_on_the_gpu(plant):
    leaks: list[LeakSuspected] = []
    sink = lambda rec: leaks.append(rec) if is_leak(rec) else None  # noqa: E731
    engine = make_engine("bfloat16", sinks=[sink], debug_plant_leak=plant)
    try:
        prompts = random_prompts([12] * 4, engine.model_cfg.vocab_size, 9)
        for prompt in prompts:
            engine.add_request(
                prompt, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
            )
        first = engine.step_no
        while engine.has_work() and not leaks:
            engine.step()
        assert leaks, f"{plant} was not flagged"
        assert leaks[0].kind == "no_spec"
        assert leaks[0].step - first <= 50
    finally:
        release(engine)


@pytest.mark.parametrize("plant", ["fragmenting_scratch", None])
def test_planted_fragmentation_is_flagged_as_fragmentation_and_a_clean_run_is_silent(plant):
    leaks: list[LeakSuspected] = []
    sink = lambda rec: leaks.append(rec) if is_leak(rec) else None  # noqa: E731
    engine = make_engine("bfloat16", sinks=[sink], debug_plant_leak=plant)
    try:
        prompts = random_prompts([12, 40, 100, 7], engine.model_cfg.vocab_size, 12)
        for prompt in prompts:
            engine.add_request(
                prompt, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
            )
        first = engine.step_no
        while engine.has_work():
            engine.step()
        if plant is None:
            assert leaks == [], leaks
            return
        assert leaks, "the planted fragmentation was not flagged"
        assert {leak.what for leak in leaks} == {"fragmentation"}, leaks
        assert leaks[0].kind == "no_spec" and leaks[0].step - first <= 50
        assert "segments" in leaks[0].detail and leaks[0].nbytes > 0
    finally:
        release(engine)


def test_spec_disabled_by_batch_size_keeps_memory_allocated_over_each_no_spec_stretch():
    records: list[StepFinished] = []
    sink = lambda rec: records.append(rec) if isinstance(rec, StepFinished) else None  # noqa: E731
    engine = make_engine(
        "bfloat16", sinks=[sink], speculative_method="ngram", speculative_disable_by_batch_size=2
    )
    try:
        vocab = engine.model_cfg.vocab_size
        engine.add_request(
            random_prompts([20], vocab, 10)[0],
            SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True),
        )
        for wave in range(2):
            for _ in range(8):
                engine.step()  # one request alone: spec
            for prompt in random_prompts([15, 30, 45, 60], vocab, 11 + wave):
                engine.add_request(
                    prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
                )
            while len(engine.requests) > 1:
                engine.step()  # five running: no_spec
        while engine.has_work():
            engine.step()

        stretches: list[list[StepFinished]] = []
        for rec in records:
            if rec.kind == "no_spec" and stretches and stretches[-1][-1].step == rec.step - 1:
                stretches[-1].append(rec)
            elif rec.kind == "no_spec":
                stretches.append([rec])
        assert any(rec.kind == "spec" for rec in records)
        assert len(stretches) >= 2 and all(len(s) > 20 for s in stretches[:2])
        for stretch in stretches:
            assert stretch[0].memory.live_bytes == stretch[-1].memory.live_bytes
    finally:
        release(engine)


def test_the_device_memory_read_for_batch_limits_is_the_gpus_and_expandable_segments_are_on():
    from memstep.core.device_limits import cuda_device_bytes, default_limits
    from memstep.core.model_config import PRESETS
    from memstep.executors.runtime.allocator import ALLOC_CONF, user_alloc_conf

    total = torch.cuda.get_device_properties(0).total_memory
    read = cuda_device_bytes("auto")
    assert read is not None and abs(read - total) < 0.02 * total
    limits = default_limits(read, PRESETS["llama-3.1-8b"])
    expected = (1024, 8192) if total >= 70 * 2**30 else (256, 2048)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) <= expected
    engine = make_engine("bfloat16")
    try:
        assert engine.executor.worker.alloc_conf == (user_alloc_conf() or ALLOC_CONF)
    finally:
        release(engine)
