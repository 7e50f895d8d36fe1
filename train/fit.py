"""Fitting an EAGLE-style head (executors/spec/eagle.py) to what the target read: the training loop
of `memstep train-draft`, and its held-out measure of what serving will accept.

An exchange is three rows per position i: the target's final hidden state F[i] after the
tokens up to i, the token X[i] after it (the token that state chose: the pair the head reads),
and the target's own greedy choice C[i]; and the row where the answer starts (the state after
the prompt and the answer's first token), 0 when the rows begin there. The head reads pair i and
predicts F[i+1] and C[i+1]; only predictions inside the answer, from chains that start at or
after its first row, count (rows before it are prompt pairs for the attention half to read).

Training unrolls `passes` draft positions as serving drafts them: pass 1 reads the
target's states; pass u reads pass u-1's prediction of the state one position back, and (with
the attention half) attends the target's pairs up to the last true one and the pairs that this
chain of drafts made since, exactly the keys a serving draft sees.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from memstep.executors.spec.eagle import AttnShape, Matmuls, block_out, init_params, pair_input, qkv

Exchanges = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[int]]


def draft_vocabulary(tokens: list[torch.Tensor], size: int, always: list[int]) -> torch.Tensor:
    """The `size` tokens the target chose most often, end-of-sequence tokens first."""
    counts = torch.bincount(torch.cat(tokens))
    order = [t for t in counts.argsort(descending=True).tolist() if counts[t] > 0]
    picked = always + [t for t in order if t not in always]
    return torch.tensor(picked[:size])


def answer_choices(data: Exchanges) -> list[torch.Tensor]:
    """The target's choices inside each exchange's answer (from its first row on)."""
    return [chosen[start:] for chosen, start in zip(data[2], data[3], strict=True)]


def from_answers(data: Exchanges) -> Exchanges:
    """The exchanges without their prompt pairs: each from its answer's first row."""
    starts = data[3]
    cut = [[x[s:] for x, s in zip(part, starts, strict=True)] for part in data[:3]]
    return cut[0], cut[1], cut[2], [0] * len(starts)


def draft_labels(vocab: torch.Tensor, vocab_size: int, device) -> torch.Tensor:
    """Each target token's index in the draft vocabulary, -100 (ignored) for the others."""
    labels = torch.full((vocab_size,), -100, dtype=torch.long, device=device)
    labels[vocab.to(device)] = torch.arange(len(vocab), device=device)
    return labels


def pass_masks(length: int, passes: int, window: int, device) -> list[torch.Tensor]:
    """For pass u (1-based), which keys query i may read among [pass 1 keys; ...; pass u keys]
    ([T, u * T], True = read): pass 1's keys up to position i - u + 1 (the target's pairs, at
    most `window` back), and pass v's key at i - u + v (the chain's own drafts)."""
    i = torch.arange(length, device=device).unsqueeze(1)
    j = torch.arange(length, device=device).unsqueeze(0)
    masks = []
    for u in range(1, passes + 1):
        parts = [(j <= i - u + 1) & (j > i - u + 1 - window)]
        parts += [j == i - u + v for v in range(2, u + 1)]
        masks.append(torch.cat(parts, dim=1))
    return masks


def unrolled(
    params: dict[str, torch.Tensor],
    embed: torch.Tensor,
    head: torch.Tensor,
    feats: torch.Tensor,
    tokens: torch.Tensor,
    passes: int,
    attn: AttnShape | None,
    eps: float,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(predicted states [B, T, H], logits [B, T, V]) of each pass over padded exchanges:
    index i of pass u predicts F[i + 1] from a chain that left the target's states at i-u+1."""
    length = feats.shape[1]
    positions = torch.arange(length, device=feats.device)
    masks = pass_masks(length, passes, attn.window, feats.device) if attn else []
    rotation = attn.rotation(positions, feats.dtype) if attn else None
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    hidden = feats
    mm = Matmuls(params, head)
    for u in range(passes):
        x = pair_input(mm, embed, hidden, tokens)
        attended = None
        if attn is not None:
            q, k, v = qkv(params, mm, x, rotation, attn, eps)
            keys.append(k)
            values.append(v)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                torch.cat(keys, dim=1).transpose(1, 2),
                torch.cat(values, dim=1).transpose(1, 2),
                attn_mask=masks[u],
                enable_gqa=True,
            )
            attended = out.transpose(1, 2).flatten(2)
        predicted, logits = block_out(params, mm, x, attended, eps)
        yield predicted, logits
        # the next pass reads, at i, this pass's prediction of F[i] (made at i - 1)
        hidden = torch.cat([feats[:, :1], predicted[:, :-1]], dim=1)


def padded(data: Exchanges, pick: list[int], device) -> tuple[torch.Tensor, ...]:
    """Exchanges `pick` as [B, T] batches: states, tokens, choices; lengths and the answers'
    first rows [B]."""
    lengths = torch.tensor([len(data[1][i]) for i in pick])
    length = int(lengths.max())
    hidden = data[0][pick[0]].shape[1]
    feats = torch.zeros(len(pick), length, hidden)
    tokens = torch.zeros(len(pick), length, dtype=torch.long)
    chosen = torch.zeros(len(pick), length, dtype=torch.long)
    for b, i in enumerate(pick):
        n = len(data[1][i])
        feats[b, :n], tokens[b, :n], chosen[b, :n] = data[0][i].float(), data[1][i], data[2][i]
    starts = torch.tensor([data[3][i] for i in pick])
    return tuple(t.to(device) for t in (feats, tokens, chosen, lengths, starts))


def pass_terms(feats, chosen, lengths, starts, labels, u: int):
    """Of pass u (0-based): which indices count ([B, T-1]: a next position exists and the chain
    started inside the answer), the labels there and the true next states."""
    _, length = chosen.shape
    i = torch.arange(length - 1, device=chosen.device).unsqueeze(0)
    valid = (i + 1 < lengths.unsqueeze(1)) & (i - u >= starts.unsqueeze(1))
    return valid, labels[chosen[:, 1:]], feats[:, 1:]


def fit(
    data: Exchanges,
    embed: torch.Tensor,
    head: torch.Tensor,
    vocab: torch.Tensor,
    eps: float,
    attn: AttnShape | None,
    *,
    init: dict[str, torch.Tensor] | None = None,
    intermediate: int,
    passes: int,
    epochs: int,
    batch: int,
    lr: float,
    weight_decay: float,
    feature_weight: float,
    seed: int,
    log=print,
) -> dict[str, torch.Tensor]:
    """Fit a head: per pass, cross-entropy of the target's choice over the draft vocabulary plus
    `feature_weight` x smooth-L1 to the target's next state. `init`: a saved head's parameters
    to start from (`train-draft --init`) instead of fresh ones."""
    device = embed.device
    labels = draft_labels(vocab, int(embed.shape[0]), device)
    covered = float((labels[torch.cat(answer_choices(data)).to(device)] >= 0).float().mean())
    log(f"the draft vocabulary holds {covered:.1%} of the target's choices")
    start = init if init is not None else init_params(embed.shape[1], intermediate, seed, attn)
    params = {n: p.to(device, torch.float32).clone().requires_grad_(True) for n, p in start.items()}
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=weight_decay)
    steps = epochs * math.ceil(len(data[1]) / batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(len(data[1]), generator=gen).tolist()
        for step, start in enumerate(range(0, len(order), batch)):
            feats, tokens, chosen, lengths, starts = padded(
                data, order[start : start + batch], device
            )
            loss = torch.zeros((), device=device)
            for u, (pred, logits) in enumerate(
                unrolled(params, embed, head, feats, tokens, passes, attn, eps)
            ):
                valid, target, truth = pass_terms(feats, chosen, lengths, starts, labels, u)
                logits, pred = logits[:, :-1][valid], pred[:, :-1][valid]
                loss = loss + F.cross_entropy(logits, target[valid], ignore_index=-100)
                loss = loss + feature_weight * F.smooth_l1_loss(pred, truth[valid])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if step % 100 == 0:
                log(f"  epoch {epoch + 1} batch {step}: loss {loss.item():.3f}")
    return {name: p.detach() for name, p in params.items()}


@torch.no_grad()
def accepted_lengths(
    params: dict[str, torch.Tensor],
    data: Exchanges,
    embed: torch.Tensor,
    head: torch.Tensor,
    vocab: torch.Tensor,
    eps: float,
    attn: AttnShape | None,
    passes: int,
    batch: int = 64,
) -> list[float]:
    """Mean drafts a greedy target accepts per step, drafting k = 1 .. passes tokens, from every
    position of the held-out exchanges (k = 1: the first draft's accuracy)."""
    device = embed.device
    labels = draft_labels(vocab, int(embed.shape[0]), device)
    sums, count = [0.0] * passes, 0
    for start in range(0, len(data[1]), batch):
        pick = list(range(start, min(start + batch, len(data[1]))))
        feats, tokens, chosen, lengths, first = padded(data, pick, device)
        hits = []
        for u, (_, logits) in enumerate(
            unrolled(params, embed, head, feats, tokens, passes, attn, eps)
        ):
            valid, target, _ = pass_terms(feats, chosen, lengths, first, labels, u)
            hit = (logits[:, :-1].argmax(-1) == target) & valid
            hits.append(F.pad(hit, (0, passes)))  # room to look u positions ahead
        starts = pass_terms(feats, chosen, lengths, first, labels, 0)[0]
        chain = starts.clone()
        for u in range(passes):
            chain = chain & hits[u][:, u : u + starts.shape[1]]
            sums[u] += float(chain.sum())
        count += int(starts.sum())
    return [sum(sums[: k + 1]) / count for k in range(passes)]
