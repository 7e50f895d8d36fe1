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

from memstep.core.config import ConfigError
from memstep.executors.spec import eagle_cpu
from memstep.executors.spec.eagle_cpu import CpuHead
from memstep.states.arena import tensor_bytes

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


class EagleHead:
    """A trained head over a target's embedding and output head, in the target's device and
    dtype. Owns its small matrices and the rows of the target's head for its vocabulary.

    With the attention half (`attn`), each request's context is the keys and values of the
    pairs (the target's hidden state, the token it chose) that the head has read, held by the
    `spec` kind (`draft_context`, [rows, 2, slots, kv heads, head dim]); `write_pairs` writes
    them and `draft_rows` attends them. On the CPU (`int8` left None) such a head runs in the C
    kernels (`cpu`, eagle_cpu.py); else through torch (`draft`, `keys`: in float, or int8 rows
    with `int8`)."""

    def __init__(
        self,
        path: Path,
        embed: torch.Tensor,
        head: torch.Tensor,
        vocab_size: int,
        eps: float,
        kv_shape: tuple[int, int] | None = None,
        int8: bool | None = None,
        max_positions: int = 4096,
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
        self.attn: AttnShape | None = None
        # trained with the prompt's pairs in its context (`train-draft --prompt-context`)
        self.reads_prompt = "q" in arrays and bool(arrays.get("meta_prompt_context", 0))
        names = list(MATRICES)
        if "q" in arrays:
            meta = [arrays["meta_" + n] for n in ("heads", "kv_heads", "head_dim", "rope_theta")]
            self.attn = AttnShape(*(int(x) for x in meta), window=CONTEXT)  # type: ignore[misc]
            if kv_shape is not None and (self.attn.kv_heads, self.attn.head_dim) != kv_shape:
                raise ConfigError(f"{path.name}'s attention does not match this model's heads")
            names += ATTENTION
        device, dtype = embed.device, embed.dtype
        params = {n: torch.from_numpy(arrays[n]).to(device=device, dtype=dtype) for n in names}
        self.vocab = torch.from_numpy(arrays["vocab"]).to(device=device, dtype=torch.long)
        self.embed = embed
        self.eps = eps
        self.table: Rotation | None = None  # cos and sin [max_positions, 1, d / 2]
        if self.attn is not None:
            self.table = self.attn.rotation(torch.arange(max_positions, device=device), dtype)
        rows = head[self.vocab].contiguous()  # the target's head over the draft vocabulary
        # on the CPU by default, a head with attention runs in the C kernels (eagle_cpu.py)
        self.cpu: CpuHead | None = None
        self.mm: Matmuls | None = None
        if int8 is None and device.type == "cpu" and self.table is not None:
            assert self.attn is not None
            if eagle_cpu.takes(params, self.attn.head_dim):
                shape = (self.attn.heads, self.attn.kv_heads, self.attn.head_dim)
                self.cpu = CpuHead(params, rows, shape, eps, self.table)
        if self.cpu is None:
            self.mm = Matmuls(params, rows, device.type == "cpu" if int8 is None else int8)
        self.params = {n: t for n, t in params.items() if t.dim() == 1}  # the norms; the rest: mm

    def rotation(self, positions: torch.Tensor) -> Rotation:
        assert self.table is not None
        return self.table[0][positions], self.table[1][positions]

    def tensors(self) -> list[torch.Tensor]:
        table = list(self.table) if self.table is not None else []
        held = self.cpu.tensors() if self.cpu is not None else self.matmuls.tensors()
        return [*self.params.values(), self.vocab, *held, *table]

    @property
    def matmuls(self) -> Matmuls:
        """The torch matrices (a head not run by the C kernels)."""
        assert self.mm is not None, "this head runs in the C kernels (eagle_cpu.py)"
        return self.mm

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def keys(
        self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [N, kv heads, d] of N pairs (hidden state, the token it chose) at
        their context positions [N]: what the context holds of them."""
        assert self.attn is not None
        if self.cpu is not None:  # into a context of one page per pair
            pages = hidden.new_empty(len(tokens), 2, 1, self.attn.kv_heads, self.attn.head_dim)
            row = torch.arange(len(tokens))
            self.write_pairs(hidden, tokens, positions, pages, row, torch.zeros_like(row))
            return pages[:, 0, 0], pages[:, 1, 0]
        mm = self.matmuls
        x = pair_input(mm, self.embed, hidden, tokens)
        _, k, v = qkv(self.params, mm, x, self.rotation(positions), self.attn, self.eps)
        return k, v

    def write_pairs(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """The keys and values of N pairs at their context positions [N] written into
        `context` ([rows, 2, slots, kv heads, d], the `spec` kind's `draft_context`) at (row,
        slot) [N] each."""
        if self.cpu is not None:
            self.cpu.write_pairs(self.embed, hidden, tokens, positions, context, rows, slots)
            return
        keys, values = self.keys(hidden, tokens, positions)
        context[rows, 0, slots] = keys
        context[rows, 1, slots] = values

    def draft_rows(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        k: int,
        context: torch.Tensor | None,
        rows: list[int],
        counts: list[int],
    ) -> torch.Tensor:
        """`draft` for B requests whose pairs are in `context` (the `spec` kind's
        `draft_context`, None without attention) rows `rows`, `counts` pairs read each."""
        if context is None or self.attn is None:
            return self.draft(hidden, tokens, k)
        window = self.attn.window
        if self.cpu is not None:
            return self.cpu.draft(
                self.embed, self.vocab, hidden, tokens, k, context, rows, counts, window
            )
        device = hidden.device
        # the whole buffer, masked, whatever the rows have read: attention of a new key length
        # was planned anew on CUDA (62 ms a draft step, and host memory growing)
        kv = context[torch.tensor(rows, device=device)]
        read = torch.tensor(counts, device=device)
        valid = torch.arange(kv.shape[2], device=device) < read.clamp(max=window).unsqueeze(1)
        return self.draft(hidden, tokens, k, (kv, valid, read - 1))

    def draft(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        k: int,
        context: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[B, H] hidden states and [B] last tokens -> [B, k] greedy drafts (target ids).

        With attention, `context` is (keys and values [B, 2, L, kv heads, d] holding each row's
        pairs up to and including (hidden, token), which of the L slots hold one [B, L], and
        that last pair's position [B]); each draft's own pair joins the keys for the next."""
        if context is not None:
            kv, mask, position = context
            keys, values = kv[:, 0], kv[:, 1]  # [B, L, kv heads, d]
        drafts = []
        mm = self.matmuls
        for step in range(k):
            x = pair_input(mm, self.embed, hidden, tokens)
            attended = None
            if self.attn is not None:
                assert context is not None
                rotation = self.rotation(position + step)
                q, key, value = qkv(self.params, mm, x, rotation, self.attn, self.eps)
                if step > 0:  # this draft's pair: its keys join the context for the rest
                    keys = torch.cat([keys, key.unsqueeze(1)], dim=1)
                    values = torch.cat([values, value.unsqueeze(1)], dim=1)
                    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                attended = F.scaled_dot_product_attention(
                    q.unsqueeze(2),  # [B, heads, 1, d]
                    keys.transpose(1, 2),
                    values.transpose(1, 2),
                    attn_mask=mask[:, None, None, :],
                    enable_gqa=True,
                ).flatten(1)
            hidden, logits = block_out(self.params, mm, x, attended, self.eps)
            tokens = self.vocab[logits.argmax(dim=-1)]
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)
