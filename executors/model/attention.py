"""Paged attention over a flattened token batch, in plain torch (Triton decode on CUDA).

The KV cache's layout and storage are `kv_cache`'s; attention reads it in the model's dtype.
Sequences are attended in groups. On the CPU: short queries (decode, speculative verify) in one
padded batch, each long prefill chunk on its own, so padding never multiplies prefill work. On
CUDA: decodes apart, for the paged decode kernel, and every other query of the step in one
packed group (`PackedGroup`): one variable-length flash attention call a layer, whatever the
number of prompts, where a group per prompt made a step of many prompts launch-bound.
"""

from __future__ import annotations

import functools

import attrs
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from memstep.core.shapes import cdiv
from memstep.core.spec_tree import tree_path
from memstep.executors.model.kv_cache import gather_kv, gather_slots, slots_for

SHORT_QUERY = 8  # CPU: queries up to this many tokens share one padded attention call
_CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@attrs.frozen
class AttnGroup:
    token_index: torch.Tensor  # [B, Q] rows of the flattened batch (padding points at row 0)
    q_pos: torch.Tensor  # [B, Q] position of each query in its sequence, -1 on padding
    valid_flat: torch.Tensor  # [N] flat index b * Q + q of each real query, found on the host
    valid_rows: torch.Tensor  # [N] its row in the flattened batch
    block_tables: torch.Tensor  # [B, NB] int32 page ids covering the group's longest context
    seq_lens: torch.Tensor  # [B] int32 context length after this step
    is_decode: bool  # every query is one token: the Triton decode kernel applies
    first_row: int  # the queries are rows first_row.. + B * Q in order, no padding; else -1
    # each real query as a decode row of its own, in valid_rows' order (queries of more than
    # one token on the CPU): its sequence's pages [N, NB] int32 and its context up to itself
    # [N] int32
    query_tables: torch.Tensor | None = None
    query_lens: torch.Tensor | None = None
    # draft trees (`TreeTokens` feeds): [B, 1, Q, NB * block size] which keys each query sees
    # (the context before its tree, then its ancestors and itself); and for decode rows, each
    # query's keys past its tree's start [N, depth + 1] int32 (positions of the root .. itself)
    # and that start [N] int32: its keys are 0..start-1, then those
    tree_mask: torch.Tensor | None = None
    query_remap: torch.Tensor | None = None
    query_bases: torch.Tensor | None = None


@attrs.frozen
class PackedGroup:
    """Sequences whose queries are attended in one variable-length call: sequence i's queries
    are the last q_i of its context k_i (causal, aligned to the context's end); its keys are
    read from the cache by slot, every sequence's after the other's."""

    rows: torch.Tensor  # [Nq] the queries' rows of the flattened batch, sequence after sequence
    first_row: int  # rows are first_row.. + Nq in order, no gap; else -1
    kv_slots: torch.Tensor  # [Nk] flat cache slot of each key: sequence i's 0..k_i - 1 in turn
    cu_q: torch.Tensor  # [B + 1] int32 offsets of each sequence's queries
    cu_k: torch.Tensor  # [B + 1] int32 offsets of each sequence's keys
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]


@attrs.frozen
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat KV slot of each token
    groups: tuple[AttnGroup | PackedGroup, ...]
    num_tokens: int


def build_group(
    starts: list[int],
    q_lens: list[int],
    ctx_lens: list[int],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
    per_query: bool = True,
    trees: list[tuple[int, ...]] | None = None,
) -> AttnGroup:
    """One attention group; seq i's queries are rows starts[i]..+q_lens[i] at the end of ctx.
    `per_query`: also each query's own table and context (`query_tables`), for a backend that
    attends queries of more than one token as decode rows (the CPU's). `trees`: each
    sequence's queries are a draft tree, their parents (`core/spec_tree.py`'s numbering)."""
    b, q = len(starts), max(q_lens)
    nb = max(cdiv(c, block_size) for c in ctx_lens)
    pages: list[int] = []  # built as flat lists, one tensor each: no small tensor per sequence
    for ctx, row in zip(ctx_lens, tables, strict=True):
        used = cdiv(ctx, block_size)
        pages += row[:used]
        pages += [0] * (nb - used)
    if q == 1:  # decodes: no padding (a step of a thousand runs this)
        rows, positions = starts, [ctx - 1 for ctx in ctx_lens]
    else:
        rows, positions = [], []
        for start, n, ctx in zip(starts, q_lens, ctx_lens, strict=True):
            rows += [*range(start, start + n), *[0] * (q - n)]
            positions += [*range(ctx - n, ctx), *[-1] * (q - n)]
    index = torch.tensor(rows, dtype=torch.long).view(b, q)
    q_pos = torch.tensor(positions, dtype=torch.long).view(b, q)
    table = torch.tensor(pages, dtype=torch.int32).view(b, nb)  # as the decode kernel reads
    flat = torch.arange(b) if q == 1 else (q_pos >= 0).flatten().nonzero().squeeze(1)
    in_order = rows == list(range(starts[0], starts[0] + b * q))
    query_tables = query_lens = None
    if q > 1 and per_query:
        query_tables = table.repeat_interleave(torch.tensor(q_lens), dim=0)
        query_lens = (q_pos.flatten()[flat] + 1).to(torch.int32)
    tree: dict[str, torch.Tensor] = {}
    if trees is not None:
        tree = tree_fields(trees, q_lens, ctx_lens, nb * block_size)
        q_pos, lens = tree.pop("q_pos"), tree.pop("query_lens")
        query_lens = lens if per_query else None
        tree = tree if per_query else {"tree_mask": tree["tree_mask"]}
    return AttnGroup(
        token_index=index.to(device),
        q_pos=q_pos.to(device),
        valid_flat=flat.to(device),
        valid_rows=index.flatten()[flat].to(device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        is_decode=q == 1,
        first_row=starts[0] if in_order else -1,
        query_tables=query_tables,
        query_lens=query_lens,
        **{name: t.to(device) for name, t in tree.items()},
    )


def tree_fields(
    trees: list[tuple[int, ...]], q_lens: list[int], ctx_lens: list[int], num_keys: int
) -> dict[str, torch.Tensor]:
    """A tree group's query positions [B, Q] (its tree's start plus the node's depth), its
    key mask, and for decode rows each query's context length, keys past its start and start
    (`AttnGroup`'s tree fields). A node's rotary position is its depth; its K/V row is its
    number past the start."""
    b, q = len(trees), max(q_lens)
    deepest = max(len(tree_path(parents, len(parents) - 1)) for parents in trees)
    q_pos = torch.full((b, q), -1, dtype=torch.long)
    mask = torch.zeros(b, 1, q, num_keys, dtype=torch.bool)
    mask[:, :, :, 0] = True  # padded queries see key 0, so that softmax stays finite
    lens, remap, bases = [], [], []
    for i, (parents, ctx) in enumerate(zip(trees, ctx_lens, strict=True)):
        base = ctx - len(parents)
        mask[i, 0, :, :base] = True
        for node in range(len(parents)):
            path = [0, *tree_path(parents, node)]
            q_pos[i, node] = base + len(path) - 1
            mask[i, 0, node, [base + a for a in path]] = True
            lens.append(base + len(path))
            remap.append([base + a for a in path] + [-1] * (deepest + 1 - len(path)))
            bases.append(base)
    return {
        "q_pos": q_pos,
        "tree_mask": mask,
        "query_lens": torch.tensor(lens, dtype=torch.int32),
        "query_remap": torch.tensor(remap, dtype=torch.int32),
        "query_bases": torch.tensor(bases, dtype=torch.int32),
    }


def build_packed(
    starts: list[int],
    q_lens: list[int],
    ctx_lens: list[int],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> PackedGroup:
    """One packed group; seq i's queries are rows starts[i]..+q_lens[i] at the end of ctx."""
    rows: list[int] = []
    slots: list[int] = []
    cu_q, cu_k = [0], [0]
    for start, n, ctx, table in zip(starts, q_lens, ctx_lens, tables, strict=True):
        rows.extend(range(start, start + n))
        slots.extend(slots_for(table, 0, ctx, block_size))
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + ctx)
    in_order = rows == list(range(starts[0], starts[0] + len(rows)))
    return PackedGroup(
        rows=torch.tensor(rows, dtype=torch.long).to(device),
        first_row=starts[0] if in_order else -1,
        kv_slots=torch.tensor(slots, dtype=torch.long).to(device),
        cu_q=torch.tensor(cu_q, dtype=torch.int32).to(device),
        cu_k=torch.tensor(cu_k, dtype=torch.int32).to(device),
        q_lens=tuple(q_lens),
        k_lens=tuple(ctx_lens),
    )


@functools.cache
def has_varlen_flash() -> bool:
    """Whether this torch has the variable-length flash attention op (CUDA builds)."""
    return hasattr(torch.ops.aten, "_flash_attention_forward") and torch.cuda.is_available()


def packed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: PackedGroup,
    scale: float,
    window: int = 0,
    device_kernels: bool = False,
) -> torch.Tensor:
    """q: [T, H, D] for the whole batch; returns [Nq, H, D] for the group's queries, in order.

    In half precision with `device_kernels` (CUDA's backend): flash attention over the packed
    queries and keys, one call (grouped-query heads read in place; causal with fewer queries
    than keys is aligned to the end, as each chunk's queries are). Elsewhere (float32 on CUDA,
    the CPU): each sequence alone, with its mask, the same arithmetic as the masked group path;
    so is a windowed layer's (`window`: each query sees itself and the window - 1 keys before
    it)."""
    if group.first_row >= 0:
        qs = q[group.first_row : group.first_row + len(group.rows)]
    else:
        qs = q[group.rows]
    k = gather_slots(k_cache, group.kv_slots, q.dtype)  # [Nk, KVH, D]
    v = gather_slots(v_cache, group.kv_slots, q.dtype)
    half = q.dtype in (torch.float16, torch.bfloat16)
    if device_kernels and half and has_varlen_flash():
        # a windowed layer: each query sees itself and the window - 1 keys before it
        sides = {"window_size_left": window - 1, "window_size_right": 0} if window else {}
        lens = (group.cu_q, group.cu_k, max(group.q_lens), max(group.k_lens))
        flash = torch.ops.aten._flash_attention_forward
        return flash(qs, k, v, *lens, 0.0, True, False, scale=scale, **sides)[0]
    out = torch.empty_like(qs)
    q_at = k_at = 0
    for n, ctx in zip(group.q_lens, group.k_lens, strict=True):
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
        if window:
            mask = mask.triu(ctx - n - window + 1)
        out[q_at : q_at + n] = F.scaled_dot_product_attention(
            qs[q_at : q_at + n].transpose(0, 1),
            k[k_at : k_at + ctx].transpose(0, 1),
            v[k_at : k_at + ctx].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=k.shape[1] != qs.shape[1],
        ).transpose(0, 1)
        q_at, k_at = q_at + n, k_at + ctx
    return out


def group_mask(group: AttnGroup, num_keys: int, window: int = 0) -> torch.Tensor:
    """[B, 1, Q, num_keys] True where a query may attend a key (made where the torch path
    needs it, on the group's device: a decode kernel never reads it); with `window`, only the
    window's last keys up to the query. Padded query rows attend key 0 so that softmax stays
    finite; their output is dropped."""
    if group.tree_mask is not None:
        return group.tree_mask[..., :num_keys]
    q_pos = group.q_pos[:, :, None]
    k_pos = torch.arange(num_keys, device=q_pos.device)
    mask = (k_pos[None, None, :] <= q_pos) & (q_pos >= 0)
    if window:
        mask &= k_pos[None, None, :] > q_pos - window
    mask[:, :, 0] |= group.q_pos < 0
    return mask[:, None]


def torch_group_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttnGroup,
    scale: float,
    window: int = 0,
    device_kernels: bool = False,
) -> torch.Tensor:
    """q: [T, H, D] for the whole batch; returns [B, Q, H, D] for this group's queries; with
    `device_kernels` (CUDA's backend) in one call of torch's memory-efficient kernel."""
    k = gather_kv(k_cache, group.block_tables, q.dtype)
    v = gather_kv(v_cache, group.block_tables, q.dtype)
    qg = q[group.token_index].transpose(1, 2)  # [B, H, Q, D]
    mask = group_mask(group, k.shape[2], window)
    if device_kernels:
        # torch's first choice on Hopper, cuDNN, builds an execution plan for every new shape
        # (found costing a second in the middle of serving); memory-efficient attention builds
        # nothing. It has no grouped-query mode, so the query heads sharing a KV head become
        # one longer query of that head (rows g * Q + i), and K/V are read as they are.
        b, h, nq, d = qg.shape
        kvh = k.shape[1]
        folded = qg.reshape(b, kvh, h // kvh * nq, d)
        folded_mask = mask.repeat(1, 1, h // kvh, 1)
        with sdpa_kernel(_CUDA_BACKENDS):
            out = F.scaled_dot_product_attention(folded, k, v, attn_mask=folded_mask, scale=scale)
        return out.reshape(b, h, nq, d).transpose(1, 2)
    gqa = k.shape[1] != qg.shape[1]
    # each sequence alone, over its own context and queries, whether its group holds others or
    # not: what a sequence's tokens get must not depend on which others share its group
    # (padding them to the longest changes the last bits, which an fp8 cache then rounds up to
    # a whole step)
    out = torch.zeros_like(qg)
    q_lens = (group.q_pos >= 0).sum(dim=1).tolist()
    for b, (n, ctx) in enumerate(zip(q_lens, group.seq_lens.tolist(), strict=True)):
        out[b : b + 1, :, :n] = F.scaled_dot_product_attention(
            qg[b : b + 1, :, :n],
            k[b : b + 1, :, :ctx],
            v[b : b + 1, :, :ctx],
            attn_mask=mask[b : b + 1, :, :n, :ctx],
            scale=scale,
            enable_gqa=gqa,
        )
    return out.transpose(1, 2)


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    decode_kernel=None,
    out: torch.Tensor | None = None,
    queries_alone: bool = False,
    window: int = 0,
    device_kernels: bool = False,
) -> torch.Tensor:
    """Attention for every token of the batch; q: [T, H, D] -> [T, H, D], into `out` if given
    (a static buffer of the piecewise graphs). On the CPU with a decode kernel, short queries
    (speculative verify) are attended as decode rows, one row a query; with `queries_alone`
    prefill chunks too, so that a token's attention is the same computation whether it was
    read in a prompt or decoded (a model whose every other operation is also row by row: q4's
    kernels). A windowed layer (`window` > 0) is masked to its window: by the decode kernel
    where the device's kernels take one, else in torch. `device_kernels`: the backend's device
    has its own attention kernels (CUDA's: a decode kernel with a window, torch's fused
    attention for `packed_attention` and `torch_group_attention`)."""
    out = torch.empty_like(q) if out is None else out
    if window and not device_kernels:
        decode_kernel = None
    windowed = {"window": window} if window else {}
    for group in batch.groups:
        if isinstance(group, PackedGroup):
            res = packed_attention(q, k_cache, v_cache, group, scale, window, device_kernels)
            if group.first_row >= 0:
                out[group.first_row : group.first_row + res.shape[0]] = res
            else:
                out[group.rows] = res
            continue
        if group.is_decode and decode_kernel is not None:
            tables, lens = group.block_tables, group.seq_lens
            if group.first_row >= 0:  # rows in order: the kernel reads and writes them in place
                rows = slice(group.first_row, group.first_row + len(tables))
                decode_kernel(q[rows], k_cache, v_cache, tables, lens, scale, out[rows], **windowed)
            else:
                index = group.token_index[:, 0]
                out[index] = decode_kernel(
                    q[index], k_cache, v_cache, tables, lens, scale, **windowed
                )
            continue
        short = group.token_index.shape[1] <= SHORT_QUERY or group.tree_mask is not None
        if group.query_lens is not None and decode_kernel is not None and (short or queries_alone):
            # each query a decode row, as plain decode attends it (a tree's: through its path)
            index = group.valid_rows
            tree: dict[str, torch.Tensor | int | None] = dict(windowed)
            if group.query_remap is not None:
                tree |= {"bases": group.query_bases, "remap": group.query_remap}
            out[index] = decode_kernel(
                q[index], k_cache, v_cache, group.query_tables, group.query_lens, scale, **tree
            )
            continue
        res = torch_group_attention(q, k_cache, v_cache, group, scale, window, device_kernels)
        res = res.flatten(0, 1)
        if group.first_row >= 0:
            out[group.first_row : group.first_row + res.shape[0]] = res
        else:
            # host-built indices: a boolean mask here would make the host wait for the device
            out[group.valid_rows] = res[group.valid_flat]
    return out
