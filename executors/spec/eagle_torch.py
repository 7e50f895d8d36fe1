"""The EAGLE head in torch: its definition's math (`eagle.py`) over float matrices, or int8 rows
with bfloat16 activations on a CPU whose C kernels do not take the head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memstep.core.spec_tree import tree_depths
from memstep.executors.spec.eagle import AttnShape, Matmuls, Rotation, block_out, pair_input, qkv


class TorchHead:
    """`params`: the head's matrices and norms; `rows`: the target's head over the draft
    vocabulary; `table`: rotary cos and sin [positions, 1, d / 2] (with attention)."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        rows: torch.Tensor,
        embed: torch.Tensor,
        vocab: torch.Tensor,
        attn: AttnShape | None,
        table: Rotation | None,
        eps: float,
        int8: bool,
    ):
        self.mm = Matmuls(params, rows, int8)
        self.params = {n: t for n, t in params.items() if t.dim() == 1}  # the norms; the rest: mm
        self.embed, self.vocab, self.attn, self.table, self.eps = embed, vocab, attn, table, eps

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params.values(), *self.mm.tensors()]

    def rotation(self, positions: torch.Tensor) -> Rotation:
        assert self.table is not None
        return self.table[0][positions], self.table[1][positions]

    def keys(
        self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [N, kv heads, d] of N pairs (hidden state, the token it chose) at
        their context positions [N]: what the context holds of them."""
        assert self.attn is not None
        x = pair_input(self.mm, self.embed, hidden, tokens)
        _, k, v = qkv(self.params, self.mm, x, self.rotation(positions), self.attn, self.eps)
        return k, v

    def write_pairs(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        keys, values = self.keys(hidden, tokens, positions)
        context[rows, 0, slots] = keys
        context[rows, 1, slots] = values

    def draft_rows(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        k: int,
        context: torch.Tensor,
        rows: list[int],
        counts: list[int],
    ) -> torch.Tensor:
        assert self.attn is not None
        device = hidden.device
        # the whole buffer, masked, whatever the rows have read: attention of a new key length
        # was planned anew on CUDA (62 ms a draft step, and host memory growing)
        kv, valid, read = self.context_rows(context, rows, counts, device)
        return self.draft(hidden, tokens, k, (kv, valid, read - 1))

    def context_rows(
        self, context: torch.Tensor, rows: list[int], counts: list[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rows` of the context [B, 2, L, kv heads, d], which slots hold a pair read [B, L],
        and the pairs read [B]. A slot that holds none is zeroed: it holds whatever the memory
        held before (a NaN key or value, masked, still made the attention NaN and every draft
        the draft vocabulary's first token)."""
        assert self.attn is not None
        kv = context[torch.tensor(rows, device=device)]
        read = torch.tensor(counts, device=device)
        valid = torch.arange(kv.shape[2], device=device) < read.clamp(max=self.attn.window)[:, None]
        return kv.masked_fill(~valid[:, None, :, None, None], 0.0), valid, read

    def draft_tree_rows(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        parents: tuple[int, ...],
        context: torch.Tensor | None,
        rows: list[int],
        counts: list[int],
    ) -> torch.Tensor:
        """`draft_rows` for a draft tree of `parents` (`core/spec_tree.py`): [B, nodes]."""
        if context is None or self.attn is None:
            return self.draft_tree(hidden, tokens, parents)
        kv, valid, read = self.context_rows(context, rows, counts, hidden.device)
        return self.draft_tree(hidden, tokens, parents, (kv, valid, read - 1))

    def draft_tree(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        parents: tuple[int, ...],
        context: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[B, H] states and [B] last tokens -> [B, nodes] draft tokens of a static tree
        (`core/spec_tree.py`'s numbering, the root not included): a depth at a time, every
        node of the frontier one row, its children the head's top candidates after it. A node's
        pair attends the context and the pairs of its ancestors and itself (as `draft`'s chain
        does its own), its keys kept in [B, nodes] (`tree_attention`)."""
        b, nodes = hidden.shape[0], len(parents) - 1
        out = tokens.new_empty(b, nodes)
        frontier, states, picked = [0], hidden, tokens  # states [B * F, H], picked [B * F]
        tree_kv = None
        if context is not None and self.attn is not None:
            kv = context[0]
            tree_kv = kv.new_zeros(b, 2, nodes, *kv.shape[3:])
        sees = ancestors(parents).to(hidden.device)  # [nodes + 1, nodes + 1]
        for depth in range(max(tree_depths(parents))):
            x = pair_input(self.mm, self.embed, states, picked)
            attended = None
            if tree_kv is not None:
                assert context is not None
                attended = self.tree_attention(x, context, tree_kv, frontier, sees, depth)
            states, logits = block_out(self.params, self.mm, x, attended, self.eps)
            grown = [n for n in range(len(parents)) if parents[n] in frontier]
            width = len(grown) // len(frontier)
            top = self.vocab[logits.topk(width, dim=-1).indices]  # [B * F, width], best first
            out[:, [n - 1 for n in grown]] = top.view(b, -1)
            states = states.repeat_interleave(width, dim=0)
            picked, frontier = top.flatten(), grown
        return out

    def tree_attention(
        self,
        x: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        tree_kv: torch.Tensor,
        frontier: list[int],
        sees: torch.Tensor,
        depth: int,
    ) -> torch.Tensor:
        """The frontier's pairs x [B * F, H] at `depth` attending the context (`draft`'s) and
        their ancestors' and own pairs, whose keys join `tree_kv` [B, 2, nodes, kv heads, d]
        (the root's pair is in the context already); [B * F, heads * d]."""
        assert self.attn is not None
        kv, valid, position = context
        b, f = kv.shape[0], len(frontier)
        rotation = self.rotation((position + depth).repeat_interleave(f))
        q, key, value = qkv(self.params, self.mm, x, rotation, self.attn, self.eps)
        if depth > 0:
            index = torch.tensor([n - 1 for n in frontier], device=x.device)
            tree_kv[:, 0, index] = key.view(b, f, *key.shape[1:])
            tree_kv[:, 1, index] = value.view(b, f, *value.shape[1:])
        keys = torch.cat([kv[:, 0], tree_kv[:, 0]], dim=1)  # [B, L + nodes, kv heads, d]
        values = torch.cat([kv[:, 1], tree_kv[:, 1]], dim=1)
        own = sees[frontier, 1:]  # [F, nodes]
        mask = torch.cat([valid[:, None].expand(-1, f, -1), own.expand(b, -1, -1)], dim=2)
        attended = F.scaled_dot_product_attention(
            q.view(b, f, *q.shape[1:]).transpose(1, 2),  # [B, heads, F, d]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None],
            enable_gqa=True,
        )
        return attended.transpose(1, 2).reshape(b * f, -1)

    def draft(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        k: int,
        context: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[B, H] hidden states and [B] last tokens -> [B, k] greedy drafts (target ids).

        With attention, `context` is (keys and values [B, 2, L, kv heads, d] holding each row's
        pairs up to and including (hidden, token), which of the L slots hold one [B, L], and
        that last pair's position [B]); each draft's own pair joins the keys for the next."""
        if context is not None:
            kv, mask, position = context
            keys, values = kv[:, 0], kv[:, 1]  # [B, L, kv heads, d]
        drafts = []
        mm = self.mm
        for step in range(k):
            x = pair_input(mm, self.embed, hidden, tokens)
            attended = None
            if self.attn is not None:
                assert context is not None
                rotation = self.rotation(position + step)
                q, key, value = qkv(self.params, mm, x, rotation, self.attn, self.eps)
                if step > 0:  # this draft's pair: its keys join the context for the rest
                    keys = torch.cat([keys, key.unsqueeze(1)], dim=1)
                    values = torch.cat([values, value.unsqueeze(1)], dim=1)
                    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                attended = F.scaled_dot_product_attention(
                    q.unsqueeze(2),  # [B, heads, 1, d]
                    keys.transpose(1, 2),
                    values.transpose(1, 2),
                    attn_mask=mask[:, None, None, :],
                    enable_gqa=True,
                ).flatten(1)
            hidden, logits = block_out(self.params, mm, x, attended, self.eps)
            tokens = self.vocab[logits.argmax(dim=-1)]
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)


def ancestors(parents: tuple[int, ...]) -> torch.Tensor:
    """[N, N] bool: row i is True at i's ancestors and i itself (nodes of `parents`)."""
    n = len(parents)
    sees = torch.zeros(n, n, dtype=torch.bool)
    for node in range(n):
        at = node
        while at >= 0:
            sees[node, at] = True
            at = parents[at]
    return sees
