"""Eager steps on CUDA as piecewise graphs: everything but attention, captured per token bucket.

A step that is not decode-only (prompts, chunks, decodes beside them, speculative verifies) ran
eagerly from Python: at 256 decodes beside a 512-token chunk of Llama-3.1-8B its kernels took
1.02-1.07x of the ideal step and its wall time 1.28-2.16x, the rest being launches. Here its
tokens are padded up to the nearest bucket (`bucket_sizes`) and, per bucket, the model runs as
L + 1 graphs with attention eager between them:

    piece 0:   embedding -> layer 0's norm -> qkv -> rotary + KV write -> q
    piece i:   layer i-1's attention output -> wo -> add + norm -> MLP -> add + norm
               -> layer i's qkv -> rotary + KV write -> q
    piece L:   the last layer's attention output -> ... -> the final norm -> hidden

Each piece reads and writes static buffers only (token ids, positions, slots, the residual, q,
the attention output, the hidden states), so its intermediates are freed when its capture ends
and every graph shares one pool: the pool holds one piece's intermediates at the largest
bucket. Attention reads the static q and writes the static attention output, over the step's
own groups (packed prompts, paged decodes), whose shapes change every step and stay eager.
Padding rows feed token 0 at position 0 with slot -1: they write no KV, no group reads their
queries, and their rows are dropped; row-wise work never mixes them into real rows.

Without capture (`capture` not called: the CPU tests, under Triton's interpreter) `run` runs
the same pieces on the same buffers, eagerly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from memstep.core.model_config import ModelConfig
from memstep.core.shapes import layer_activation_elements
from memstep.executors.cuda.backend import cuda_backend
from memstep.executors.model.attention import ForwardBatch
from memstep.executors.model.llama import LlamaModel
from memstep.states.arena import tensor_bytes

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

# token counts a step is padded to: fine steps where a step is launch-bound, coarser where
# its matmuls take longer than its launches (a step over the last runs eagerly)
BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096)


def bucket_sizes(max_tokens: int) -> list[int]:
    """The buckets below `max_tokens`, then `max_tokens` itself, up to the last bucket."""
    top = min(max_tokens, BUCKETS[-1])
    return [b for b in BUCKETS if b < top] + [top]


class PiecewiseRunner:
    """Owns the static buffers of eager steps and, once captured, L + 1 graphs per bucket.

    `run(batch)` fills the inputs from the step's batch, replays (or runs) the pieces with the
    batch's attention between them, and returns the hidden states [T, hidden]: a view of a
    static buffer, valid until the next `run`.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_tokens: int,
    ):
        cfg, embed = model.cfg, model.w["embed"]
        device, dtype = embed.device, embed.dtype
        self.model, self.kv = model, kv_caches
        self.backend = cuda_backend(model)
        self.sizes = bucket_sizes(max_tokens)
        cap = self.sizes[-1]
        self.ids = torch.zeros(cap, dtype=torch.long, device=device)
        self.positions = torch.zeros(cap, dtype=torch.long, device=device)
        self.slots = torch.full((cap,), -1, dtype=torch.long, device=device)
        self.residual = torch.zeros(cap, cfg.hidden_size, dtype=dtype, device=device)
        self.q = torch.zeros(cap, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros_like(self.q)
        self.hidden = torch.zeros_like(self.residual)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.num_runs = 0

    @property
    def nbytes(self) -> int:
        bufs = (self.ids, self.positions, self.slots, self.residual, self.q, self.attn_out)
        return tensor_bytes((*bufs, self.hidden))

    @property
    def num_pieces(self) -> int:
        return self.model.num_layers + 1

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.sizes[-1]

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def piece(self, j: int, n: int) -> None:
        """Piece j of the first n rows (see the module's docstring), static buffers only."""
        model, rows = self.model, slice(0, n)
        if j == 0:
            self.residual[rows].copy_(model.embed(self.ids[rows]))
            x = self.backend.first_norm(model, self.residual[rows])
        else:
            x = self.backend.layer_out(model, j - 1, self.attn_out[rows], self.residual[rows])
        if j == model.num_layers:
            self.hidden[rows].copy_(x)
            return
        q = self.backend.layer_in(model, j, x, self.positions[rows], self.slots[rows], self.kv)
        self.q[rows].copy_(q)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        t = batch.num_tokens
        n = self.padded_size(t)
        self._fill(batch, n)
        graphs = self.graphs.get(n)
        model = self.model
        for j in range(self.num_pieces):
            if j:  # layer j-1's attention, from the static q into the static output
                k_cache, v_cache = self.kv[j - 1]
                q, out, window = self.q[:t], self.attn_out[:t], model.layers[j - 1].window
                self.backend.attend(model, q, k_cache, v_cache, batch, out, window)
            if graphs is None:
                self.piece(j, n)
            else:
                graphs[j].replay()
        self.num_runs += 1
        return self.hidden[:t]

    def _fill(self, batch: ForwardBatch, n: int) -> None:
        t = batch.num_tokens
        self.ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.slots[:t].copy_(batch.slot_mapping)
        self._pad(t, n)

    def _pad(self, start: int, stop: int) -> None:
        if stop > start:
            self.ids[start:stop].zero_()
            self.positions[start:stop].zero_()
            self.slots[start:stop].fill_(-1)

    def capture(self, pool: _POOL_HANDLE, stream: torch.cuda.Stream) -> dict:
        """Capture every bucket's pieces, largest first, into `pool` (the decode graphs'),
        each bucket after an eager warm-up on the capture stream; figures for the phase."""
        start = time.perf_counter()
        with torch.inference_mode():
            for n in reversed(self.sizes):
                self._pad(0, n)  # all padding: capture writes no KV
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for j in range(self.num_pieces):
                        self.piece(j, n)
                torch.cuda.current_stream().wait_stream(stream)
                graphs = []
                for j in range(self.num_pieces):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self.piece(j, n)
                    graphs.append(graph)
                self.graphs[n] = graphs
        torch.cuda.synchronize()
        return {
            "piecewise_sizes": list(self.sizes),
            "piecewise_graphs": len(self.sizes) * self.num_pieces,
            "piecewise_static_bytes": self.nbytes,
            "piecewise_capture_seconds": round(time.perf_counter() - start, 3),
        }


def piecewise_bytes(max_tokens: int, model: ModelConfig, dtype_bytes: int) -> int:
    """Bytes the piecewise graphs hold, over-estimated: the static buffers at the largest
    bucket, the pool's intermediates of one piece there (each counted once, 2x margin), and
    the same intermediates once more, cached by the eager warm-up on the capture stream (blocks
    of that stream, which serving on the main stream does not reuse). Measured against it:
    docs/benchmarks.md, "Figures behind the code's constants"."""
    rows = bucket_sizes(max_tokens)[-1]
    q_width = model.num_heads * model.head_dim
    static = rows * (3 * 8 + dtype_bytes * (2 * model.hidden_size + 2 * q_width))
    return static + 3 * dtype_bytes * rows * layer_activation_elements(model)
