"""Messages between the engine core and the executor: what to run, and what came of it."""

from __future__ import annotations

import attrs

from memstep.events.sampling_params import SamplingParams
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
# cannot go on (StepResult.failed); 9 since an admission's params and prefix travel as an
# `Admission` record beside the sequences (not in SeqPlan), and a phase's figures as
# `PhaseFigures` (not a dict)
EXECUTOR_PROTOCOL_VERSION = 9


@row_record
class SeqPlan:
    """One request's work in a step: the same fields whether it was admitted this step (its
    `Admission` then travels beside it in the StepPlan) or continues."""

    request_id: str
    start_pos: int  # position of token_ids[0]
    token_ids: list[int]  # tokens fed this step
    # the request's pages from entry `num_pages_held` on: the executor holds the entries before
    # it from earlier plans (a table only grows while its request runs) and puts them back in
    # front when the plan arrives (RunningRequests.update), so everything after sees the whole
    # table
    block_table: list[int]
    samples: bool  # the last fed token's logits are sampled
    num_drafts: int  # speculative lookahead slots reserved for this request
    prompt_len: int
    num_pages_held: int = 0  # 0: block_table is the whole table (an admission's plans, a chunk's)


@record
class Admission:
    """A request admitted this step (new, or preempted or recovered and readmitted): the
    executor starts its history afresh from `prefix_ids` and keeps its params until it is
    finished. Its SeqPlan of the same step starts at len(prefix_ids)."""

    request_id: str
    params: SamplingParams
    # the tokens before the plan's start_pos, whose KV the cached pages hold (a prefix hit), or
    # those a readmitted request recomputes from there
    prefix_ids: list[int]


@record
class StepPlan:
    step: int
    kind: str
    seqs: list[SeqPlan]
    finished: list[str]  # requests whose executor-side state must be dropped
    admitted: list[Admission] = attrs.Factory(list)  # of `seqs`, those admitted this step

    @property
    def admitted_ids(self) -> frozenset[str]:
        return frozenset(a.request_id for a in self.admitted)


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
class PhaseFigures:
    """What the executor measured in a start-up phase: CUDA's peaks after warm-up, its graphs
    after capture (zeros and empty lists on the CPU and in the other phases)."""

    predicted_peak_bytes: int = 0  # the memory plan's
    measured_peak_bytes: int = 0  # torch.cuda.max_memory_allocated
    reserved_peak_bytes: int = 0  # the allocator's, warm-up and capture included
    graph_static_bytes: int = 0  # the decode runner's static inputs
    graph_pool_bytes: int = 0  # what capturing the decode graphs allocated
    graph_capture_seconds: float = 0.0
    graph_sizes: list[int] = attrs.Factory(list)  # decode batch sizes captured
    piecewise_sizes: list[int] = attrs.Factory(list)  # token buckets of the piecewise graphs
    piecewise_graphs: int = 0
    piecewise_static_bytes: int = 0
    piecewise_capture_seconds: float = 0.0
    # the executor replays the next decode ahead (executors/cuda/decode_ahead.py): the core
    # reserves one more page slot for each sequence
    decode_ahead: bool = False

    @property
    def peak_error(self) -> float | None:
        """The measured peak against the plan's prediction, or None with no prediction."""
        if not self.predicted_peak_bytes:
            return None
        return round(self.measured_peak_bytes / self.predicted_peak_bytes - 1.0, 4)

    @property
    def reserved_within_plan(self) -> bool:
        predicted = self.predicted_peak_bytes
        return bool(predicted) and self.reserved_peak_bytes <= predicted


@record
class PhaseReply:
    phase: str
    figures: PhaseFigures  # rank 0's under tensor parallelism
    exited: list[StateExited]
    entered: list[StateEntered]
    leaks: list[LeakSuspected]  # buffers the exit hook released but something still holds
    memory_plan: MemoryPlan | None = None  # after profile (rank 0's under tensor parallelism)
    rank_memory_plans: list[MemoryPlan] = attrs.Factory(list)  # tensor parallelism: every rank's
    rank_figures: list[PhaseFigures] = attrs.Factory(list)  # tensor parallelism: every rank's
