"""What the draft head learns from: per exchange (a question in the chat template and an
answer), the target's final hidden states, the token after each, and the target's own greedy
choice there, read in memstep's own model code; a cache of them in one `.npz`."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from memstep.core.sampling_params import SamplingParams
from memstep.events.plan import SeqPlan
from memstep.executors.model import kv_cache
from memstep.executors.model.llama import LlamaModel
from memstep.executors.runtime.batch_builder import build_batch
from memstep.train.fit import Exchanges


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
    seq = SeqPlan(
        request_id="train",
        start_pos=0,
        token_ids=ids,
        block_table=list(range(pages)),
        samples=False,
        num_drafts=0,
        prompt_len=len(ids),
    )
    batch, _ = build_batch([(seq, ids)], block_size, device)
    return model.forward(batch, kv)


@torch.inference_mode()
def target_choices(model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
    """The target's greedy token after each hidden state: the labels (self-distillation)."""
    return torch.cat([model.logits(part).argmax(-1) for part in hidden.split(256)])
