"""A saved EAGLE head read back for more training (`memstep train-draft --init PATH`).

Only the head travels between runs: its matrices (float16 in the file, float32 here), its draft
vocabulary and its shapes. The target's states are read again in each run from the questions
that run is given, so a head can be trained further on any machine that has the target.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import torch

from memstep.core.config import ConfigError
from memstep.executors.spec.eagle import ATTENTION, CONTEXT, MATRICES, AttnShape


class HeadMismatch(ConfigError):
    """The saved head was made for another target (its hidden size or vocabulary)."""


@attrs.frozen
class SavedHead:
    params: dict[str, torch.Tensor]  # float32, as `init_params` makes them
    vocab: torch.Tensor  # the draft vocabulary: target token ids, long
    meta: dict[str, int]  # the `meta_*` entries of the file, without the prefix

    @property
    def intermediate(self) -> int:
        return int(self.params["gate_up"].shape[0]) // 2

    @property
    def attn(self) -> AttnShape | None:
        if "q" not in self.params:
            return None
        m = self.meta
        return AttnShape(m["heads"], m["kv_heads"], m["head_dim"], m["rope_theta"], CONTEXT)

    @property
    def reads_prompt(self) -> bool:
        return self.attn is not None and bool(self.meta.get("prompt_context", 0))


def read_head(path: Path, hidden: int, vocab_size: int) -> SavedHead:
    """The head at `path`, checked against the target's hidden size and vocabulary."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    meta = {k.removeprefix("meta_"): int(v) for k, v in arrays.items() if k.startswith("meta_")}
    if (meta.get("hidden"), meta.get("vocab")) != (hidden, vocab_size):
        raise HeadMismatch(
            f"{path} was trained for hidden size {meta.get('hidden')} and vocabulary "
            f"{meta.get('vocab')}, not the target's {hidden} and {vocab_size}"
        )
    names = [*MATRICES, *(ATTENTION if "q" in arrays else ())]
    params = {n: torch.from_numpy(arrays[n]).float() for n in names}
    return SavedHead(params, torch.from_numpy(arrays["vocab"]).long(), meta)
