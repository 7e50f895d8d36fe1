"""`memstep export-tokenizer`: a model's GGUF tokenizer written out as a folder transformers loads.

The folder holds tokenizer.json and tokenizer_config.json (the special tokens and the chat
template), so `AutoTokenizer.from_pretrained(folder)` is the model's tokenizer whole, e.g. for
lm-eval's `tokenizer=` or a client that counts tokens.  A few MB that can travel to a machine
without the model file, where `--tokenizer FOLDER/tokenizer.json` gives a random: model the real
tokenizer's token lengths (the GPU benchmarks do this).  An `--out` ending in `.json` writes
that one file alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from memstep.core.model_source import ModelError, resolve
from memstep.core.tokenizer import gguf_tokenizer_folder, gguf_tokenizer_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 or a .gguf file")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("tokenizer"),
        help="the folder to write (default: %(default)s); a name ending in .json: that file alone",
    )


def run(args: argparse.Namespace) -> int:
    source = resolve(args.model)
    if source.kind != "gguf" or source.path is None:
        raise ModelError(f"{args.model} is not a GGUF model; its tokenizer is not in one file")
    if args.out.suffix == ".json":
        args.out.write_text(gguf_tokenizer_json(source.path))
        print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
        return 0
    gguf_tokenizer_folder(source.path, args.out)
    print(f"wrote {args.out}/ (tokenizer.json, tokenizer_config.json)")
    return 0
