"""Messages between the engine core and the executor: what to run, and what came of it."""

from __future__ import annotations

import attrs

from memstep.events.types import (
    LeakSuspected,
    MemoryReport,
    StateEntered,
    StateExited,
    record,
    row_record,
)

# the executor link's version (ExecutorHello.protocol): 4 since a plan carries only the block
# table's entries the executor does not hold yet (SeqPlan.table_from); 5 since a plan's sampling
# params may hold min_tokens, logit_bias and include_stop_str_in_output; 6 since a result
# carries the prompt logprobs its prefill chunks scored (StepResult.prompt_logprobs); 7 since
# each of those scores carries its token's rank; 8 since a result names the requests that
# cannot go on (StepResult.failed)
EXECUTOR_PROTOCOL_VERSION = 8


@row_record
class SeqPlan:
    request_id: str
    start_pos: int  # position of token_ids[0]
    token_ids: list[int]  # tokens fed this step
    # the request's pages from entry `table_from` on: the executor holds the entries before it
    # from earlier plans (a table only grows while its request runs) and puts them back in front
    # when the plan arrives (RequestStates.update), so everything after sees the whole table
    block_table: list[int]
    samples: bool  # the last fed token's logits are sampled
    num_drafts: int  # speculative lookahead slots reserved for this request
    prompt_len: int
    # SamplingParams.to_dict() on the first plan of each admission, whose start_pos is 0 or the
    # prefix-cache hit: the executor starts the request's history afresh and keeps them; else {}
    params: dict
    # with params: the tokens before start_pos, whose KV cached pages hold (the executor learns
    # the whole history from them); else []
    prefix_ids: list[int] = attrs.Factory(list)
    table_from: int = 0  # 0: block_table is the whole table (an admission's plans, a chunk's)


@record
class StepPlan:
    step: int
    kind: str
    seqs: list[SeqPlan]
    finished: list[str]  # requests whose executor-side state must be dropped


@row_record
class SeqResult:
    request_id: str
    token_ids: list[int]  # tokens appended to the request this step
    logprobs: list[list]  # per token: [chosen_logprob, [[token_id, logprob], ...top-N]]
    num_proposed: int
    num_accepted: int


@row_record
class PromptLogprobs:
    """Prompt tokens a step's prefill chunk scored (SamplingParams.prompt_logprobs): entry i is
    [logprob, [[token_id, logprob], ...top-N], rank] of the prompt token at position `start + i`,
    given the tokens before it (its rank: 1 + the tokens scored above it)."""

    request_id: str
    start: int  # >= 1: the first prompt token has nothing before it
    entries: list[list]


@record
class StepResult:
    step: int
    kind: str
    seqs: list[SeqResult]
    memory: MemoryReport
    exited: list[StateExited]  # the exit hook that ran before this step, if the kind changed
    entered: list[StateEntered]  # then the enter hook of this step's kind
    leaks: list[LeakSuspected]
    # tensor parallelism: every rank's own report, rank 0's first (`memory` is rank 0's); else []
    rank_memory: list[MemoryReport] = attrs.Factory(list)
    prompt_logprobs: list[PromptLogprobs] = attrs.Factory(list)
    # requests that cannot go on, and why (a grammar the engine cannot enforce): the core ends
    # each with an error; their tokens of this step are not in `seqs`
    failed: dict[str, str] = attrs.Factory(dict)


@record
class MemoryPlan:
    """The executor's memory plan, measured at profile (executors/runtime/memory_plan.py): what
    each part of the engine takes and how many KV pages fit; a value, never written into the
    config. The core sizes its page table from it."""

    weights_bytes: int
    activation_peak_bytes: int
    sampler_bytes: int
    kind_buffer_bytes: dict[str, int]  # kind -> bytes of its buffers
    arena_bytes: int
    kv_page_bytes: int
    num_kv_blocks: int
    predicted_peak_bytes: int
    graph_bytes: int = 0  # CUDA: the graphs' static buffers and pool (estimated)
    allocator_conf: str = ""  # CUDA: PYTORCH_CUDA_ALLOC_CONF as the executor set it
    device_total_bytes: int = 0  # CUDA: the device's memory; 0 on the CPU
    grammar_cache_bytes: int = 0  # host: the budget of the compiled grammar matchers it keeps
    # CUDA: what this process held on the device before this executor (another engine, say):
    # counted in the predicted peak and left out of the KV cache's share
    held_bytes: int = 0


@record
class MemoryPlanned:
    """The memory plan as the log records it, at the step of the profile phase."""

    step: int
    plan: MemoryPlan


@record
class PhaseRequest:
    """Ask the executor to enter an engine phase (profile, warmup, capture, serve, shutdown)."""

    phase: str
    step: int


@record
class PhaseReply:
    phase: str
    info: dict  # phase-specific figures (warm-up and capture)
    exited: list[StateExited]
    entered: list[StateEntered]
    leaks: list[LeakSuspected]  # buffers the exit hook released but something still holds
    memory_plan: MemoryPlan | None = None  # after profile (rank 0's under tensor parallelism)
    rank_memory_plans: list[MemoryPlan] = attrs.Factory(list)  # tensor parallelism: every rank's
