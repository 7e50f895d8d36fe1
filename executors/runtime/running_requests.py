"""What the executor remembers about each running request between steps: its tokens and pages.

The core sends only the tokens fed each step (and, with an admission, the prefix whose KV cached
pages hold: `Admission`), and the executor appends what it sampled, so that penalties and proposers
see the whole sequence. Likewise a running request's plan carries only the block-table entries
added since its last plan; the executor keeps the table and makes each plan's whole again.
`forget` is called for every finished request.
"""

from __future__ import annotations

import attrs

from memstep.events.plan import Admission, SeqPlan
from memstep.events.sampling_params import SamplingParams
from memstep.executors.runtime.guide import GrammarBook, Guide
from memstep.executors.runtime.sampler import Row


@attrs.define
class RunningRequest:
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    guide: Guide | None = None  # its grammar matcher, brought to `tokens` at each mask
    table: list[int] = attrs.Factory(list)  # its block table as of the latest plan
    stops: tuple[int, ...] = ()  # the ids that end it, which `min_tokens` bans until then
    error: str = ""  # why its grammar could not be made (`RunningRequests._guide`)

    @property
    def failure(self) -> str:
        """Why this request cannot go on (its grammar could not be made, or the grammar engine
        cannot enforce it), or "": the worker ends it (`StepResult.failed`), its tokens unsent."""
        return self.error or (self.guide.failure if self.guide is not None else "")

    def row(self, position: int, history: list[int]) -> Row:
        """The sampler's row for the token at `position`, penalised by `history`."""
        return Row(self.params, position, history, self.prompt_len, self.guide, self.stops)


class RunningRequests:
    """Every running request's state; `grammars` compiles the constraints of those that have
    one (None: a constrained request is an error, for workers that never see one); `eos`: the
    model's end-of-sequence ids, which a request's `min_tokens` bans with its stop_token_ids."""

    def __init__(self, grammars: GrammarBook | None = None, eos: tuple[int, ...] = ()) -> None:
        self._by_id: dict[str, RunningRequest] = {}
        self.grammars = grammars
        self.eos = eos
        self.scoring: set[str] = set()  # requests that asked for prompt logprobs

    def __len__(self) -> int:
        return len(self._by_id)

    def __getitem__(self, request_id: str) -> RunningRequest:
        return self._by_id[request_id]

    def update(self, seq: SeqPlan, admission: Admission | None = None) -> RunningRequest:
        """The state of `seq`'s request after this plan: begun afresh from `admission` (a new
        request, or one preempted and readmitted), or the one it continues."""
        state = (
            self._by_id.get(seq.request_id) if admission is None else self._admit(seq, admission)
        )
        if state is None:
            raise RuntimeError(
                f"{seq.request_id}: plan continues at {seq.start_pos} a request the executor "
                "does not know (its first plan comes with its Admission)"
            )
        if seq.start_pos > len(state.tokens):
            raise RuntimeError(
                f"{seq.request_id}: plan starts at {seq.start_pos} but the executor knows "
                f"{len(state.tokens)} tokens"
            )
        del state.tokens[seq.start_pos :]
        state.tokens.extend(seq.token_ids)
        self._whole_table(seq, state)
        return state

    def _admit(self, seq: SeqPlan, admission: Admission) -> RunningRequest:
        if seq.start_pos != len(admission.prefix_ids):
            raise RuntimeError(
                f"{seq.request_id}: first plan starts at {seq.start_pos} but its admission "
                f"carries {len(admission.prefix_ids)} cached prefix tokens"
            )
        params = admission.params
        state = RunningRequest(list(admission.prefix_ids), seq.prompt_len, params)
        state.guide, state.error = self._guide(params)
        if params.min_tokens:
            state.stops = (*(() if params.ignore_eos else self.eos), *params.stop_token_ids)
        if params.prompt_logprobs is not None:
            self.scoring.add(seq.request_id)
        self._by_id[seq.request_id] = state
        return state

    @staticmethod
    def _whole_table(seq: SeqPlan, state: RunningRequest) -> None:
        """Put the entries the executor holds back in front of the plan's tail (in the plan's
        own list: this process's decoded copy, or the core's fresh slice in-process)."""
        if seq.num_pages_held:
            if seq.num_pages_held > len(state.table):
                raise RuntimeError(
                    f"{seq.request_id}: plan's table continues at entry {seq.num_pages_held} "
                    f"but the executor holds {len(state.table)}"
                )
            seq.block_table[:0] = state.table[: seq.num_pages_held]
        state.table = seq.block_table

    def _guide(self, params: SamplingParams) -> tuple[Guide | None, str]:
        """A fresh matcher at the grammar's start (its state comes from the tokens alone), or
        why none could be made: a compile that fails or panics here is this request's error,
        never the executor's loss."""
        if params.constraint is None:
            return None, ""
        if self.grammars is None:
            raise RuntimeError("a constrained request reached a worker without grammars")
        try:
            return self.grammars.guide(params.constraint), ""
        except (Exception, BaseException) as exc:  # pyo3's PanicException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return None, f"the grammar engine failed on this constraint: {str(exc)[:300]}"

    def failures(self, request_ids: list[str]) -> dict[str, str]:
        """Of `request_ids`, those that cannot go on, and why (`RunningRequest.failure`)."""
        return {i: why for i in request_ids if (why := self._by_id[i].failure)}

    def append(self, request_id: str, tokens: list[int]) -> None:
        """Tokens sampled this step; the next plan feeds the last of them again."""
        self._by_id[request_id].tokens.extend(tokens)

    def clear(self) -> None:
        self._by_id.clear()
        self.scoring.clear()

    def forget(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)
        self.scoring.discard(request_id)
