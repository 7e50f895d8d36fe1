"""The capture phase on CUDA: one CUDA graph per decode batch size, replayed while serving.

Decode-only steps (every sequence feeds one token) are padded up to the nearest captured size
and replayed from the graph captured for it; so are speculative verify steps, whose feeds (a
token and its drafts) become a row per token, each attending up to its own position. Prefill
and mixed steps run eagerly (or through the piecewise graphs). After every
step whose sequences sampled, the decode step after it is replayed ahead, before its plan
comes (`run_ahead`, `decode_ahead.py`): the next plan's decodes that it ran are taken from it,
and only the rest (a mixed step's prompt chunks) runs once the plan comes. Graphs are
captured largest first into one shared memory pool, each after an eager warm-up on the capture
stream. Capture empties the allocator cache (torch does it before every capture), so
everything serving allocates is warmed again afterwards: the eager worst-case shapes and the
sampler at every captured size, into its persistent buffers.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import structlog
import torch

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.core.shapes import cdiv, max_blocks_per_seq
from memstep.events.plan import PhaseFigures, SeqPlan
from memstep.executors.cuda.decode import DecodeForward, DecodeInputs
from memstep.executors.cuda.decode_ahead import Ahead
from memstep.executors.cuda.kernels import paged_decode_attention
from memstep.executors.cuda.piecewise import PiecewiseRunner
from memstep.executors.model.llama import LlamaModel
from memstep.executors.runtime.batch_builder import Feed, build_batch
from memstep.executors.runtime.memory_plan import MemoryPlan, worst_case_prefill
from memstep.executors.runtime.sampler import PendingTokens, Row, Sampler, to_device, top_logprobs

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = structlog.get_logger("memstep.executor")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including `max_num_seqs`."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class GraphRunner:
    """Owns the static decode inputs, the decode forward and one graph per captured size.

    `run` fills the inputs from a step's feeds and replays (or, with graphs off, runs eagerly);
    the returned hidden states are a view of a static buffer, valid until the next `run` or
    `run_ahead`.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_model_len: int,
        lookahead: int,
        block_size: int,
    ):
        device = model.w["embed"].device
        self.model, self.kv, self.device = model, kv_caches, device
        self.sizes = capture_sizes(max_num_seqs)
        max_blocks = max_blocks_per_seq(max_model_len, lookahead, block_size)
        self.inputs = DecodeInputs(max_num_seqs, max_blocks, block_size, device)
        self.decode = DecodeForward(model, kv_caches, self.inputs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: _POOL_HANDLE | None = None  # the graphs' shared memory pool
        self.num_replays = 0
        self.ahead: Ahead | None = None  # a step replayed before its plan came
        self.num_ahead = self.num_ahead_used = 0  # replayed ahead; of those, used (in part)
        self.num_joins = 0  # steps that took some rows of a replay and ran other feeds
        self.pieces: PiecewiseRunner | None = None  # eager steps' graphs, when configured
        # a verify step's feed (its token and up to `lookahead` drafts) runs as that many
        # decode rows, each attending up to its own position: no eager step per verify, as
        # long as the step's rows fit the largest graph (max_num_seqs)
        self.max_feed_tokens = lookahead + 1

    def forward(self, feeds: Sequence[Feed], ahead: bool) -> tuple[torch.Tensor, list[int]]:
        """`Runner.forward`: the rows a replay ahead ran (with `ahead`), a decode graph for the
        rest where they fit, else the piecewise graphs, else the eager forward."""
        if not ahead:
            self.drop_ahead()
            return self._run_feeds(feeds)
        rows = self.take_ahead(feeds)
        kept = [r for r in rows if r is not None]
        if not kept:
            return self._run_feeds(feeds)
        if len(kept) == len(feeds):
            return self.decode.hidden, kept  # every feed replayed already
        self.keep_ahead(kept)
        rest = [f for f, r in zip(feeds, rows, strict=True) if r is None]
        hidden, rest_rows = self._run_feeds(rest)
        joined = self.join(len(kept), hidden, rest_rows)
        last_rows, num_kept, num_rest = [], 0, len(kept)
        for r in rows:  # the kept rows first, then the others, each feed's in its order
            if r is None:
                last_rows.append(num_rest)
                num_rest += 1
            else:
                last_rows.append(num_kept)
                num_kept += 1
        return joined, last_rows

    def _run_feeds(self, feeds: Sequence[Feed]) -> tuple[torch.Tensor, list[int]]:
        if self.can_run(feeds):
            return self.run(feeds)  # decode-only: a captured graph
        batch, last_rows = build_batch(list(feeds), self.inputs.block_size, self.device)
        if self.pieces is not None and self.pieces.can_run(batch.num_tokens):
            return self.pieces.run(batch), last_rows  # a view of a static buffer, as a graph's
        return self.model.forward(batch, self.kv), last_rows

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def can_run(self, feeds: Sequence[Feed]) -> bool:
        return self.inputs.fits(feeds, self.max_feed_tokens)

    def run(self, feeds: Sequence[Feed]) -> tuple[torch.Tensor, list[int]]:
        """Hidden states [rows, hidden] of a step whose feeds each fit `max_feed_tokens`, a row
        per fed token in order, and each feed's last row (0..n-1 for a decode step)."""
        last_rows = list(itertools.accumulate(len(tokens) for _, tokens in feeds))
        n = last_rows[-1]
        bs = self.padded_size(n)
        self.inputs.fill(feeds, bs)
        graph = self.graphs.get(bs)
        if graph is None:
            self.decode(bs)
        else:
            graph.replay()
            self.num_replays += 1
        return self.decode.hidden[:n], [row - 1 for row in last_rows]

    def take_ahead(self, feeds: Sequence[Feed]) -> list[int | None]:
        """Each feed's row of the step replayed ahead (None: not run there), and that replay
        forgotten: its rows are valid until the next `run` or `run_ahead`."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return [None] * len(feeds)
        rows = ahead.rows(feeds, self.inputs.block_size)
        if any(r is not None for r in rows):
            self.num_ahead_used += 1
        return rows

    def keep_ahead(self, rows: list[int]) -> None:
        """Copy `rows` of the replay ahead to rows 0.. of the static `joined` buffer, before a
        forward of the plan's other feeds reuses the decode buffers (the device runs in order)."""
        out = self.decode.joined
        torch.index_select(
            self.decode.hidden, 0, to_device(rows, out.device, torch.int64), out=out[: len(rows)]
        )

    def join(self, num_kept: int, rest: torch.Tensor, rest_rows: list[int]) -> torch.Tensor:
        """The `num_kept` rows of `keep_ahead`, then `rest_rows` of `rest` (the hidden states
        of the other feeds' forward): a view of `joined`, valid until the next `join`."""
        self.num_joins += 1
        out = self.decode.joined[: num_kept + len(rest_rows)]
        torch.index_select(
            rest, 0, to_device(rest_rows, out.device, torch.int64), out=out[num_kept:]
        )
        return out

    def drop_ahead(self) -> None:
        """A step that does not run here (speculative) makes any replay ahead stale."""
        self.ahead = None

    def run_ahead(self, feeds: Sequence[Feed], tokens: PendingTokens) -> None:
        """Replay the decode step after `feeds` (just run here, all sampling, whose samples are
        `tokens`, still on the device): the same sequences, each fed its sampled token at the
        position after its last fed one. The next plan's feeds that are those take their rows
        from it (`take_ahead`). Each next position must lie in the sequence's pages already: a
        replay never writes KV outside what its request owns."""
        n = len(feeds)
        bs = self.padded_size(n)
        graph = self.graphs.get(bs)
        width = self.inputs.max_blocks * self.inputs.block_size
        starts = [seq.start_pos + len(fed) for seq, fed in feeds]
        tables = [seq.block_table for seq, _ in feeds]
        block = self.inputs.block_size
        if graph is None or any(
            p >= width or p // block >= len(t) or len(t) > self.inputs.max_blocks
            for p, t in zip(starts, tables, strict=True)
        ):
            return
        self.inputs.write([0] * n, starts, tables, bs)
        self.inputs.ids[:n].copy_(tokens.device)
        graph.replay()
        self.num_replays += 1
        self.num_ahead += 1
        slots = self.inputs.host_slots[:n].tolist()
        self.ahead = Ahead([seq.request_id for seq, _ in feeds], starts, slots, tokens.host)

    def capture(self) -> dict:
        """Capture every size, largest first, into one pool, then the piecewise graphs of
        eager steps (`pieces`, if any) into the same pool; figures for the phase reply."""
        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        info: dict = {}
        # NCCL's watchdog thread queries the events of earlier collectives while we capture: a
        # global capture would count those calls against it and fail
        mode = "global" if self.decode.model.ranks is None else "thread_local"
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                self.inputs.fill_padding(bs)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self.decode(bs)  # warm-up: compile, tune, allocate outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    graph, pool=self.pool, stream=stream, capture_error_mode=mode
                ):
                    self.decode(bs)  # with tensor parallelism, its NCCL all-reduces too
                self.graphs[bs] = graph
        torch.cuda.synchronize()
        info["graph_capture_seconds"] = round(time.perf_counter() - start, 3)
        if self.pieces is not None:
            info |= self.pieces.capture(self.pool, stream)
        return info | {
            "graph_sizes": list(self.sizes),
            "graph_pool_bytes": torch.cuda.memory_allocated() - before,
        }

    def eager_attention(self):
        """The eager path's decode-attention hook, with this runner's preallocated workspace."""
        return functools.partial(paged_decode_attention, workspace=self.decode.workspace)


# --- the phase -----------------------------------------------------------------------------


def capture_phase(
    cfg: EngineConfig,
    model: LlamaModel,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    sampler: Sampler,
    max_len: int,
    dummy_hidden: torch.Tensor,
) -> tuple[GraphRunner, PhaseFigures]:
    """Build the decode runner and capture its graphs (`cuda_graphs=False` keeps the fused
    decode but runs it eagerly) and, with `piecewise_graphs` on one rank, the eager steps'
    piecewise graphs; point the model's eager decode attention at the runner's
    workspace, then warm every shape serving allocates; `dummy_hidden` ([max_num_seqs, hidden],
    the capture kind's) is the decode batch the sampler is warmed from."""
    lookahead = cfg.num_lookahead_slots
    runner = GraphRunner(model, kv, cfg.max_num_seqs, max_len, lookahead, cfg.block_size)
    info: dict = {"graph_static_bytes": runner.decode.nbytes}
    if cfg.cuda_graphs and cfg.piecewise_graphs and model.ranks is None:
        runner.pieces = PiecewiseRunner(model, kv, cfg.max_num_batched_tokens)
    if cfg.cuda_graphs:
        info |= runner.capture()
    info["decode_ahead"] = cfg.cuda_graphs and cfg.decode_ahead  # the core reserves for it
    model.backend.use_decode_attention(runner.eager_attention())
    with torch.inference_mode():
        warm_eager(cfg, model, kv, max_len)
        warm_sampler(model, sampler, runner.sizes, dummy_hidden)
    torch.cuda.synchronize()
    log.info("capture", **info)
    return runner, PhaseFigures(**info)


def with_peaks(
    figures: PhaseFigures, device: torch.device, memory_plan: MemoryPlan | None
) -> PhaseFigures:
    """`figures` with the device's peaks since start-up and the plan's prediction."""
    return attrs.evolve(
        figures,
        predicted_peak_bytes=memory_plan.predicted_peak_bytes if memory_plan is not None else 0,
        measured_peak_bytes=torch.cuda.max_memory_allocated(device),
        reserved_peak_bytes=torch.cuda.max_memory_reserved(device),
    )


def peak_figures(figures: PhaseFigures) -> dict:
    """The peaks of `figures` as the "memory after capture" log line and the benchmarks give
    them."""
    return {
        "predicted_peak_bytes": figures.predicted_peak_bytes,
        "measured_peak_bytes": figures.measured_peak_bytes,
        "peak_error": figures.peak_error,
        "reserved_peak_bytes": figures.reserved_peak_bytes,
        "reserved_within_plan": figures.reserved_within_plan,
    }


def warm_eager(
    cfg: EngineConfig, model: LlamaModel, kv: list[tuple[torch.Tensor, torch.Tensor]], max_len: int
) -> None:
    """The eager shapes serving will see, so that serving finds every allocator segment it
    needs: the profile's worst case (`worst_case_prefill`), one chunk of each size class (small
    activations come from the allocator's small pool), budgets of equal short chunks, and
    decodes next to a prefill. No request holds KV pages yet, so any page may be written."""
    budget, device = cfg.max_num_batched_tokens, kv[0][0].device
    largest = min(budget, max_len)
    shapes = [worst_case_prefill(cfg, max_len)]
    sizes = sorted({min(largest, int(2 ** (i / 2))) for i in range(2 * largest.bit_length())})
    shapes += [worst_case_prefill(cfg, max_len, n) for n in sizes if n > 1]
    shapes += [worst_case_prefill(cfg, max_len, budget, n) for n in (16, 128, 512) if n < largest]
    shapes += decodes_beside_prefill(cfg, max_len, shapes[0][0].block_table)
    num_pages = kv[0][0].shape[0]
    for seqs in shapes:
        feeds = [(folded(seq, num_pages), seq.token_ids) for seq in seqs]
        batch, last_rows = build_batch(feeds, cfg.block_size, device)
        logits = model.logits(model.forward(batch, kv)[last_rows])
        top_logprobs(logits.clone(), [0] * len(last_rows), 1)


def folded(seq: SeqPlan, num_pages: int) -> SeqPlan:
    """`seq` with its pages folded into a cache of `num_pages` (one smaller than a `max_len`
    context: `num_kv_blocks` set low): warm-up's writes may land on any page, never past the
    cache's end."""
    if max(seq.block_table, default=0) < num_pages:
        return seq
    return attrs.evolve(seq, block_table=[page % num_pages for page in seq.block_table])


def decodes_beside_prefill(
    cfg: EngineConfig, max_len: int, pages: list[int]
) -> list[list[SeqPlan]]:
    """Mixed steps: 1, 7, 31 and `max_num_seqs - 1` decodes (split-K and not) beside a prefill,
    at contexts of one page, nine pages and `max_len`, so that the eager decode kernel meets
    every launch variant (block-table width, split or not) before serving does."""
    block, budget = cfg.block_size, cfg.max_num_batched_tokens
    contexts = sorted({min(max_len, block), min(max_len, 9 * block), max_len})
    shapes = []
    for k in sorted({1, 7, 31, cfg.max_num_seqs - 1}):
        if not (0 < k < budget and k < cfg.max_num_seqs):
            continue
        for ctx in contexts:
            table = pages[: cdiv(ctx, block)]
            decodes = [
                SeqPlan(
                    request_id=f"d{i}",
                    start_pos=ctx - 1,
                    token_ids=[0],
                    block_table=table,
                    samples=True,
                    num_drafts=0,
                    prompt_len=ctx,
                )
                for i in range(k)
            ]
            shapes.append(decodes + worst_case_prefill(cfg, max_len, min(128, budget - k)))
        if k == cfg.max_num_seqs - 1:
            shapes.append(decodes + worst_case_prefill(cfg, max_len, budget - k))
    return shapes


def warm_sampler(
    model: LlamaModel, sampler: Sampler, sizes: list[int], dummy_hidden: torch.Tensor
) -> None:
    """The head and the sampler at every captured size, from the dummy decode batch
    `dummy_hidden` (seeded noise), into the sampler's persistent buffers: every filter on (and a
    greedy row with penalties, and logprobs) at the sizes that meet the filters' allocations
    (`Sampler.warm_sizes`, and the largest), a constrained step's bitmask (allowing all) and the
    all-greedy shortcut at every size. Penalties allocate per row, not per batch, and biases
    and bans one indexed write a batch: one such row is enough."""
    noise = torch.Generator(device=dummy_hidden.device).manual_seed(0)
    torch.randn(dummy_hidden.shape, generator=noise, out=dummy_hidden)
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, logprobs=2, seed=0),
        SamplingParams(
            temperature=0.0,
            repetition_penalty=1.1,
            frequency_penalty=0.1,
            logit_bias={5: 1.0},
            min_tokens=4,
            seed=0,
        ),
    ]
    most = min(sampler.max_rows, dummy_hidden.shape[0])
    filtered = {min(n, most) for n in [*sampler.warm_sizes(), max(sizes)]}
    greedy = Row(SamplingParams(temperature=0.0, seed=0), 3, [1, 2, 3], 1)
    for n in sorted({min(n, most) for n in sizes} | filtered):
        logits = model.logits(dummy_hidden[:n], sampler.logits_out(n))
        raw = sampler.keep_raw(logits)
        tokens = None
        if n in filtered:  # the filters' allocations depend on the rows of a pass only
            # one penalised, biased and short of its min_tokens (its stop id banned)
            rows = [Row(params[int(i == 1)], 3, [1, 2, 3], 1, stops=(2,)) for i in range(n)]
            tokens = sampler.sample(sampler.distribution(logits, rows), rows)
            logits = model.logits(dummy_hidden[:n], sampler.logits_out(n))  # filtered in place
        sampler.warm_mask(logits)
        picked = sampler.sample_logits(logits, [greedy] * n).tolist()  # the all-greedy shortcut
        top_logprobs(raw, tokens or picked, 2, in_place=True)
