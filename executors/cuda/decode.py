"""The decode step on CUDA: a row per fed token (one a sequence; a verify step's token and
drafts at consecutive positions), read from static buffers, graph-capturable.

`DecodeInputs` holds the per-step metadata (token ids, positions, KV slots, context lengths,
block tables) in one int32 device buffer with a pinned host mirror, so a step costs one
host-to-device copy. `DecodeForward` runs the decoder (any family's: `backend.py`) over the
first `bs` rows of those buffers with fused Triton kernels (RMSNorm + residual, rotary + KV
write, paged attention with the layer's window, the gated activation, the experts' grouped
GEMMs) and cuBLAS matmuls; it allocates only within the step and never syncs with the host, so
`graph_runner` can capture it. Padding rows (slot -1, context 0) write no KV and attend to
nothing (their expert rows are computed and dropped).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from memstep.core.model_config import ModelConfig
from memstep.core.shapes import cdiv, layer_activation_elements
from memstep.executors.cuda.backend import cuda_backend
from memstep.executors.cuda.kernels import DecodeWorkspace, paged_decode_attention
from memstep.executors.model.kv_cache import slot_of
from memstep.executors.model.llama import LlamaModel
from memstep.executors.runtime.batch_builder import Feed, TreeTokens
from memstep.states.arena import tensor_bytes

# split-K partition of the decode attention: the smallest of 64, 128 and 256 was fastest
# (docs/benchmarks.md, "Figures behind the code's constants")
DECODE_PARTITION = 64


class DecodeInputs:
    """Static int32 buffers for up to `max_seqs` decode rows, and their pinned host mirror.

    Layout of the one buffer: ids, positions, slots, seq_lens (each `max_seqs` long), then the
    block tables `[max_seqs, max_blocks]` row-major, so the rows of a batch of `bs` are a
    prefix and one copy moves them all. The device views never move: graphs capture them.
    """

    def __init__(self, max_seqs: int, max_blocks: int, block_size: int, device: torch.device):
        self.max_seqs, self.max_blocks, self.block_size = max_seqs, max_blocks, block_size
        size = 4 * max_seqs + max_seqs * max_blocks
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self.buffer = torch.zeros(size, dtype=torch.int32, device=device)
        self._host_np = self.host.numpy()
        self.host_ids, self.host_positions, self.host_slots, self.host_seq_lens = (
            self._host_np[i * max_seqs : (i + 1) * max_seqs] for i in range(4)
        )
        self.host_tables = self._host_np[4 * max_seqs :].reshape(max_seqs, max_blocks)
        self.ids, self.positions, self.slots, self.seq_lens = (
            self.buffer[i * max_seqs : (i + 1) * max_seqs] for i in range(4)
        )
        self.block_tables = self.buffer[4 * max_seqs :].view(max_seqs, max_blocks)
        self._copied = torch.cuda.Event() if pin else None

    def fits(self, feeds: Sequence[Feed], max_tokens: int = 1) -> bool:
        """Every feed is 1..`max_tokens` tokens, each a row of its own, whose context fits the
        block-table width, and the rows fit the buffers."""
        width = self.max_blocks * self.block_size
        rows = 0
        for seq, tokens in feeds:
            n = len(tokens)
            if not 0 < n <= max_tokens or seq.start_pos + n > width:
                return False
            if isinstance(tokens, TreeTokens):  # its rows are not consecutive: the tree mask's
                return False
            if len(seq.block_table) > self.max_blocks:
                return False
            rows += n
        return 0 < rows <= self.max_seqs

    def fill(self, feeds: Sequence[Feed], bs: int) -> None:
        """Write a row for every fed token, in order (a feed's tokens at consecutive positions
        of its sequence: a verify step's token and drafts), rows up to `bs` as padding, and
        copy. A row attends to its sequence's positions up to its own, so the rows of one feed
        are causal as in a prefill."""
        if all(len(tokens) == 1 for _, tokens in feeds):
            ids = [tokens[0] for _, tokens in feeds]
            starts = [seq.start_pos for seq, _ in feeds]
            tables = [seq.block_table for seq, _ in feeds]
        else:
            ids, starts, tables = [], [], []
            for seq, tokens in feeds:
                ids += tokens
                starts += range(seq.start_pos, seq.start_pos + len(tokens))
                tables += [seq.block_table] * len(tokens)
        self.write(ids, starts, tables, bs)

    def write(self, ids: list[int], starts: list[int], tables: list[list[int]], bs: int) -> None:
        """Rows 0..len(ids)-1: token ids[i] at position starts[i] of a sequence whose pages are
        tables[i]; rows up to `bs` as padding; then the copy to the device."""
        n, block_size = len(ids), self.block_size
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        self.host_ids[:n] = ids
        self.host_positions[:n] = starts
        self.host_slots[:n] = [
            slot_of(table, p, block_size) for table, p in zip(tables, starts, strict=True)
        ]
        self.host_seq_lens[:n] = np.asarray(starts, dtype=np.int32) + 1
        for row, table in zip(self.host_tables, tables, strict=False):
            row[: len(table)] = table
        self._pad(n, bs)
        self._copy(bs)

    def fill_padding(self, bs: int) -> None:
        """Every row a padding row: used for warm-up and capture."""
        self._pad(0, bs)
        self._copy(bs)

    def _pad(self, start: int, stop: int) -> None:
        self.host_ids[start:stop] = 0
        self.host_positions[start:stop] = 0
        self.host_slots[start:stop] = -1
        self.host_seq_lens[start:stop] = 0

    def _copy(self, bs: int) -> None:
        used = 4 * self.max_seqs + bs * self.max_blocks
        self.buffer[:used].copy_(self.host[:used], non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()


class DecodeForward:
    """The model's decode step over `DecodeInputs`: `CudaBackend.fused_layers` with the paged
    decode kernel as its attention; writes `hidden[:bs]` (final-norm output).

    Owns the attention output (`max_seqs` rows), the split-K workspace (for the batches small
    enough to split), the hidden-state output buffer and the buffer that joins a replay's rows
    to a forward's (`joined`); reads the model's weights and rotary
    tables and writes the KV caches it is given.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs: DecodeInputs,
    ):
        cfg, w = model.cfg, model.w
        self.model, self.kv, self.inputs = model, kv_caches, inputs
        self.backend = cuda_backend(model)
        device, dtype = w["embed"].device, w["embed"].dtype
        rows, heads, head_dim = inputs.max_seqs, cfg.num_heads, cfg.head_dim
        max_context = inputs.max_blocks * inputs.block_size
        # split-K runs only while (sequences x KV heads) is under two waves of programs
        is_cuda = device.type == "cuda"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if is_cuda else 1
        split_rows = min(rows, cdiv(2 * sms, cfg.num_kv_heads))
        self.workspace = DecodeWorkspace.allocate(
            split_rows, heads, head_dim, max_context, device, DECODE_PARTITION
        )
        self.attn_out = torch.zeros(rows, heads, head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(rows, cfg.hidden_size, dtype=dtype, device=device)
        # a step's rows from a replay ahead beside its other feeds' (GraphRunner.join)
        self.joined = torch.zeros(rows, cfg.hidden_size, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        ws = self.workspace
        return tensor_bytes(
            (ws.partial_out, ws.partial_lse, self.attn_out, self.hidden, self.joined)
        )

    def __call__(self, bs: int) -> torch.Tensor:
        model, ins = self.model, self.inputs
        tables, seq_lens, out = ins.block_tables[:bs], ins.seq_lens[:bs], self.attn_out[:bs]

        def attend(q, k_cache, v_cache, window):
            rows = (tables, seq_lens, model.scale, out, self.workspace)
            return paged_decode_attention(q, k_cache, v_cache, *rows, window=window)

        residual = model.embed(ins.ids[:bs])  # [bs, hidden]
        x = self.backend.fused_layers(
            model, residual, ins.positions[:bs], ins.slots[:bs], self.kv, attend
        )
        return self.hidden[:bs].copy_(x)


def static_bytes(
    max_seqs: int, max_blocks: int, block_size: int, model: ModelConfig, dtype_bytes: int
) -> int:
    """Bytes the decode path holds once captured, over-estimated: buffers, a workspace for
    every row, and the graph pool's activations at the largest batch (each intermediate
    counted once, with a 2x margin)."""
    rows, heads, head_dim = max_seqs, model.num_heads, model.head_dim
    metadata = 4 * (4 * rows + rows * max_blocks) * 2
    parts = cdiv(max_blocks * block_size, DECODE_PARTITION)
    workspace = 4 * rows * heads * parts * (head_dim + 1)
    buffers = dtype_bytes * rows * (heads * head_dim + 2 * model.hidden_size)
    return (
        metadata + workspace + buffers + 2 * dtype_bytes * rows * layer_activation_elements(model)
    )
