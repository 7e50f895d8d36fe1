"""An EAGLE-style draft head: drafts from the target's own last hidden state.

The target's final hidden state at position t-1 (what its head turns into token t) and the
embedding of token t go through one small block that predicts the target's hidden state at t;
the target's own head, over a draft vocabulary of its most frequent reply tokens, turns that
into the draft for t+1, and the predicted state feeds the next draft:

    x = fc([embed(token); hidden])                      # [B, 2H] -> [B, H]
    x = x + down(silu(gate) * up)(rms_norm(x))          # a decoder layer's MLP half
    hidden' = rms_norm(x)                               # the predicted hidden state
    logits = hidden' @ head[vocab].T                    # [B, draft vocab]

The attention half of EAGLE's decoder layer is left out: the target's hidden state already
carries the context, and without it the draft keeps no KV cache; its only state between steps
is the hidden state of each request (the `spec` kind's `previous_hidden_states`).

The weights are trained by `memstep train-draft` (self-distillation: the target reads ShareGPT
answers and its own greedy choices are the labels) and stored as a plain `.npz` (read with
`allow_pickle=False`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from memstep.core.config import ConfigError

DRAFTS = Path(__file__).parent / "drafts"
SMOLLM2_HEAD = DRAFTS / "smollm2-eagle.npz"
MATRICES = ("fc", "mlp_norm", "gate_up", "down", "out_norm")


def default_head_path(model: str) -> Path | None:
    """The committed head for a model name, if there is one."""
    return SMOLLM2_HEAD if model == "smollm2" and SMOLLM2_HEAD.exists() else None


def init_params(hidden: int, intermediate: int, seed: int) -> dict[str, torch.Tensor]:
    """Fresh float32 parameters: the residual branch starts near zero, so the block starts as
    a projection of its inputs."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    return {
        "fc": normal(hidden, 2 * hidden, std=(2 * hidden) ** -0.5),
        "mlp_norm": torch.ones(hidden),
        "gate_up": normal(2 * intermediate, hidden, std=hidden**-0.5),
        "down": normal(hidden, intermediate, std=0.02 * intermediate**-0.5),
        "out_norm": torch.ones(hidden),
    }


def draft_step(
    params: dict[str, torch.Tensor],
    embed: torch.Tensor,
    head: torch.Tensor,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft position for B rows: `hidden` [B, H] (the target's, or the last prediction),
    `tokens` [B] target ids -> (predicted hidden [B, H], logits [B, draft vocab]). Shared by
    training (autograd) and serving."""
    x = F.linear(torch.cat([F.embedding(tokens, embed), hidden], dim=-1), params["fc"])
    gate, up = F.linear(
        F.rms_norm(x, x.shape[-1:], params["mlp_norm"], eps), params["gate_up"]
    ).chunk(2, dim=-1)
    x = x + F.linear(F.silu(gate) * up, params["down"])
    predicted = F.rms_norm(x, x.shape[-1:], params["out_norm"], eps)
    return predicted, F.linear(predicted, head)


def save_head(path: Path, params: dict[str, torch.Tensor], vocab: torch.Tensor, meta: dict):
    """Write the head as float16 matrices, the draft vocabulary and the target's shapes."""
    arrays = {name: params[name].detach().to(torch.float16).numpy() for name in MATRICES}
    arrays["vocab"] = vocab.to(torch.int32).numpy()
    for key, value in meta.items():
        arrays["meta_" + key] = np.asarray(value, dtype=np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        np.savez(fh, **arrays)  # type: ignore[arg-type]


class EagleHead:
    """A trained head over a target's embedding and output head, in the target's device and
    dtype. Owns its small matrices and the rows of the target's head for its vocabulary."""

    def __init__(
        self,
        path: Path,
        embed: torch.Tensor,
        head: torch.Tensor,
        vocab_size: int,
        eps: float,
    ):
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
        missing = [n for n in (*MATRICES, "vocab", "meta_hidden", "meta_vocab") if n not in arrays]
        if missing:
            raise ConfigError(f"{path.name} is not a draft head: it lacks {missing}")
        hidden, target_vocab = int(arrays["meta_hidden"]), int(arrays["meta_vocab"])
        if hidden != embed.shape[1] or target_vocab != vocab_size:
            raise ConfigError(
                f"{path.name} was trained for hidden size {hidden} and vocabulary {target_vocab}, "
                f"not this model's {embed.shape[1]} and {vocab_size}"
            )
        device, dtype = embed.device, embed.dtype
        self.params = {
            n: torch.from_numpy(arrays[n]).to(device=device, dtype=dtype) for n in MATRICES
        }
        self.vocab = torch.from_numpy(arrays["vocab"]).to(device=device, dtype=torch.long)
        self.embed = embed
        self.head = head[self.vocab].contiguous()  # [draft vocab, H]
        self.eps = eps

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params.values(), self.vocab, self.head]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """[B, H] hidden states and [B] last tokens -> [B, k] greedy drafts (target ids)."""
        drafts = []
        for _ in range(k):
            hidden, logits = draft_step(
                self.params, self.embed, self.head, hidden, tokens, self.eps
            )
            tokens = self.vocab[logits.argmax(dim=-1)]
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)
