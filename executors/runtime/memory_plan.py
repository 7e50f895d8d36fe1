"""The profile phase: how much memory each part of the engine takes, and how many KV pages fit.

Measured once at start-up from a worst-case dummy forward (every token budget in one prefill);
returned as a value, never written into the config.
"""

from __future__ import annotations

import attrs
import torch

from memstep.core.config import EngineConfig
from memstep.core.model_config import ModelConfig
from memstep.core.shapes import cdiv, max_blocks_per_seq
from memstep.events.plan import MemoryPlan, SeqPlan
from memstep.executors.model import kv_cache
from memstep.executors.model.attention import SHORT_QUERY
from memstep.executors.runtime.batch_builder import build_batch
from memstep.executors.runtime.parts import ExecutorParts
from memstep.executors.runtime.prompt_scorer import rows_nbytes
from memstep.executors.runtime.sampler import filter_scratch_bytes, sampler_nbytes
from memstep.states.arena import nbytes_of, tensor_bytes
from memstep.states.catalog import KINDS
from memstep.states.kinds import KindEnv


def with_blocks(memory_plan: MemoryPlan, num_kv_blocks: int) -> MemoryPlan:
    """The plan with fewer KV pages (the ranks of a group agree on the smallest count)."""
    fewer = memory_plan.num_kv_blocks - num_kv_blocks
    predicted = memory_plan.predicted_peak_bytes - fewer * memory_plan.kv_page_bytes
    return attrs.evolve(memory_plan, num_kv_blocks=num_kv_blocks, predicted_peak_bytes=predicted)


def _kv_page_bytes(cfg: EngineConfig, model: ModelConfig, dtype: torch.dtype, layers: int) -> int:
    return 2 * layers * nbytes_of((cfg.block_size, model.num_kv_heads, model.head_dim), dtype)


def worst_case_prefill(
    cfg: EngineConfig, max_len: int, tokens: int | None = None, chunk: int | None = None
) -> list[SeqPlan]:
    """Prefill chunks of `chunk` tokens (default `max_len`) filling `tokens` (default: the
    step's token budget), each ending at the end of a `max_len` context: the largest
    activations and attention temporaries a step can have. All write KV pages
    0..ceil(max_len / block_size)."""
    tokens = cfg.max_num_batched_tokens if tokens is None else tokens
    chunk = max_len if chunk is None else min(chunk, max_len)
    pages = list(range(cdiv(max_len, cfg.block_size)))
    seqs: list[SeqPlan] = []
    while tokens > 0:
        n = min(tokens, chunk)
        seqs.append(
            SeqPlan(
                request_id=f"worst{len(seqs)}",
                start_pos=max_len - n,
                token_ids=[0] * n,
                block_table=pages,
                samples=True,
                num_drafts=0,
                prompt_len=max_len,
            )
        )
        tokens -= n
    return seqs


def _activation_peak(
    cfg: EngineConfig, model_cfg: ModelConfig, max_len: int, model, dtype, kv_dtype, device
) -> int:
    """Peak bytes of one forward of `max_num_batched_tokens` tokens (measured on CUDA, over
    `worst_case_prefill`: chunks that start their sequences, chunks that continue one, and
    short chunks at the end of long contexts, whose packed attention gathers the most keys).
    On CUDA the larger of the allocated and the reserved peak: the plan bounds what the
    caching allocator reserves, not only what tensors hold."""
    t = cfg.max_num_batched_tokens
    if device.type != "cuda":
        per_token = model_cfg.hidden_size * 6 + model_cfg.intermediate_size * 3
        per_token += model_cfg.head_dim * (model_cfg.num_heads + 2 * model_cfg.num_kv_heads)
        return t * per_token * torch.empty((), dtype=dtype).element_size()
    cases = [worst_case_prefill(cfg, max_len), worst_case_prefill(cfg, max_len, chunk=max_len - 1)]
    # short chunks (9 tokens) at the end of long contexts: packed attention gathers the most
    # keys per query, PACKED_KEYS a call
    cases.append(worst_case_prefill(cfg, max_len, chunk=SHORT_QUERY + 1))
    shape = (
        len(cases[0][0].block_table),
        cfg.block_size,
        model_cfg.num_kv_heads,
        model_cfg.head_dim,
    )
    kv = kv_cache.allocate(model_cfg.num_layers, shape, kv_dtype, device)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    base_reserved = torch.cuda.memory_reserved(device)
    peak = 0
    for seqs in cases:
        torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            feeds = [(seq, seq.token_ids) for seq in seqs]
            batch, last = build_batch(feeds, cfg.block_size, device)
            model.logits(model.forward(batch, kv)[last])
            del batch
        torch.cuda.synchronize(device)
        allocated = torch.cuda.max_memory_allocated(device) - base
        peak = max(peak, allocated, torch.cuda.max_memory_reserved(device) - base_reserved)
    del kv
    torch.cuda.empty_cache()
    return peak


# left free beside a plan bound by the device's free memory: the CUDA context's and cuBLAS's
# growth past the start, which no tensor counts
FREE_HEADROOM = 512 << 20


def plan_memory(
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    max_len: int,
    model,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
    parts: ExecutorParts,
    head_bytes: int = 0,
    held_bytes: int = 0,
    free_bytes: int | None = None,
) -> MemoryPlan:
    """`parts`: what the graphs take and an EAGLE head's context; `head_bytes`: an EAGLE
    head's, held beside the weights; `held_bytes`: what the process held on the device before
    this executor (another engine's), which is not the plan's to use; `free_bytes`: what the
    device had free then (CUDA). The plan takes the utilisation's share of the device, or what
    was free less `FREE_HEADROOM` where that is less: a second engine beside a first gets what
    the first left (free binds only then, so a lone engine's plan is the same from run to run,
    as replay needs)."""
    weights = tensor_bytes(model.w.values()) + head_bytes
    rows = cfg.max_num_seqs * (cfg.num_lookahead_slots + 1)
    sampler = sampler_nbytes(rows, model_cfg.vocab_size, in_place_logits=device.type == "cuda")
    sampler += rows_nbytes(cfg.max_num_seqs, model_cfg.hidden_size, dtype)  # the prompt scorer's
    activation = _activation_peak(cfg, model_cfg, max_len, model, dtype, kv_dtype, device)
    if device.type == "cuda":
        activation += _eager_logits_bytes(cfg, model_cfg)
        activation += filter_scratch_bytes(rows, model_cfg.vocab_size)
    page = _kv_page_bytes(cfg, model_cfg, kv_dtype, model_cfg.num_layers)
    draft_page = 0
    if cfg.speculative_method == "draft":
        draft_page = _kv_page_bytes(
            cfg, model_cfg, dtype, min(cfg.draft_layers, model_cfg.num_layers)
        )
    per_seq = max_blocks_per_seq(max_len, cfg.num_lookahead_slots, cfg.block_size)
    wanted = cfg.max_num_seqs * per_seq
    graphs = parts.graph_bytes(cfg, model_cfg, per_seq, dtype, device)
    slots = parts.draft_context(cfg)
    if cfg.num_kv_blocks is not None:
        blocks = cfg.num_kv_blocks
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        fixed = weights + activation + sampler + graphs
        fixed += _kind_bytes(KindEnv(cfg, model_cfg, dtype, 1, device.type, slots))
        # what the process already holds (another engine) is not this one's to plan with
        budget = min(total * cfg.gpu_memory_utilization, total - held_bytes)
        if free_bytes is not None:
            budget = min(budget, free_bytes - FREE_HEADROOM)
        blocks = int((budget - fixed) // (page + draft_page))
    else:
        blocks = min(cfg.cpu_kv_cache_bytes // (page + draft_page), wanted)
    if blocks < 1:
        raise MemoryError("no memory left for the KV cache; lower max_num_batched_tokens")
    kinds = _kind_table(KindEnv(cfg, model_cfg, dtype, blocks, device.type, slots))
    arena = max(kinds.values(), default=0) + 256 * max(1, len(kinds))
    kv = blocks * page
    predicted = held_bytes + weights + activation + sampler + arena + kv + graphs
    parts = (weights, activation, sampler, kinds, arena, page, blocks, predicted, graphs)
    return MemoryPlan(*parts, held_bytes=held_bytes)


def _eager_logits_bytes(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """Float32 logits of an eager worst-case step that samples a row per sequence and one copy
    of them (the capture phase's eager warm-up makes both outside the sampler's persistent
    buffers, before serving): the profile's worst case samples only a few rows, so these
    transients are planned here.  Without them
    reserved memory could pass the predicted peak by ~1 GiB at 1,024 rows of a 128k vocab."""
    rows = min(cfg.max_num_seqs, cfg.max_num_batched_tokens) * (cfg.num_lookahead_slots + 1)
    return 2 * rows * model_cfg.vocab_size * 4


def _kind_table(env: KindEnv) -> dict:
    """Each kind's buffer bytes: the arena holds the largest, since one kind holds it at a time."""
    return {name: sum(b.nbytes for b in cls(env).buffers()) for name, cls in KINDS.items()}


def _kind_bytes(env: KindEnv) -> int:
    """The largest kind's buffers besides the draft model's KV (planned with the pages)."""
    return max(
        sum(b.nbytes for b in cls(env).buffers() if b.name != "draft_kv") for cls in KINDS.values()
    )
