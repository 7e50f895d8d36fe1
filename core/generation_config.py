"""A model's own sampling defaults, as vLLM's `--generation-config` takes them.

`auto` (the default) reads the model's generation_config.json (an HF folder) or, for the model
shipped with memstep (SmolLM2-135M-Instruct's GGUF), the values its card recommends; `vllm`
keeps SamplingParams' bare defaults (temperature 1.0); a folder path reads that folder's
generation_config.json.  The defaults fill only what a request leaves out: a request's own
values win.  A model sampled at bare temperature 1.0 where its authors say otherwise answers
nonsense (SmolLM2 at 1.0: "La Délpe is une légère paysée..." for the capital of France).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memstep.core.model_source import ModelError, ModelSource, shipped_gguf_path

MODES = ("auto", "vllm")  # or a folder that holds a generation_config.json
# generation_config.json's keys that vLLM takes, and the SamplingParams field each sets
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
SHIPPED = {"temperature": 0.2, "top_p": 0.9}  # SmolLM2-135M-Instruct's model card


def sampling_defaults(source: ModelSource, mode: str) -> dict[str, Any]:
    """The SamplingParams fields `mode` sets for requests of `source`'s model."""
    if mode == "vllm":
        return {}
    if mode != "auto":
        return read_generation_config(Path(mode), required=True)
    if source.kind == "hf" and source.path is not None:
        return read_generation_config(source.path, required=False)
    if source.kind == "gguf" and source.path is not None and _is_shipped(source.path):
        return dict(SHIPPED)
    return {}


def read_generation_config(folder: Path, required: bool) -> dict[str, Any]:
    """The sampling fields of `folder`/generation_config.json ({} where it has none and the
    file is not `required`)."""
    file = folder / "generation_config.json"
    if not file.is_file():
        if required:
            raise ModelError(f"--generation-config {folder}: no generation_config.json there")
        return {}
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{file} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{file} is not a JSON object")
    return {name: data[key] for key, name in KEYS.items() if data.get(key) is not None}


def _is_shipped(path: Path) -> bool:
    try:
        return path.resolve() == shipped_gguf_path().resolve()
    except ModelError:
        return False
