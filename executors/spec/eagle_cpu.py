"""The EAGLE head (executors/spec/eagle.py) on the CPU in memstep's C kernels: its matrices as Q8_0
blocks, and each draft position one `decode_step` call of one layer over the request's context
where the `spec` kind holds it, read in place.

The head's block is a Llama decoder layer whose input is fc([embed(token); hidden]) and whose
final norm is its `out_norm`, so the decode step of the target's layers runs it as it is
(executors/cpu/decode_step.py). Its keys and values live in `draft_context` ([rows, 2, P, kv
heads, d]):
a row's keys are one page of P slots and its values the page after, so that one table entry a
row ([2 row]) addresses both. The first CONTEXT slots are the ring of the pairs read (position p
at p % CONTEXT); the slots after them take a draft's own pairs once the ring is full, and the
last slot takes the first draft position's pair again (it is in the ring already), read by no
one. A draft position attends the pairs read and the chain's pairs since, the same keys as the
torch head's (`TorchHead.draft`), but for a ring that is full in the order of its slots.

Through torch, a draft position at one row ran ~40 small ops and 7 int8 matmuls: two drafts
took 2.4-2.8 ms on 2 cores and keeping a step's pairs 0.7; here 1.5 and 0.5 (the same drafts).
Like those, the drafts run on the calling thread where the pool sleeps (threads.small_work):
the kernels compute each output the same way on any number of threads.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from memstep.core.model_config import ModelConfig
from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.cpu.decode_step import DecodeStep
from memstep.executors.model.quant_linear import quantize_q8_0


def takes(params: dict[str, torch.Tensor], head_dim: int) -> bool:
    """Whether the C kernels run this head: its head size attended by them, and every matrix's
    inputs in whole Q8_0 blocks."""
    widths = [params[n].shape[1] for n in ("fc", "q", "o", "gate_up", "down")]
    return cpu_kernels.attends(head_dim) and all(w % cpu_kernels.GROUP == 0 for w in widths)


class CpuHead:
    """The head's fc, block and draft-vocabulary rows as Q8_0 blocks, multiplied in float32.

    `params`: the head's float matrices and norms (`eagle.init_params`' names); `rows`: the
    target's head over the draft vocabulary [draft vocab, H]; `shape`: (heads, kv heads, head
    dim); `table`: rotary cos and sin [positions, 1, d / 2]."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        rows: torch.Tensor,
        shape: tuple[int, int, int],
        eps: float,
        table: tuple[torch.Tensor, torch.Tensor],
        embed: torch.Tensor,
        vocab: torch.Tensor,
        window: int,
    ):
        heads, kv_heads, head_dim = shape
        self.embed, self.vocab, self.window = embed, vocab, window
        hidden = params["fc"].shape[0]
        self.cfg = ModelConfig(
            num_layers=1,
            hidden_size=hidden,
            intermediate_size=params["gate_up"].shape[0] // 2,
            num_heads=heads,
            num_kv_heads=kv_heads,
            vocab_size=rows.shape[0],
            head_dim=head_dim,
            rms_eps=eps,
        )
        qkv = torch.cat([params["q"], params["k"], params["v"]])
        block = [qkv, params["o"], params["gate_up"], params["down"]]
        matrices = [(quantize_q8_0(m.float()), cpu_kernels.Q8_0_BLOCK) for m in block]
        norms = [params[n].float().contiguous() for n in ("attn_norm", "mlp_norm", "out_norm")]
        self.layer = DecodeStep(self.cfg, matrices, norms)
        self.qkv, self.attn_norm = matrices[0][0], norms[0]  # for the keys of pairs read
        self.fc = quantize_q8_0(params["fc"].float())
        self.rows = quantize_q8_0(rows.float())
        self.cos, self.sin = (t.squeeze(1).float().contiguous() for t in table)
        self.scale = head_dim**-0.5

    def tensors(self) -> list[torch.Tensor]:
        return [*self.layer.tensors, self.fc, self.rows, self.cos, self.sin]

    def pair_input(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """fc([embed(token); hidden]) [N, H] of N pairs."""
        pairs = torch.cat([F.embedding(tokens, self.embed), hidden.float()], dim=-1)
        return cpu_kernels.q8_0_mm(pairs, self.fc)

    def _pages(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`context` [rows, 2, P, kv heads, d] as key pages and value pages [2 rows, P, kv
        heads, d]: row r's keys are page 2r of the first, its values page 2r of the second."""
        pages = context.flatten(0, 1)
        return pages, pages[1:]

    def keys(
        self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [N, kv heads, d] of N pairs, written into a context of one page a
        pair by `write_pairs`."""
        cfg = self.cfg
        pages = hidden.new_empty(len(tokens), 2, 1, cfg.num_kv_heads, cfg.head_dim)
        row = torch.arange(len(tokens))
        self.write_pairs(hidden, tokens, positions, pages, row, torch.zeros_like(row))
        return pages[:, 0, 0], pages[:, 1, 0]

    def write_pairs(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Keys and values of N pairs at their context positions [N] into `context` at (row,
        slot) [N] each: the same operations as a draft position's (`draft`), so the same bits."""
        width = context.shape[2]
        x = self.pair_input(hidden, tokens)
        normed = cpu_kernels.rms_norm(x, self.attn_norm, self.cfg.rms_eps)
        qkv = cpu_kernels.q8_0_mm(normed, self.qkv)
        keys, values = self._pages(context)
        flat = (2 * rows * width + slots).to(torch.int64)
        cpu_kernels.rope_and_write_kv(
            qkv,
            self.cos,
            self.sin,
            positions.to(torch.int64),
            flat,
            keys,
            values,
            self.cfg.num_heads,
        )

    def draft_rows(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        k: int,
        context: torch.Tensor,
        rows: list[int],
        counts: list[int],
    ) -> torch.Tensor:
        """[B, k] greedy drafts (target ids) from B rows' last states and tokens, their pairs'
        keys in `context` rows `rows`, `counts` pairs read each (its last: (hidden, token))."""
        width, window = context.shape[2], self.window
        assert k <= width - window, "the context has no slots for so many drafts"
        keys, values = self._pages(context)
        caches = (_addresses(keys), _addresses(values), width)
        base = torch.tensor([2 * r * width for r in rows], dtype=torch.int64)
        tables = (base // width).to(torch.int32).unsqueeze(1)
        count = torch.tensor(counts, dtype=torch.int64)
        filled = count.clamp(max=window)
        drafts = []
        for u in range(k):
            if u == 0:  # its pair is in the ring: written again to the slot no one reads
                slots, lens = base + width - 1, filled
            else:  # the chain's own pair, just past the pairs read
                slots, lens = base + filled - 1 + u, filled + u
            where = (count - 1 + u, slots, tables, lens.to(torch.int32))
            x = self.pair_input(hidden, tokens)
            hidden = self.layer.run(x, where, caches, self.cos, self.sin, self.scale)
            tokens = self.vocab[cpu_kernels.q8_0_mm(hidden, self.rows).argmax(dim=-1)]
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)


def _addresses(pages: torch.Tensor) -> ctypes.Array:
    return (ctypes.c_int64 * 1)(pages.data_ptr())
