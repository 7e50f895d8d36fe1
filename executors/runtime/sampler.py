"""Turn logits into tokens: penalties, temperature, top-k, top-p, min-p, seeded sampling.

Every large intermediate (probabilities, sorted probabilities, their order, the CDF) lives in a
buffer allocated once for the largest batch the sampler will see, so serving never asks the
allocator for new memory (the sampler-fragmentation incident).  Sampling is by inverse CDF with a
counter-based uniform per (seed, position), so it is batch-independent.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import attrs
import numpy as np
import torch

from memstep.core.sampling_params import SamplingParams
from memstep.executors.runtime.bitmask import bit_values, mask_row
from memstep.executors.runtime.guide import Guide, mask_words, masks_ahead, masks_into
from memstep.executors.runtime.random_stream import SAMPLE, uniforms
from memstep.states.arena import tensor_bytes

FILTER_ELEMENTS = 1 << 21  # elements of the vocabulary a filter pass works on at most
CANDIDATES = 1024  # on the CPU, tokens a top-k or top-p cut is tried on before a whole sort


@attrs.frozen
class Filters:
    """One row's min-p, top-k and top-p, each off (0.0, 0, 1.0) for a greedy row or where the
    request did not ask for it (a top-k of the whole vocabulary included)."""

    min_p: float
    top_k: int
    top_p: float

    @classmethod
    def of(cls, p: SamplingParams, vocab_size: int) -> Filters:
        if p.is_greedy:
            return cls(0.0, 0, 1.0)
        return cls(p.min_p, p.top_k if p.top_k < vocab_size else 0, p.top_p)

    @property
    def active(self) -> bool:
        return self.min_p > 0.0 or self.top_k > 0 or self.top_p < 1.0


@attrs.frozen
class Cuts:
    """The top-k and top-p cut-offs of rows that have one, as tensors on their device."""

    kth_at: torch.Tensor | None  # [m, 1] int64: where the k-th value sits (k - 1; V - 1 if none)
    has_k: torch.Tensor  # [m, 1] bool
    top_p: torch.Tensor | None  # [m, 1] float32 (1.0 where none)

    @classmethod
    def of(cls, part: list[Filters], vocab_size: int, device: torch.device) -> Cuts:
        has_k = torch.tensor([bool(f.top_k) for f in part])[:, None].to(device)
        kth_at = None
        if any(f.top_k for f in part):
            kth = [(f.top_k or vocab_size) - 1 for f in part]
            kth_at = torch.tensor(kth, dtype=torch.long)[:, None].to(device)
        top_p = None
        if any(f.top_p < 1.0 for f in part):
            top_p = to_device([f.top_p for f in part], device)[:, None]
        return cls(kth_at, has_k, top_p)

    def apply(self, vals: torch.Tensor, rows: torch.Tensor) -> bool:
        """Cut `vals` ([m, C], each row's C most probable values of `rows`, sorted) in place:
        top-k keeps the values at least the k-th's, then top-p the smallest prefix whose mass
        reaches top-p of the row's (the kept values' under top-k, else the whole row's in
        vocabulary order; at least one token). Whether every cut fell strictly inside the C
        values, which is always so when C is the vocabulary."""
        m, width = vals.shape
        inside = torch.ones((m, 1), dtype=torch.bool, device=vals.device)
        last = vals[:, -1:].clone()
        if self.kth_at is not None:
            kth = vals.gather(1, self.kth_at.clamp(max=width - 1))
            inside &= ~self.has_k | (self.kth_at < width) & (kth > last)
            vals.masked_fill_(vals < kth, 0.0)
        if self.top_p is not None:
            mass = torch.cumsum(vals, dim=-1)
            total = torch.where(self.has_k, mass[:, -1:], torch.cumsum(rows, dim=-1)[:, -1:])
            at = torch.searchsorted(mass, self.top_p * total)
            every = self.top_p >= 1.0
            at_value = vals.gather(1, at.clamp(max=width - 1))
            inside &= every | (at < width) & (at_value > last)
            cut = at.add_(1).masked_fill_(every, width)
            vals.masked_fill_(torch.arange(width, device=vals.device).expand(m, -1) >= cut, 0.0)
        return width == rows.shape[1] or bool(inside.all())


def top_by_id(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest values and their token ids, by value descending, equal values by
    token id (the order of a stable sort of the whole row)."""
    vals, ids = torch.topk(rows, k, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    vals, order = vals.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order)


@attrs.frozen
class Row:
    """One row of logits to sample: whose, at which position, with which history."""

    params: SamplingParams
    position: int  # position of the token being chosen
    history: list[int]  # prompt + output tokens before this position (for penalties)
    prompt_len: int
    guide: Guide | None = None  # the request's grammar matcher, if it has a constraint
    stops: tuple[int, ...] = ()  # the ids that end it (EOS, stop_token_ids): min_tokens bans them

    @property
    def seed(self) -> int:
        """The request's seed, which the core set (drawn for a request that came without)."""
        if self.params.seed is None:
            raise ValueError("a row to sample has no seed: the core gives every request one")
        return self.params.seed


class Sampler:
    """Owns the persistent sampling buffers, sized for `max_rows` (the memory plan counts them:
    `sampler_bytes`): the logits the head writes into (where it can: `in_place_logits`), a copy
    of them kept for log-probabilities, the filtered distribution, its sorted copy and order,
    and the token bitmask of constrained rows (on the host, where the matchers write it, and on
    the device where that is not the host)."""

    def __init__(
        self,
        max_rows: int,
        vocab_size: int,
        device: torch.device,
        in_place_logits: bool = False,
        filter_elements: int = FILTER_ELEMENTS,
        candidates: int = CANDIDATES,
        mask_threads: int | None = 0,
    ):
        self.max_rows = max_rows
        self.mask_threads = mask_threads  # `EngineConfig.grammar_mask_threads`
        # the next step's masks begun between steps (`mask_ahead`): on a GPU, where the host
        # waits for the core's plan with idle cores; on the CPU the forward pass fills them
        self.masks_ahead = device.type == "cuda"
        self._ahead: Future | None = None
        self.num_ahead_used = 0  # rows masked from `mask_ahead`'s work
        self.vocab_size = vocab_size
        f32 = torch.float32
        shape = (max_rows, vocab_size)
        self.logits = torch.zeros(shape, dtype=f32, device=device) if in_place_logits else None
        self.raw = torch.zeros(shape, dtype=f32, device=device)  # logits, then log-softmax
        self.probs = torch.zeros(shape, dtype=f32, device=device)
        self.sorted = torch.zeros(shape, dtype=f32, device=device)
        self.order = torch.zeros(shape, dtype=torch.long, device=device)
        self.uniforms = torch.zeros(max_rows, dtype=f32, device=device)
        words = (max_rows, mask_words(vocab_size))
        on_gpu = device.type == "cuda"
        # the bitmask's buffers are views of one allocation (`mask_block_bytes`): several small
        # tensors each took an allocator block of their own, reserved past what the plan counts
        self.mask_block = torch.zeros(
            mask_block_bytes(max_rows, vocab_size), dtype=torch.uint8, device=device
        )
        carve = _Carver(self.mask_block)
        # the mask spread out: on a GPU each word's 32 bits (int32), then which tokens are
        # forbidden; on the CPU one row's additive biases (float32, `mask_row`)
        self.bits = carve.take((*words, 32), torch.int32)
        mask = carve.take(words, torch.int32)
        self.bit = carve.take((32,), torch.int32).copy_(bit_values())
        self.forbid = carve.take(shape, torch.bool)
        self.mask_host = torch.zeros(words, dtype=torch.int32, pin_memory=True) if on_gpu else mask
        self.mask = mask if on_gpu else None
        # rows a filter pass works on at once: its scratch is `filter_scratch_bytes`
        self.filter_rows = filter_rows(max_rows, vocab_size, filter_elements)
        self.candidates = min(candidates, vocab_size)  # tokens a CPU cut tries first (`_cut`)

    def warm_sizes(self) -> list[int]:
        """Batch sizes that meet every allocation a `distribution` makes: each row count a filter
        pass can work on, then the most rows (the small per-row vectors at their largest)."""
        return sorted({*range(1, self.filter_rows + 1), self.max_rows})

    @property
    def nbytes(self) -> int:
        bufs = (self.logits, self.raw, self.probs, self.sorted, self.order, self.uniforms)
        return tensor_bytes((*bufs, self.mask_block))

    def logits_out(self, num_rows: int) -> torch.Tensor | None:
        """Where the head may write `num_rows` rows of logits; None where it cannot."""
        return None if self.logits is None else self.logits[:num_rows]

    def keep_raw(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` ([R, V] float32) that the sampler's in-place filters leave alone,
        for log-probabilities: `PendingLogprobs` turns it into their log-softmax in place."""
        return self.raw[: logits.shape[0]].copy_(logits)

    def constrain(self, logits: torch.Tensor, rows: list[Row]) -> None:
        """Tokens the grammar of a constrained row forbids get -inf in `logits` ([R, V]), in
        place; rows without a constraint are left alone, and a batch without any costs a scan
        of `rows`. Each matcher writes its row of the host bitmask. Nothing is asked of the
        allocator: the buffers are the sampler's."""
        guided = [i for i, row in enumerate(rows) if row.guide is not None]
        if not guided:
            return
        if self.mask is None:
            self._constrain_on_host(logits, rows, guided)
        else:
            self._constrain_on_device(logits, rows, guided)

    def mask_ahead(self, rows: list[Row]) -> None:
        """Begin the masks of the step after this one for the constrained `rows` (requests that
        just sampled, their outputs grown by this step's tokens), on a thread of their own while
        the core plans that step; `constrain` waits for them and takes each whose row still
        holds those tokens (`Guide.take_ahead`)."""
        pending = [(row.guide, row.history[row.prompt_len :]) for row in rows if row.guide]
        if not (self.masks_ahead and pending):
            return
        self.join_ahead()
        self._ahead = _ahead_thread().submit(
            masks_ahead, pending, self.mask_host.shape[1], self.mask_threads
        )

    def join_ahead(self) -> None:
        """Wait for `mask_ahead`'s work: the guides are its until then."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            ahead.result()

    def _ready_rows(
        self, rows: list[Row], guided: list[int], words: torch.Tensor
    ) -> list[tuple[Guide, list[int], int]]:
        """Copy into `words` the rows `mask_ahead` made; the others, still to mask."""
        self.join_ahead()
        todo = []
        for i in guided:
            guide, output, _ = _guided(rows[i], i)
            ready = guide.take_ahead(output)
            if ready is None:
                todo.append((guide, output, i))
            else:
                words[i].copy_(ready)
                self.num_ahead_used += 1
        return todo

    def _constrain_on_host(self, logits: torch.Tensor, rows: list[Row], guided: list[int]) -> None:
        """Row by row with numpy, on the calling thread: no torch op, so no wake-up of torch's
        thread pool (whose threads the forward pass's kernels need), and no unpacked mask: each
        byte of the bitmask becomes 8 additive biases (0 or -inf) through a 256-entry table."""
        assert logits.dtype == torch.float32, logits.dtype
        out, words = logits.numpy(), self.mask_host[0]
        bias = self.bits[0].view(torch.float32).numpy().reshape(-1)
        self.join_ahead()  # (`masks_ahead`: off on the CPU unless a test turns it on)
        for i in guided:
            guide, output, _ = _guided(rows[i], i)
            ready = guide.take_ahead(output)
            if ready is None:
                guide.mask_into(output, words)
            else:
                self.num_ahead_used += 1
            mask_row(out[i], (words if ready is None else ready).numpy(), bias)

    def _constrain_on_device(
        self, logits: torch.Tensor, rows: list[Row], guided: list[int]
    ) -> None:
        """The whole batch's bitmask (rows without a constraint allow every token) crosses to
        the device in one copy from pinned memory and is applied by the same ops over the batch,
        whichever rows are constrained: no host sync, no per-row launch; the host fills the
        mask (the matchers in parallel, `masks_into`) while the device runs the forward pass."""
        host = self.mask_host[: logits.shape[0]]
        host.fill_(-1)
        todo = self._ready_rows(rows, guided, host)
        if todo:
            masks_into(todo, host, self.mask_threads)
        self.apply_mask(logits)

    def warm_mask(self, logits: torch.Tensor) -> None:
        """A constrained step's device work with every token allowed (logits unchanged), for
        the warm-up: serving's first constrained step then meets its kernels loaded."""
        if self.mask is not None:
            self.mask_host[: logits.shape[0]].fill_(-1)
            self.apply_mask(logits)

    def apply_mask(self, logits: torch.Tensor) -> None:
        """The device's part of `constrain`: rows 0..R-1 of the host bitmask into the device's
        buffer, then -inf where a bit is 0."""
        r = logits.shape[0]
        assert self.mask is not None, "the bitmask is applied on the device only off the CPU"
        words = self.mask[:r].copy_(self.mask_host[:r], non_blocking=True)
        # words: [r, W] int32 -> bits: [r, W, 32] -> forbid: [r, V] bool, in owned buffers
        bits = torch.bitwise_and(words[:, :, None], self.bit, out=self.bits[:r])
        forbid = torch.eq(bits.view(r, -1)[:, : self.vocab_size], 0, out=self.forbid[:r])
        logits.masked_fill_(forbid, float("-inf"))

    def distribution(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """The filtered distribution each row samples from, in `self.probs[:R]` ([R, V])."""
        r = len(rows)
        assert r <= self.max_rows, f"{r} rows > sampler capacity {self.max_rows}"
        for i, row in enumerate(rows):
            if row.params.has_penalties:
                apply_penalties(logits[i], row)
        apply_biases(logits, rows)
        probs = self.probs[:r]
        temps = to_device([row.params.temperature or 1.0 for row in rows], logits.device)
        torch.div(logits, temps[:, None], out=probs)
        torch.softmax(probs, dim=-1, out=probs)
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        if greedy:
            _one_hot_argmax(logits, probs, greedy)
        filters = [Filters.of(row.params, self.vocab_size) for row in rows]
        if any(f.active for f in filters):
            step = self.filter_rows
            for start in range(0, r, step):
                part = filters[start : start + step]
                if any(f.active for f in part):
                    self._filter(start, part)
        return probs

    def _filter(self, start: int, part: list[Filters]) -> None:
        """min-p, top-k and top-p on rows `start:start + len(part)` of `probs`, in one pass over
        them (at most `filter_rows` rows, so that the pass's scratch stays small). Every
        reduction is along a row, so a row's result does not depend on the rows beside it."""
        n, end = len(part), start + len(part)
        probs = self.probs[start:end]
        device = probs.device
        if any(f.min_p > 0.0 for f in part):
            min_p = to_device([f.min_p for f in part], device)
            floor = probs.amax(dim=-1, keepdim=True).mul_(min_p[:, None])
            probs.masked_fill_(probs < floor, 0.0)
        need = [i for i, f in enumerate(part) if f.top_k or f.top_p < 1.0]
        if not need:
            return
        cuts = Cuts.of([part[i] for i in need], self.vocab_size, device)
        if len(need) == n:
            self._cut(probs, cuts, start)
            return
        index = torch.tensor(need, device=device)
        rows = probs.index_select(0, index)
        self._cut(rows, cuts, start)
        probs.index_copy_(0, index, rows)

    def _cut(self, rows: torch.Tensor, cuts: Cuts, start: int) -> None:
        """Top-k and top-p of `rows` ([m, V]), in place: each a cut of the row sorted by
        probability (ties by token id), the kept values written back in vocabulary order.

        On the CPU, where sorting a whole row of the vocabulary costs tens of milliseconds, the
        cuts are first tried on each row's `candidates` most probable tokens: where every cut
        falls strictly inside them (the value at the cut above the last candidate's, so that no
        tie crosses the edge) the result is the whole sort's to the bit; else the rows are sorted
        whole."""
        m, vocab = rows.shape
        if rows.device.type == "cpu" and self.candidates < vocab:
            vals, idx = top_by_id(rows, self.candidates)
            if cuts.apply(vals, rows):
                rows.zero_().scatter_(1, idx, vals)
                return
        vals, order = self.sorted[start : start + m], self.order[start : start + m]
        torch.sort(rows, dim=-1, descending=True, stable=True, out=(vals, order))
        cuts.apply(vals, rows)
        rows.scatter_(1, order, vals)

    def sample(self, probs: torch.Tensor, rows: list[Row], stream: int = SAMPLE) -> list[int]:
        """One token per row by inverse CDF, with the row's counter-based uniform."""
        return self._sample(probs, rows, stream).tolist()

    def _sample(self, probs: torch.Tensor, rows: list[Row], stream: int) -> PendingTokens:
        r = len(rows)
        u = self.uniforms[:r]
        draws = uniforms([row.seed for row in rows], [row.position for row in rows], stream)
        u.copy_(to_device(draws, u.device))
        return PendingTokens(inverse_cdf_on_device(probs, u, self.sorted[:r]), probs)

    def sample_logits(self, logits: torch.Tensor, rows: list[Row]) -> PendingTokens:
        """`sample(distribution(logits, rows), rows)`, left on the device until `tolist`.

        An all-greedy batch whose logits nothing adjusts takes each row's argmax directly, which
        is the token that path picks (a one-hot distribution's inverse CDF lands on its one token
        for every uniform in [0, 1)). Constrained rows are masked first (`constrain`)."""
        self.constrain(logits, rows)
        if all(row.params.takes_argmax for row in rows):
            return PendingTokens(logits.argmax(dim=-1), None)
        return self._sample(self.distribution(logits, rows), rows, SAMPLE)


class PendingTokens:
    """Sampled token ids still on the device, already on their way to pinned host memory, so
    the device can be given more work before the host waits for them.

    A row whose draw fell on a zero-probability token (rounding at the very end of the CDF)
    comes as -1 - token and is settled on the host, from `probs`, in `tolist`."""

    def __init__(self, tokens: torch.Tensor, probs: torch.Tensor | None):
        self.device = tokens  # int64 [R]
        self.host = HostCopy(tokens)
        self._probs = probs

    def tolist(self) -> list[int]:
        return self.settle(self.host.values())

    def settle(self, device_tokens: list[int]) -> list[int]:
        """The final tokens, from the values the device held (`host.values()`)."""
        tokens = list(device_tokens)
        for i, tok in enumerate(tokens):
            if tok < 0:
                assert self._probs is not None
                tokens[i] = int(torch.nonzero(self._probs[i])[-1])
        return tokens


class HostCopy:
    """A device tensor's values on their way to pinned host memory; `values` waits for that
    copy only, not for work queued on the device after it."""

    def __init__(self, tensor: torch.Tensor):
        self._done: torch.cuda.Event | None = None
        self._host = tensor
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    def values(self) -> list:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


def to_device(
    values: Sequence[float] | np.ndarray, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A `dtype` tensor of `values` on `device` (float32; int64 for an index); to a GPU through
    pinned memory without waiting for the device, so host work queued after it overlaps the
    step still running there."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def sampler_nbytes(max_rows: int, vocab_size: int, in_place_logits: bool) -> int:
    """The bytes of a `Sampler`'s buffers, for the memory plan."""
    filters = max_rows * vocab_size * (4 * (3 + in_place_logits) + 8) + max_rows * 4
    return filters + mask_block_bytes(max_rows, vocab_size)


def filter_rows(max_rows: int, vocab_size: int, filter_elements: int = FILTER_ELEMENTS) -> int:
    """Rows of the vocabulary one filter pass (`Sampler._filter`) works on at once."""
    return max(1, min(max_rows, filter_elements // vocab_size))


# A filter pass's scratch per element of its rows: the stable sort's keys and values, each
# double-buffered, and the index it sorts (measured: docs/benchmarks.md, "Figures behind the
# code's constants")
FILTER_SCRATCH_PER_ELEMENT = 40
ALLOCATOR_SEGMENT = 20 << 20  # CUDA's caching allocator reserves large blocks in these steps


def filter_scratch_bytes(max_rows: int, vocab_size: int) -> int:
    """What a filter pass allocates and frees after the forward: the memory plan adds it to
    the activations, not in their place (their freed blocks may not hold its one contiguous
    sort), rounded up to whole allocator segments, the steps in which reserved memory grows."""
    used = filter_rows(max_rows, vocab_size) * vocab_size * FILTER_SCRATCH_PER_ELEMENT
    return -(-used // ALLOCATOR_SEGMENT) * ALLOCATOR_SEGMENT


MASK_BLOCK_ROUND = 2 << 20  # the allocator's page: the block is reserved in whole pages


def mask_block_bytes(max_rows: int, vocab_size: int) -> int:
    """The bitmask's one allocation: its bits unpacked (int32), the bitmask on the device, the
    32 bit indices and the forbidden tokens (bool), rounded up to whole allocator pages."""
    words = max_rows * mask_words(vocab_size)
    used = words * 32 * 4 + words * 4 + 32 * 4 + max_rows * vocab_size
    return -(-used // MASK_BLOCK_ROUND) * MASK_BLOCK_ROUND


@functools.cache
def _ahead_thread() -> ThreadPoolExecutor:
    """The thread `Sampler.mask_ahead` runs on (the matchers release the GIL)."""
    return ThreadPoolExecutor(1, thread_name_prefix="masks-ahead")


def _guided(row: Row, i: int) -> tuple[Guide, list[int], int]:
    assert row.guide is not None
    return row.guide, row.history[row.prompt_len :], i


class _Carver:
    """Consecutive views of one byte buffer, each of its own shape and dtype (4-byte dtypes
    first: every offset stays aligned)."""

    def __init__(self, block: torch.Tensor):
        self.block, self.at = block, 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        view = self.block[self.at : self.at + size].view(dtype).view(shape)
        self.at += size
        return view


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, scratch: torch.Tensor) -> list[int]:
    """Token i of each row where the running mass first exceeds u * total; probs: [R, V]."""
    return PendingTokens(inverse_cdf_on_device(probs, u, scratch), probs).tolist()


def inverse_cdf_on_device(probs: torch.Tensor, u: torch.Tensor, scratch: torch.Tensor):
    """`inverse_cdf` without the wait: int64 [R] on the device. A zero-probability token can
    only be hit through rounding at the very end of the CDF; such rows hold -1 - token, so one
    transfer (one sync) brings every row (`PendingTokens.tolist` settles them)."""
    torch.cumsum(probs, dim=-1, out=scratch)
    target = u.to(scratch.device)[:, None] * scratch[:, -1:]  # u may come from the host
    idx = torch.searchsorted(scratch, target, right=True).clamp_(max=probs.shape[-1] - 1)
    return torch.where(probs.gather(1, idx) <= 0, -1 - idx, idx)[:, 0]


def _one_hot_argmax(logits: torch.Tensor, probs: torch.Tensor, greedy: list[int]) -> None:
    """Rows `greedy` of probs become one-hot at their logits' argmax, in one batched pass
    (the first maximum, as `torch.argmax` of each row alone)."""
    if len(greedy) == probs.shape[0]:
        probs.zero_().scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return
    index = torch.tensor(greedy, device=probs.device)
    top = logits.index_select(0, index).argmax(dim=-1)
    probs.index_fill_(0, index, 0.0)
    probs[index, top] = 1.0


def apply_penalties(logits: torch.Tensor, row: Row) -> None:
    """Repetition (prompt + output), presence and frequency (output only), in place."""
    p = row.params
    if p.repetition_penalty != 1.0 and row.history:
        seen = torch.tensor(sorted(set(row.history)), device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    output = row.history[row.prompt_len :]
    if output and (p.presence_penalty or p.frequency_penalty):
        counts = Counter(output)
        ids = torch.tensor(list(counts), device=logits.device)
        freq = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        logits[ids] -= p.frequency_penalty * freq + p.presence_penalty


def apply_biases(logits: torch.Tensor, rows: list[Row]) -> None:
    """After the penalties: each row's logit_bias added, then the ids that end a row still short
    of its min_tokens made -inf; each one indexed write over the batch, in place."""
    at: list[int] = []
    ids: list[int] = []
    bias: list[float] = []
    banned: tuple[list[int], list[int]] = ([], [])
    for i, row in enumerate(rows):
        p = row.params
        for token, value in p.logit_bias:
            at.append(i)
            ids.append(token)
            bias.append(value)
        if row.stops and len(row.history) - row.prompt_len < p.min_tokens:
            banned[0].extend([i] * len(row.stops))
            banned[1].extend(row.stops)
    device, index = logits.device, torch.int64
    if at:
        where = (to_device(at, device, index), to_device(ids, device, index))
        logits.index_put_(where, to_device(bias, device, logits.dtype), accumulate=True)
    if banned[0]:
        where = (to_device(banned[0], device, index), to_device(banned[1], device, index))
        logits.index_put_(where, torch.tensor(float("-inf"), device=device))


def top_logprobs(
    logits: torch.Tensor, tokens: list[int], n: int, in_place: bool = False
) -> list[list]:
    """[chosen logprob, [[id, logprob] x n]] for each row, from the raw model logits; with
    `in_place`, `logits` (a float32 buffer of the caller's) become their log-softmax instead of
    being copied."""
    index = torch.tensor(tokens, dtype=torch.long).to(logits.device)
    work = logits if in_place else logits.to(torch.float32, copy=True)
    return PendingLogprobs(work, index, n).rows(tokens, tokens)


class PendingLogprobs:
    """Each row's log-probability of its sampled token and its top `n`, computed on the device
    from the raw logits (float32, overwritten with their log-softmax) and the device's tokens,
    and already on their way to the host: every figure crosses in one transfer, queued before
    any later device work."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, n: int):
        self.n = n
        self._logp = torch.log_softmax(logits, dim=-1, out=logits)  # float32, in place
        # a row the host settles later (-1 - token) is gathered at its drawn token for now
        index = torch.where(tokens < 0, -1 - tokens, tokens)[:, None]
        parts = [self._logp.gather(1, index)]
        if n:
            top = torch.topk(self._logp, n, dim=-1)
            parts += [top.values, top.indices.to(self._logp.dtype)]
        self._copy = HostCopy(torch.cat(parts, dim=1))

    def rows(self, tokens: list[int], device_tokens: list[int]) -> list[list]:
        """[chosen logprob, [[id, logprob] x n]] per row; `tokens` are the final tokens and
        `device_tokens` what the device held (they differ only on rows settled on the host)."""
        n, out = self.n, []
        for i, row in enumerate(self._copy.values()):
            chosen = row[0]
            if tokens[i] != device_tokens[i]:
                chosen = float(self._logp[i, tokens[i]])
            pairs = [[int(t), v] for t, v in zip(row[1 + n :], row[1 : 1 + n], strict=True)]
            out.append([chosen, pairs])
        return out
