"""`memstep train-draft`: train the EAGLE-style draft head (executors/eagle.py) for a model by
self-distillation on ShareGPT text: the target reads ShareGPT exchanges (first question and
its answer, in the chat template) in memstep's own model code; at each answer position its
final hidden state and its own greedy choice are kept, and the head learns to predict, from the
hidden state at t-1 and token t, the hidden state at t and the target's choice there, unrolled
over a few draft positions so that it also learns from its own predictions. The labels are the
target's choices, not the text's: the head learns what the target would say.

    memstep train-draft [--conversations 800] [--max-tokens 320] [--epochs 3] [--out PATH]

The defaults made the committed head (8.5 min of reading and 4 min of training on 2 cores).

The written `.npz` is what `--speculative-method eagle` loads (`--draft-model PATH`); the one
for SmolLM2 is committed (executors/drafts/).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from memstep.cli.datasets import sharegpt_pairs
from memstep.core.config import EngineConfig
from memstep.events.plan import SeqPlan
from memstep.executors import kv_cache
from memstep.executors.batch_builder import build_batch
from memstep.executors.eagle import SMOLLM2_HEAD, draft_step, init_params, save_head
from memstep.executors.inprocess import local_engine
from memstep.executors.llama import LlamaModel


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="the target model")
    p.add_argument("--out", type=Path, default=SMOLLM2_HEAD, help="where the .npz goes")
    p.add_argument("--conversations", type=int, default=800, help="ShareGPT exchanges read")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=256, help="longer questions are skipped"
    )
    p.add_argument(
        "--max-tokens", type=int, default=320, help="answer tokens per exchange, at most"
    )
    p.add_argument("--draft-vocab", type=int, default=6144, help="the target's most chosen tokens")
    p.add_argument("--intermediate", type=int, default=512, help="the block's MLP width")
    p.add_argument("--epochs", type=int, default=3, help="passes over what was read")
    p.add_argument("--unroll", type=int, default=2, help="draft positions trained per sample")
    p.add_argument("--batch", type=int, default=256, help="samples per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's weight decay")
    p.add_argument("--feature-weight", type=float, default=0.5, help="of the hidden-state loss")
    p.add_argument("--seed", type=int, default=0, help="the exchanges' order and the init")
    p.add_argument(
        "--cache", type=Path, default=None, help="keep the hidden states read here, and reuse them"
    )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    # float32 weights: the same values as the q4 blocks, read faster in long prefills
    engine = local_engine(EngineConfig(model=args.model, max_num_seqs=1, quantization="none"))
    tok, worker = engine.tokenizer, engine.executor.worker
    if args.cache is not None and args.cache.exists():
        data = load_cache(args.cache)
    else:
        data = read_exchanges(args, tok, worker.model, worker.cfg.block_size, started)
        if args.cache is not None:
            save_cache(args.cache, data)
    features, tokens, chosen = data
    n = sum(len(t) for t in tokens)
    print(f"{len(features)} exchanges, {n} hidden states, {time.perf_counter() - started:.0f} s")
    embed, head, eps = worker.weights["embed"], worker.model.lm_head, worker.model_cfg.rms_eps
    meta = {"hidden": embed.shape[1], "vocab": worker.model_cfg.vocab_size}
    vocab = draft_vocabulary(chosen, args.draft_vocab, list(tok.eos_token_ids))
    engine.shutdown()
    params = train(args, data, embed.float(), head.float()[vocab], vocab, eps)
    save_head(args.out, params, vocab, meta | {"intermediate": args.intermediate})
    took = time.perf_counter() - started
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes), {took:.0f} s")
    return 0


Exchanges = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def read_exchanges(args, tok, model: LlamaModel, block_size: int, started: float) -> Exchanges:
    """Per ShareGPT exchange: the hidden states over its answer, its answer's tokens, and the
    target's choices. Row i: the hidden state after the prompt and answer[:i], the target's
    token there, and answer[i] (padded), the token a draft step reads beside it."""
    pairs = sharegpt_pairs()
    random.Random(args.seed).shuffle(pairs)
    features: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    chosen: list[torch.Tensor] = []
    for human, reply in pairs:
        if len(features) == args.conversations:
            break
        prompt = tok.encode_chat([{"role": "user", "content": human}])
        answer = tok.encode(reply)[: args.max_tokens]
        if len(prompt) > args.max_prompt_tokens or len(answer) < 8:
            continue
        hidden = final_hidden(model, prompt + answer, block_size)[len(prompt) - 1 :]
        features.append(hidden.to(torch.float16))
        chosen.append(target_choices(model, hidden))
        tokens.append(torch.tensor([*answer, 0]))
        if len(features) % 100 == 0:
            print(f"  {len(features)} exchanges read, {time.perf_counter() - started:.0f} s")
    return features, tokens, chosen


def save_cache(path: Path, data: Exchanges) -> None:
    features, tokens, chosen = data
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    with path.open("wb") as fh:
        np.savez(
            fh,
            features=torch.cat(features).numpy(),
            tokens=torch.cat(tokens).numpy(),
            chosen=torch.cat(chosen).numpy(),
            lengths=lengths,
        )


def load_cache(path: Path) -> Exchanges:
    with np.load(path, allow_pickle=False) as data:
        splits = data["lengths"].tolist()
        return tuple(  # type: ignore[return-value]
            list(torch.from_numpy(data[name]).split(splits))
            for name in ("features", "tokens", "chosen")
        )


@torch.inference_mode()
def final_hidden(model: LlamaModel, ids: list[int], block_size: int) -> torch.Tensor:
    """The target's final hidden states over `ids` ([T, H]), in one prefill over a KV cache of
    its own."""
    cfg = model.cfg
    pages = math.ceil(len(ids) / block_size)
    device = model.w["embed"].device
    shape = (pages, block_size, cfg.num_kv_heads, cfg.head_dim)
    kv = kv_cache.allocate(cfg.num_layers, shape, model.w["embed"].dtype, device)
    seq = SeqPlan("train", 0, ids, list(range(pages)), False, 0, len(ids), {})
    batch, _ = build_batch([(seq, ids)], block_size, device)
    return model.forward(batch, kv)


@torch.inference_mode()
def target_choices(model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
    """The target's greedy token after each hidden state: the labels (self-distillation)."""
    return torch.cat([model.logits(part).argmax(-1) for part in hidden.split(256)])


def draft_vocabulary(tokens: list[torch.Tensor], size: int, always: list[int]) -> torch.Tensor:
    """The `size` tokens the target chose most often, end-of-sequence tokens first."""
    counts = torch.bincount(torch.cat(tokens))
    order = [t for t in counts.argsort(descending=True).tolist() if counts[t] > 0]
    picked = always + [t for t in order if t not in always]
    return torch.tensor(picked[:size])


def train(
    args: argparse.Namespace,
    data: Exchanges,
    embed: torch.Tensor,
    head: torch.Tensor,
    vocab: torch.Tensor,
    eps: float,
) -> dict[str, torch.Tensor]:
    """Fit the head: at each of `unroll` positions, cross-entropy of the target's choice over
    the draft vocabulary plus the smooth-L1 distance to the target's hidden state; positions
    after the first start from the head's own prediction."""
    feats, ids, chosen = (torch.cat(part) for part in data)
    labels = torch.full((int(embed.shape[0]),), -100, dtype=torch.long)
    labels[vocab] = torch.arange(len(vocab))
    covered = float((labels[chosen] >= 0).float().mean())
    print(f"the draft vocabulary holds {covered:.1%} of the target's choices")
    starts = unroll_starts([len(t) for t in data[1]], args.unroll)
    params = init_params(embed.shape[1], args.intermediate, args.seed)
    for p in params.values():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params.values(), lr=args.lr, weight_decay=args.weight_decay)
    steps = args.epochs * math.ceil(len(starts) / args.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(args.seed)
    for epoch in range(args.epochs):
        order = starts[torch.randperm(len(starts), generator=gen)]
        hits = total = 0
        for i in range(0, len(order), args.batch):
            j = order[i : i + args.batch]
            hidden, loss = feats[j].float(), torch.zeros(())
            for u in range(args.unroll):
                hidden, logits = draft_step(params, embed, head, hidden, ids[j + u], eps)
                target = labels[chosen[j + u + 1]]
                loss = loss + F.cross_entropy(logits, target, ignore_index=-100)
                truth = feats[j + u + 1].float()
                loss = loss + args.feature_weight * F.smooth_l1_loss(hidden, truth)
                if u == 0:
                    hits += int((logits.argmax(-1) == target).sum())
                    total += len(j)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if i // args.batch % 200 == 0:
                print(f"  batch {i // args.batch}: loss {loss.item():.3f}", flush=True)
        print(f"epoch {epoch + 1}: first-draft accuracy {hits / total:.3f} over {total} samples")
    return {name: p.detach() for name, p in params.items()}


def unroll_starts(lengths: list[int], unroll: int) -> torch.Tensor:
    """Flat indices j where rows j .. j + unroll all belong to one exchange."""
    out: list[int] = []
    offset = 0
    for n in lengths:
        out.extend(range(offset, offset + n - unroll))
        offset += n
    return torch.tensor(out, dtype=torch.long)
