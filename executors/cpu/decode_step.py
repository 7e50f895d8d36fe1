"""A CPU decode step of a quantized model in one call: every layer in one OpenMP parallel region.

A SmolLM2 q4 decode step at batch 1 ran ~150 kernels through Python and torch (a norm, three
matmuls, rotary, attention, silu * up, two adds a layer), each a dispatch of tens of
microseconds; under the executor's passive wait policy the matmuls ran on one thread, since
waking the sleeping pool for each cost more than it saved (cpu_kernels.PARALLEL_MIN_WHEN_ASLEEP).
`decode_step` (executors/cpu/kernels.c) runs the layers in C with the pool woken once, its
threads meeting at spin barriers between stages, each output computed by the same helpers as
the single kernels, so a row's bits are those of the kernel-by-kernel forward (LlamaModel
takes the C norm and silu * up there too, for every batch of such a model).

Taken for batches of fewer than ONE_CALL_ROWS rows that are all attended as decode rows (decode
steps, speculative verify steps, and prefill chunks: on the CPU every query of such a model is
attended as a decode row of its own, in order) of a model whose every layer matrix is blocks
(Q4_1, Q5_0, Q8_0 or Q8_16), float32, on one rank, with a float32 KV cache: Llama's layers,
Qwen2's (a qkv bias, added in C as torch adds it) or Qwen3's (q and k heads RMS-normed before
rotary, by the C norm the kernel-by-kernel path takes too).
"""

from __future__ import annotations

import ctypes

import torch

from memstep.core.model_config import ModelConfig
from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.model.attention import AttnGroup, ForwardBatch

MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # each layer's, in decode_step's order
# rows up to which a step runs in one call: its matmuls pass each weight tile over every row at
# once (more rows go kernel by kernel, whose matmuls take rows 128 at a time; the same bits)
ONE_CALL_ROWS = 32
BLOCK_BYTES = {
    ".q4_1": cpu_kernels.Q4_1_BLOCK,
    ".q5_0": cpu_kernels.Q5_0_BLOCK,
    ".q8_0": cpu_kernels.Q8_0_BLOCK,
    ".q8_16": cpu_kernels.Q8_16_BLOCK,
}


def _blocks(weights: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, int] | None:
    for suffix, size in BLOCK_BYTES.items():
        if name + suffix in weights:
            return weights[name + suffix], size
    return None


def _pointers(tensors: list[torch.Tensor]) -> ctypes.Array:
    """The tensors' addresses as a C array (not a tensor: the leak detector counts those)."""
    return (ctypes.c_int64 * len(tensors))(*[t.data_ptr() for t in tensors])


class DecodeStep:
    """The layers of one model as `decode_step` takes them: block and norm pointers, kept with
    the tensors they point into."""

    def __init__(
        self,
        cfg: ModelConfig,
        matrices: list[tuple[torch.Tensor, int]],
        norms: list[torch.Tensor],
        bf16: bool = False,
        biases: list[torch.Tensor] | None = None,
        qk_norms: list[torch.Tensor] | None = None,
    ):
        """`matrices`: every layer's (blocks, block bytes) in MATRICES order; `norms`: every
        layer's attention and MLP norm weights, then the final norm's; `bf16`: the matmuls'
        products in bfloat16 (matmul_precision "bfloat16"); `biases`: every layer's qkv bias
        (Qwen2's), or None; `qk_norms`: every layer's q and k head norm weights (Qwen3's), or
        None."""
        self.cfg = cfg
        self.bf16 = bf16
        biases, qk_norms = biases or [], qk_norms or []
        blocks = [b for b, _ in matrices]
        self.tensors = [*blocks, *norms, *biases, *qk_norms]  # what the pointers address
        self.w = _pointers(blocks)
        self.bs = (ctypes.c_int32 * len(matrices))(*(size for _, size in matrices))
        self.norms = _pointers(norms)
        self.biases = _pointers(biases) if biases else None
        self.qk_norms = _pointers(qk_norms) if qk_norms else None
        self._caches: tuple[tuple[int, ...], ctypes.Array, ctypes.Array] | None = None

    @classmethod
    def of(
        cls, cfg: ModelConfig, weights: dict[str, torch.Tensor], bf16: bool = False
    ) -> DecodeStep | None:
        """The model's decode step, if every layer matrix is blocks (BLOCK_BYTES) and its
        norms (and qkv biases, q/k norms, where every layer has them) float32; else None."""
        layers = range(cfg.num_layers)
        found = [_blocks(weights, f"layers.{i}.{m}") for i in layers for m in MATRICES]
        matrices = [m for m in found if m is not None]
        norms = [weights[f"layers.{i}.{n}"] for i in layers for n in ("attn_norm", "mlp_norm")]
        norms.append(weights["norm"])
        biases = [weights[f"layers.{i}.bqkv"] for i in layers if f"layers.{i}.bqkv" in weights]
        names = [f"layers.{i}.{n}" for i in layers for n in ("q_norm", "k_norm")]
        qk_norms = [weights[n] for n in names if n in weights]
        usable = cpu_kernels.attends(cfg.head_dim) and len(matrices) == len(found)
        usable = usable and len(biases) in (0, cfg.num_layers)
        usable = usable and len(qk_norms) in (0, 2 * cfg.num_layers)
        extra = biases + qk_norms
        if not usable or any(t.dtype != torch.float32 or t.is_cuda for t in norms + extra):
            return None
        contiguous = [[t.contiguous() for t in ts] for ts in (biases, qk_norms)]
        return cls(cfg, matrices, norms, bf16, *contiguous)

    @staticmethod
    def rows(
        batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, ...] | None:
        """Each row's pages and context ([M, NB], [M] int32) where every row of `batch` is a
        query attended as a decode row, in order: a decode step, a speculative verify step
        whose sequences all feed as many tokens, or one prompt's chunk (on the CPU their queries
        attend as decode rows); fewer than ONE_CALL_ROWS rows, over a float32 cache. None for
        any other batch. A draft tree's rows also give their bases and paths (`query_remap`)."""
        m = batch.num_tokens
        if len(batch.groups) != 1 or kv_caches[0][0].dtype != torch.float32 or m >= ONE_CALL_ROWS:
            return None
        group = batch.groups[0]
        if not isinstance(group, AttnGroup):
            return None
        if group.is_decode and group.first_row == 0 and group.block_tables.shape[0] == m:
            return group.block_tables, group.seq_lens
        in_order = group.valid_rows.shape[0] == m and bool(
            (group.valid_rows == torch.arange(m)).all()
        )
        if group.query_tables is None or group.query_lens is None or not in_order:
            return None
        if group.query_remap is not None and group.query_bases is not None:
            return group.query_tables, group.query_lens, group.query_bases, group.query_remap
        return group.query_tables, group.query_lens

    def _cache_pointers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        """The caches' addresses, made again whenever any of them moved (a cache made anew)."""
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._caches is None or self._caches[0] != key:
            keys = _pointers([k for k, _ in kv_caches])
            values = _pointers([v for _, v in kv_caches])
            self._caches = (key, keys, values)
        return self._caches[1], self._caches[2]

    def __call__(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        rows: tuple[torch.Tensor, ...],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        cos: torch.Tensor,
        sin: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """The final norm's output [M, E] for the embeddings `h` ([M, E], used as scratch) of a
        batch whose `rows` (pages, context) are as `rows()` gave them; writes its K/V."""
        keys, values = self._cache_pointers(kv_caches)
        block_size = kv_caches[0][0].shape[1]
        where = (batch.positions, batch.slot_mapping, *rows)
        return self.run(h, where, (keys, values, block_size), cos, sin, scale)

    def run(
        self,
        h: torch.Tensor,
        where: tuple[torch.Tensor, ...],
        caches: tuple[ctypes.Array, ctypes.Array, int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """`__call__` over rows given as `where` (positions and slots [M] int64, pages [M, NB]
        and context [M] int32, and for a draft tree's rows bases [M] and paths [M, R] int32)
        and `caches` (each layer's K and V cache addresses, the block size)."""
        cfg, m = self.cfg, h.shape[0]
        h = h.contiguous()
        e, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        pos, slots, tables, lens, *tree = (t.contiguous() for t in where)
        bases, remap = tree if tree else (None, None)
        keys, values, block_size = caches

        def scratch(width: int) -> torch.Tensor:
            return torch.empty(m, width, dtype=torch.float32)

        out, tmp = scratch(e), scratch(e)
        qkv = scratch((cfg.num_heads + 2 * cfg.num_kv_heads) * d)
        att, gu, act = scratch(cfg.num_heads * d), scratch(2 * inter), scratch(inter)
        biases = 0 if self.biases is None else ctypes.addressof(self.biases)
        qk_norms = 0 if self.qk_norms is None else ctypes.addressof(self.qk_norms)
        rest = (cos, sin, pos, slots, tables, lens, qkv, att, gu, act, tmp)
        widest = max(e, cfg.num_heads * d, inter)  # of a matmul's inputs
        xb = torch.empty(m, widest, dtype=torch.bfloat16) if self.bf16 else None
        cpu_kernels.decode_step(
            h.data_ptr(),
            out.data_ptr(),
            *[ctypes.addressof(a) for a in (self.w, self.bs, self.norms)],
            biases,
            qk_norms,
            *[ctypes.addressof(a) for a in (keys, values)],
            *[t.data_ptr() for t in rest],
            0 if xb is None else xb.data_ptr(),
            m,
            e,
            cfg.num_heads,
            cfg.num_kv_heads,
            d,
            inter,
            cfg.num_layers,
            block_size,
            tables.shape[1],
            cfg.rms_eps,
            scale,
            *cpu_kernels.tree_args(bases, remap),
        )
        return out
