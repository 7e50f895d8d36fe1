"""An EAGLE-style draft head: drafts from the target's own last hidden state.

The target's final hidden state at position t-1 (what its head turns into token t) and the
embedding of token t, a pair, go through one decoder layer that predicts the target's hidden
state at t; the target's own head, over a draft vocabulary of its most frequent reply tokens,
turns that into the draft for t+1, and the predicted state and the draft make the next pair:

    x = fc([embed(token); hidden])                      # [B, 2H] -> [B, H]
    x = x + o(attention(rms_norm(x), context))          # over the request's earlier pairs
    x = x + down(silu(gate) * up)(rms_norm(x))          # the MLP half
    hidden' = rms_norm(x)                               # the predicted hidden state
    logits = hidden' @ head[vocab].T                    # [B, draft vocab]

The context is the keys and values of the pairs read since the request's state was last fresh
(the `spec` kind's `draft_context`, the last CONTEXT of them): for a head trained with the
prompt's pairs (`meta_prompt_context`, `train-draft --prompt-context`), from the prompt's last
chunk on when it was read in a `spec` step, else from the first `spec` step's verify on. A head
trained without the attention half (`train-draft --no-attention`) keeps none, only each
request's hidden state (`previous_hidden_states`).

This file is the head's definition: its shapes, its math in torch (`pair_input`, `qkv`,
`block_out`, for training and for the torch backend) and its files. `eagle_head.py` loads a head
and runs it on one of two backends chosen once: torch (`eagle_torch.py`, float or int8 rows) or
the CPU's C kernels (`eagle_cpu.py`).

The weights are trained by `memstep train-draft` (self-distillation: the target answers
questions and reads its answers, and its own greedy choices are the labels;
train/fit.py) and stored as a plain `.npz` (read with `allow_pickle=False`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import torch
import torch.nn.functional as F

DRAFTS = Path(__file__).parent / "drafts"
SMOLLM2_HEAD = DRAFTS / "smollm2-eagle.npz"
MATRICES = ("fc", "mlp_norm", "gate_up", "down", "out_norm")
ATTENTION = ("attn_norm", "q", "k", "v", "o")
CONTEXT = 256  # pairs a head with attention reads back (the `spec` kind's draft_context)


def default_head_path(model: str) -> Path | None:
    """The committed head for a model name, if there is one."""
    return SMOLLM2_HEAD if model == "smollm2" and SMOLLM2_HEAD.exists() else None


def head_path(cfg) -> Path | None:
    """The head `speculative_method="eagle"` loads: `draft_model`'s, or the committed one."""
    return Path(cfg.draft_model) if cfg.draft_model else default_head_path(cfg.model)


def draft_context(cfg) -> int:
    """The `spec` kind's `draft_context` slots a row (`KindEnv.draft_context`) for an eagle head
    with attention, else 0: the ring of CONTEXT pairs read, then a slot for each draft position
    (eagle_cpu.py writes a draft's own pair there once the ring is full)."""
    if cfg.speculative_method != "eagle" or not has_attention(head_path(cfg)):
        return 0
    return CONTEXT + cfg.num_speculative_tokens


@functools.lru_cache(maxsize=8)
def has_attention(path: Path | None) -> bool:
    """Whether the head at `path` has the attention half (and so a context to hold)."""
    if path is None or not path.is_file():
        return False
    with np.load(path, allow_pickle=False) as data:
        return "q" in data.files


def init_params(
    hidden: int, intermediate: int, seed: int, attention: AttnShape | None = None
) -> dict[str, torch.Tensor]:
    """Fresh float32 parameters: the residual branches start near zero, so the block starts as
    a projection of its inputs."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    params = {
        "fc": normal(hidden, 2 * hidden, std=(2 * hidden) ** -0.5),
        "mlp_norm": torch.ones(hidden),
        "gate_up": normal(2 * intermediate, hidden, std=hidden**-0.5),
        "down": normal(hidden, intermediate, std=0.02 * intermediate**-0.5),
        "out_norm": torch.ones(hidden),
    }
    if attention is not None:
        q, kv = attention.heads * attention.head_dim, attention.kv_heads * attention.head_dim
        params |= {
            "attn_norm": torch.ones(hidden),
            "q": normal(q, hidden, std=hidden**-0.5),
            "k": normal(kv, hidden, std=hidden**-0.5),
            "v": normal(kv, hidden, std=hidden**-0.5),
            "o": normal(hidden, q, std=0.02 * q**-0.5),
        }
    return params


@attrs.frozen
class AttnShape:
    """The attention half's heads; keys carry rotary positions counted within the head's own
    context (the pairs it has read since the request entered `spec`), `window` of them."""

    heads: int
    kv_heads: int
    head_dim: int
    theta: float
    window: int

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """cos and sin [..., 1, head_dim / 2] at positions [...], for `qkv`."""
        half = self.head_dim // 2
        device = positions.device
        freq = self.theta ** -(torch.arange(half, device=device, dtype=torch.float32) / half)
        angle = positions.to(torch.float32).unsqueeze(-1) * freq
        return angle.cos().unsqueeze(-2).to(dtype), angle.sin().unsqueeze(-2).to(dtype)


Rotation = tuple[torch.Tensor, torch.Tensor]


def rotate(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """Rotary embedding of x [..., heads, head_dim] by `AttnShape.rotation`'s cos and sin."""
    cos, sin = rotation
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Matmuls:
    """x @ W^T for the head's matrices by name (`qkv`: q, k and v in one; `head`: the target's
    head over the draft vocabulary). In float for training and off the CPU; on the CPU, for a
    head that the C kernels do not run (eagle_cpu.py: one without the attention half, or of
    shapes they do not take), in int8 rows with bfloat16 activations (`quant_linear`): a draft
    step reads its ~7 M weights at a byte each instead of four, 0.7 ms instead of 2.7 at one
    row (2 cores)."""

    def __init__(self, params: dict[str, torch.Tensor], head: torch.Tensor, int8: bool = False):
        weights: dict[str, torch.Tensor] = {
            n: params[n] for n in ("fc", "o", "gate_up", "down") if n in params
        }
        weights["head"] = head
        if "q" in params:
            weights["qkv"] = torch.cat([params["q"], params["k"], params["v"]])
        self.linears: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        self.held: list[torch.Tensor] = []  # what the linears read: for the memory plan
        if not int8:
            self.linears = {n: functools.partial(F.linear, weight=w) for n, w in weights.items()}
            self.held = list(weights.values())
            return
        from memstep.executors.model.quant_linear import make_linear, quantize_int8

        for n, w in weights.items():
            parts = quantize_int8(n, w)
            self.linears[n] = make_linear(parts, n)
            self.held += parts.values()

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.linears[name](x)

    def tensors(self) -> list[torch.Tensor]:
        """What the linears read: int8 rows and scales, or the float matrices."""
        return self.held


def pair_input(
    mm: Matmuls, embed: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """fc([embed(token); hidden]): the block's input for (hidden state, the token it chose)."""
    return mm("fc", torch.cat([F.embedding(tokens, embed), hidden], dim=-1))


def qkv(
    params: dict[str, torch.Tensor],
    mm: Matmuls,
    x: torch.Tensor,
    rotation: Rotation,
    a: AttnShape,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries [..., heads, d], keys and values [..., kv_heads, d] of block inputs x [..., H];
    queries and keys rotated to their positions (`AttnShape.rotation`)."""
    n = F.rms_norm(x, x.shape[-1:], params["attn_norm"], eps)
    kv = a.kv_heads * a.head_dim
    q, k, v = mm("qkv", n).split([a.heads * a.head_dim, kv, kv], dim=-1)
    q = q.unflatten(-1, (a.heads, a.head_dim))
    k = k.unflatten(-1, (a.kv_heads, a.head_dim))
    return rotate(q, rotation), rotate(k, rotation), v.unflatten(-1, (a.kv_heads, -1))


def block_out(
    params: dict[str, torch.Tensor],
    mm: Matmuls,
    x: torch.Tensor,
    attended: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of the block after attention (`attended` [..., heads * d], None without the
    attention half): the MLP half, the predicted hidden state and its draft-vocabulary logits."""
    if attended is not None:
        x = x + mm("o", attended)
    gate, up = mm("gate_up", F.rms_norm(x, x.shape[-1:], params["mlp_norm"], eps)).chunk(2, -1)
    x = x + mm("down", F.silu(gate) * up)
    predicted = F.rms_norm(x, x.shape[-1:], params["out_norm"], eps)
    return predicted, mm("head", predicted)


def save_head(path: Path, params: dict[str, torch.Tensor], vocab: torch.Tensor, meta: dict):
    """Write the head as float16 matrices, the draft vocabulary and the target's shapes."""
    names = [n for n in (*MATRICES, *ATTENTION) if n in params]
    arrays = {name: params[name].detach().to(torch.float16).numpy() for name in names}
    arrays["vocab"] = vocab.to(torch.int32).numpy()
    for key, value in meta.items():
        arrays["meta_" + key] = np.asarray(value, dtype=np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        np.savez(fh, **arrays)  # type: ignore[arg-type]
