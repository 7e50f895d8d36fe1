"""Train an EAGLE-style draft head (executors/spec/eagle.py) for a target model by
self-distillation: the target answers the questions given (or reads the answers given), its
states and choices are read (train/exchanges.py), and the head is fitted to them (train/fit.py)
and saved where `--speculative-method eagle` loads it. A held-out twentieth of the exchanges
measures what a greedy target would accept per step. With `--init PATH` the head saved there is
trained further (its shapes and draft vocabulary kept) on the states this run reads."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.model_source import model_config, resolve
from memstep.executors.process.inprocess import local_engine
from memstep.executors.spec.eagle import CONTEXT, AttnShape, save_head
from memstep.train.exchanges import load_cache, read_exchanges, save_cache, target_replies
from memstep.train.fit import (
    Exchanges,
    accepted_lengths,
    answer_choices,
    draft_vocabulary,
    fit,
    from_answers,
)
from memstep.train.saved_head import SavedHead, read_head

# (prompt ids, answer ids: empty where the target answers) for a tokenizer
PickExchanges = Callable[[object], list[tuple[list[int], list[int]]]]


def train_head(args: argparse.Namespace, pick: PickExchanges) -> int:
    """The whole run of `memstep train-draft` (its flags in `args`), the questions from `pick`."""
    started = time.perf_counter()
    saved = None
    if args.init is not None:  # refused before the target is loaded when made for another
        target = model_config(resolve(args.model, 0))
        saved = read_head(args.init, target.hidden_size, target.vocab_size)
    engine = target_engine(args.model, args.device)
    data = gather(args, engine, pick, started)
    n = sum(len(t) - s for t, s in zip(data[1], data[3], strict=True))
    print(f"{len(data[1])} exchanges, {n} answer states, {time.perf_counter() - started:.0f} s")
    worker = engine.executor.worker
    embed, head, mc = worker.weights["embed"], worker.model.lm_head, worker.model_cfg
    meta, attn = saved_shape(saved) if saved else new_shape(args, embed.shape[1], mc)
    if not meta.get("prompt_context", 0):
        data = from_answers(data)
    if saved is not None:
        vocab = saved.vocab
        print(f"continuing {args.init} ({meta.get('answers', 0)} answers so far)")
    else:
        tok_eos = list(engine.tokenizer.eos_token_ids)
        vocab = draft_vocabulary(answer_choices(data), args.draft_vocab, tok_eos)
    embed, head = embed.float(), head.float()[vocab.to(embed.device)]
    eps = mc.rms_eps
    engine.shutdown()
    del engine, worker  # the target's KV cache: training's attention needs the room
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    held = max(1, len(data[1]) // 20)
    train = tuple(part[:-held] for part in data)
    test = tuple(part[-held:] for part in data)
    params = fit(
        train,
        embed,
        head,
        vocab,
        eps,
        attn,
        init=None if saved is None else saved.params,
        intermediate=meta["intermediate"],
        passes=args.unroll,
        epochs=args.epochs,
        batch=args.batch,
        lr=args.lr,
        weight_decay=args.weight_decay,
        feature_weight=args.feature_weight,
        seed=args.seed,
    )
    for label, part in (("train", train), ("held-out", test)):
        some = tuple(p[: len(test[0])] for p in part)
        lengths = accepted_lengths(params, some, embed, head, vocab, eps, attn, args.unroll)
        shown = ", ".join(f"k={k + 1}: {x:.3f}" for k, x in enumerate(lengths))
        print(f"{label}: drafts accepted per step ({len(some[0])} exchanges) {shown}")
    meta["answers"] = meta.get("answers", 0) + len(train[1])  # every run's, this one's too
    save_head(args.out, {n: p.cpu() for n, p in params.items()}, vocab, meta)
    took = time.perf_counter() - started
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes), {took:.0f} s")
    return 0


def new_shape(args: argparse.Namespace, hidden: int, mc) -> tuple[dict, AttnShape | None]:
    """The file's `meta` and the attention half of a head trained from scratch."""
    meta = {"hidden": hidden, "vocab": mc.vocab_size, "intermediate": args.intermediate}
    if not args.attention:
        return meta, None
    shape = (mc.num_heads, mc.num_kv_heads, mc.head_dim, int(mc.rope_theta), CONTEXT)
    meta |= dict(zip(("heads", "kv_heads", "head_dim", "rope_theta", "window"), shape, strict=True))
    meta["prompt_context"] = int(args.prompt_context)
    return meta, AttnShape(*shape)


def saved_shape(saved: SavedHead) -> tuple[dict, AttnShape | None]:
    """The same of a head trained further (`--init`): the saved head's, whatever the flags."""
    meta = dict(saved.meta)
    meta["intermediate"] = saved.intermediate
    return meta, saved.attn


def target_engine(model: str, device: str) -> Engine:
    """The target in process; on a CPU with float32 weights (the same values as the q4 blocks,
    read faster in long prefills)."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    cfg = EngineConfig(
        model=model,
        device=device,
        dtype="float32" if on_cpu else "auto",
        quantization="none",
        max_num_seqs=8 if on_cpu else 256,
        max_num_batched_tokens=2048,
    )
    return local_engine(cfg)


def gather(
    args: argparse.Namespace, engine: Engine, pick: PickExchanges, started: float
) -> Exchanges:
    """The exchanges read by the target, from `--cache` when it exists (and into it when not)."""
    if args.cache is not None and args.cache.exists():
        return load_cache(args.cache)
    exchanges = pick(engine.tokenizer)
    if args.replies == "target":
        exchanges = target_replies(engine, exchanges, args.max_tokens)
    print(f"{len(exchanges)} exchanges, {time.perf_counter() - started:.0f} s")
    worker = engine.executor.worker
    data = read_exchanges(exchanges, worker.model, worker.cfg.block_size, started)
    if args.cache is not None:
        save_cache(args.cache, data)
    return data
