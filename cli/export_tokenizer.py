"""`memstep export-tokenizer`: a model's GGUF tokenizer written out as tokenizer.json.

A few MB that can travel to a machine without the model file, where `--tokenizer` gives a
random: model the real tokenizer's token lengths (the GPU benchmarks do this).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from memstep.core.model_source import ModelError, resolve
from memstep.core.tokenizer import gguf_tokenizer_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 or a .gguf file")
    p.add_argument(
        "--out", type=Path, default=Path("tokenizer.json"), help="where the tokenizer.json goes"
    )


def run(args: argparse.Namespace) -> int:
    source = resolve(args.model)
    if source.kind != "gguf" or source.path is None:
        raise ModelError(f"{args.model} is not a GGUF model; its tokenizer is not in one file")
    args.out.write_text(gguf_tokenizer_json(source.path))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0
