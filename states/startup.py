"""The start-up phases as step kinds: `warmup` and `capture` own what they use and give it back.

Warm-up samples a dummy batch at every batch size serving will see, so that the head, the
sampler's persistent buffers and every kernel path are touched before the first request: the
dummy batch's hidden states are a buffer of its own, claimed on enter and released on exit like
any kind's (its logits go where serving's go: the sampler's buffer where the head writes in
place).  Capture (CUDA)
records the decode graphs, then samples again at every captured size (capture empties the
allocator cache): the dummy decode batch it samples from is its buffer.  On the CPU there is
nothing to capture, and `capture` is a kind that owns nothing, still entered and exited, so every
log shows the same phases.  The graphs' static inputs, outputs and pool live as long as serving
does, so they are no buffer of `capture` (its exit would free them under the graphs): the memory
plan counts them (`graph_bytes`) and the capture reply measures them.
"""

from __future__ import annotations

import torch

from memstep.states.kinds import BufferSpec, StepKind


class Warmup(StepKind):
    """Owns the dummy batch's final hidden states, [sampler rows, hidden] in the model's dtype:
    the most rows the head and the sampler meet, sliced for every smaller batch."""

    name = "warmup"

    def buffers(self) -> list[BufferSpec]:
        shape = (self.env.sampler_rows, self.env.model.hidden_size)
        return [BufferSpec("dummy_hidden", shape, self.env.dtype)]

    @property
    def dummy_hidden(self) -> torch.Tensor:
        return self.held["dummy_hidden"]


class Capture(StepKind):
    """Owns, on CUDA, the dummy decode batch's final hidden states [max_num_seqs, hidden] that
    the sampler is warmed from after capture; nothing on the CPU."""

    name = "capture"

    def buffers(self) -> list[BufferSpec]:
        if self.env.device_type != "cuda":
            return []
        shape = (self.env.cfg.max_num_seqs, self.env.model.hidden_size)
        return [BufferSpec("dummy_hidden", shape, self.env.dtype)]

    @property
    def dummy_hidden(self) -> torch.Tensor:
        return self.held["dummy_hidden"]
