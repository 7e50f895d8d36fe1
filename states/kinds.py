"""Serving step kinds: the buffers each owns, and the hooks that claim and release them.

A kind's buffers are claimed from the arena by `enter` and released by `exit`; anything a kind
keeps between steps is either one of those buffers or per-request state dropped by `exit`.
The executor calls `exit(previous)` then `enter(next)` whenever the step kind changes.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from memstep.core.config import EngineConfig
from memstep.core.model_config import ModelConfig
from memstep.states.arena import Arena, nbytes_of


@attrs.frozen
class BufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)


@attrs.frozen
class KindEnv:
    """What a kind needs to size its buffers."""

    cfg: EngineConfig
    model: ModelConfig
    dtype: torch.dtype
    num_kv_blocks: int
    device_type: str = "cpu"
    draft_context: int = 0  # slots a row of an EAGLE head's context (eagle.draft_context); 0: none

    @property
    def sampler_rows(self) -> int:
        """The most rows one step samples: every sequence, each with its drafts."""
        return self.cfg.max_num_seqs * (self.cfg.num_lookahead_slots + 1)


@attrs.define
class StepOutputs:
    """What a step produced that a kind's `after_step` hook may look at."""

    hidden: torch.Tensor  # [R, hidden] final hidden states of the sampled rows
    num_rows: int
    num_admitted: int = 0  # requests whose first plan this step was


class StepKind:
    name: ClassVar[str] = "?"

    def __init__(self, env: KindEnv):
        self.env = env
        self.held: dict[str, torch.Tensor] = {}

    def buffers(self) -> list[BufferSpec]:
        return []

    def enter(self, arena: Arena, step: int) -> int:
        """Claim every buffer; the bytes claimed, as the arena counts them (aligned), so that
        they equal what `exit` releases to the byte."""
        before = arena.claimed_bytes
        for spec in self.buffers():
            self.held[spec.name] = arena.claim(self.name, spec.name, spec.shape, spec.dtype, step)
        self.on_enter()
        return arena.claimed_bytes - before

    def exit(self, arena: Arena, step: int) -> int:
        """Drop per-request state and release every buffer; the bytes released."""
        self.on_exit()
        released = 0
        for name in list(self.held):
            released += arena.release(self.name, name, self.held.pop(name))
        return released

    def on_enter(self) -> None:
        pass

    def on_exit(self) -> None:
        pass

    def after_step(self, outputs: StepOutputs) -> None:
        pass


class NoSpec(StepKind):
    """Plain steps: prefill chunks and single-token decodes; owns nothing between steps."""

    name = "no_spec"


class Spec(StepKind):
    """Speculative steps: owns the acceptance workspace and, with a draft model, the drafts'
    probabilities and the draft KV cache (n-gram drafts are deterministic: no probabilities);
    with an EAGLE head, `previous_hidden_states`: each request's last hidden state, one row each,
    and for a head with attention `draft_context`: the keys and values of the pairs it has read,
    in the same row (the last of them ring-wise, then slots for the drafts' own pairs:
    executors/spec/eagle.draft_context).

    `draft_len[request_id]` is how many of a request's tokens the draft KV holds,
    `hidden_of[request_id]` the row of its hidden state and how many tokens that state follows,
    and `context_of[request_id]` how many pairs its context has read; all are dropped on exit
    with the buffers themselves, so re-entering `spec` rebuilds the draft state from the
    request's tokens instead of trusting anything stale.
    """

    name = "spec"

    def __init__(self, env: KindEnv):
        super().__init__(env)
        self.draft_len: dict[str, int] = {}
        self.hidden_of: dict[str, tuple[int, int]] = {}
        self.context_of: dict[str, int] = {}
        self._free_rows: list[int] = []

    def buffers(self) -> list[BufferSpec]:
        cfg, model = self.env.cfg, self.env.model
        k, rows = cfg.num_speculative_tokens, cfg.max_num_seqs
        # a rejected draft's residual distribution [0] and its running sum [1]
        specs = [BufferSpec("residual", (2, model.vocab_size), torch.float32)]
        if cfg.speculative_method == "draft":
            specs.append(BufferSpec("draft_probs", (rows, k, model.vocab_size), torch.float32))
            draft = draft_config(cfg, model)
            blocks, size = self.env.num_kv_blocks, cfg.block_size
            shape = (2, draft.num_layers, blocks, size, draft.num_kv_heads, draft.head_dim)
            specs.append(BufferSpec("draft_kv", shape, self.env.dtype))
        if cfg.speculative_method == "eagle":
            rows_shape = (rows, model.hidden_size)
            specs.append(BufferSpec("previous_hidden_states", rows_shape, self.env.dtype))
            if self.env.draft_context:
                context = (rows, 2, self.env.draft_context, model.num_kv_heads, model.head_dim)
                specs.append(BufferSpec("draft_context", context, self.env.dtype))
        return specs

    def on_enter(self) -> None:
        self._free_rows = list(range(self.env.cfg.max_num_seqs - 1, -1, -1))

    def on_exit(self) -> None:
        self.draft_len.clear()
        self.hidden_of.clear()
        self.context_of.clear()
        self._free_rows = []

    def forget(self, request_id: str) -> None:
        self.draft_len.pop(request_id, None)
        self.context_of.pop(request_id, None)
        held = self.hidden_of.pop(request_id, None)
        if held is not None:
            self._free_rows.append(held[0])

    def keep_hidden(self, owners: list[tuple[str, int]], hidden: torch.Tensor) -> list[int | None]:
        """Hold `hidden` [N, H] as the last hidden states of `owners` ([(request, tokens it
        follows)]); the row of each (None: past the buffer's rows, it just drafts nothing)."""
        buffer = self.held["previous_hidden_states"]
        rows, picked = [], []
        placed: list[int | None] = [None] * len(owners)
        for i, (request_id, num_tokens) in enumerate(owners):
            row = self.hidden_of.get(request_id, (None, 0))[0]
            if row is None and self._free_rows:
                row = self._free_rows.pop()
            if row is not None:
                self.hidden_of[request_id] = (row, num_tokens)
                rows.append(row)
                picked.append(i)
                placed[i] = row
        if rows:
            index = torch.tensor(rows, device=buffer.device)
            buffer.index_copy_(0, index, hidden[torch.tensor(picked, device=hidden.device)])
        return placed

    def hidden_row(self, request_id: str, num_tokens: int) -> int | None:
        """The row of the request's hidden state if it follows exactly its `num_tokens` tokens;
        None when there is none, or a stale one."""
        row, follows = self.hidden_of.get(request_id, (None, -1))
        return row if follows == num_tokens else None


def draft_config(cfg: EngineConfig, model: ModelConfig) -> ModelConfig:
    """The draft model's shapes: a model folder of its own, or the target's first N layers."""
    if cfg.draft_model is not None:
        from memstep.core.model_source import model_config, resolve

        return model_config(resolve(cfg.draft_model, cfg.random_weights_seed))
    return model.truncated(cfg.draft_layers)
