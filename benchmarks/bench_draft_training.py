"""The EAGLE head's acceptance against the number of answers it was trained on.

Rounds of `memstep train-draft`, each continuing the head of the round before (`--init`) on
`--answers` new questions (`--skip`: none read twice), the target's states read again in each
round; after each, the head's drafts accepted per step on one fixed held-out set of questions
(the first `--held-out` picked, which no round trains on), as `train-draft` measures its own:
a greedy target, drafting k = 1, 2, 3 tokens from every position of the answers.

    python benchmarks/bench_draft_training.py [--rounds 4] [--answers 32] [--held-out 16]
        [--max-tokens 64] [--init HEAD.npz] [--out-dir DIR] [-- TRAIN-DRAFT FLAGS...]
    python benchmarks/bench_draft_training.py --heads SHIPPED.npz,NEW.npz [--held-out 64]
        [--prompts QUESTIONS.jsonl]    (no training: each head's acceptance on the held-out set)

Without `--init` the first round trains a head from scratch: its draft vocabulary is the tokens
the target chose in that round's answers, and later rounds keep it (train-draft --init keeps a
saved head's vocabulary). `--init` the committed head to see what more answers add to it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from memstep.cli import train_draft
from memstep.cli.main import main as memstep
from memstep.core.engine import Engine
from memstep.train.draft_head import target_engine
from memstep.train.exchanges import read_exchanges, target_replies
from memstep.train.fit import Exchanges, accepted_lengths, from_answers
from memstep.train.saved_head import read_head


def held_out(options: argparse.Namespace) -> tuple[Exchanges, Engine]:
    """The held-out exchanges as the target reads them, and the target's engine."""
    parser = argparse.ArgumentParser()
    train_draft.add_arguments(parser)
    prompts = ["--prompts", str(options.prompts)] if options.prompts else []
    args = parser.parse_args(
        ["--conversations", str(options.held_out), "--max-tokens", str(options.max_tokens)]
        + prompts
    )
    engine = target_engine(args.model, options.device)
    exchanges = target_replies(
        engine, train_draft.pick_exchanges(args, engine.tokenizer), args.max_tokens
    )
    worker = engine.executor.worker
    data = read_exchanges(exchanges, worker.model, worker.cfg.block_size, time.perf_counter())
    return data, engine


def acceptance(
    head_path: Path, data: Exchanges, engine: Engine, passes: int
) -> tuple[int, list[float]]:
    """(answers the head was trained on, drafts accepted per step at k = 1..passes)."""
    worker = engine.executor.worker
    embed, mc = worker.weights["embed"].float(), worker.model_cfg
    head = read_head(head_path, embed.shape[1], mc.vocab_size)
    if not head.reads_prompt:
        data = from_answers(data)
    lm_head = worker.model.lm_head.float()[head.vocab]
    lengths = accepted_lengths(
        head.params, data, embed, lm_head, head.vocab, mc.rms_eps, head.attn, passes
    )
    return head.meta.get("answers", 0), lengths


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--answers", type=int, default=32, help="new questions per round")
    ap.add_argument("--held-out", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--init", type=Path, default=None, help="the head the first round continues")
    ap.add_argument("--out-dir", type=Path, default=None, help="keep each round's head here")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=Path, default=None, help="train-draft --prompts' JSONL")
    ap.add_argument("--heads", default=None, help="comma-separated .npz: measure these, train none")
    options = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    out_dir = options.out_dir or Path(tempfile.mkdtemp(prefix="draft-rounds-"))
    data, engine = held_out(options)
    print(f"held out: {len(data[1])} exchanges; each round: {options.answers} new questions")
    print(f"{'round':>5} {'answers':>8} {'k=1':>6} {'k=2':>6} {'k=3':>6}  (accepted per step)")
    for path in options.heads.split(",") if options.heads else []:
        answers, lengths = acceptance(Path(path), data, engine, 3)
        print(f"{Path(path).name} {answers:>8} " + " ".join(f"{x:6.3f}" for x in lengths))
    if options.heads:
        engine.shutdown()
        return
    head = options.init
    if head is not None:
        answers, lengths = acceptance(head, data, engine, 3)
        print(f"{'init':>5} {answers:>8} " + " ".join(f"{x:6.3f}" for x in lengths), flush=True)
    for r in range(options.rounds):
        out = out_dir / f"round-{r + 1}.npz"
        skip = options.held_out + r * options.answers
        run = ["train-draft", "--skip", str(skip), "--conversations", str(options.answers)]
        run += ["--max-tokens", str(options.max_tokens), "--device", options.device]
        run += ["--out", str(out), *(["--init", str(head)] if head else []), *extra]
        if memstep(run) != 0:
            sys.exit(f"train-draft failed in round {r + 1}")
        head = out
        answers, lengths = acceptance(head, data, engine, 3)
        print(f"{r + 1:>5} {answers:>8} " + " ".join(f"{x:6.3f}" for x in lengths), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
