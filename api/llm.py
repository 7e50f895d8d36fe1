"""`LLM`: the offline API, shaped like vLLM's, over an in-process engine.

    from memstep import LLM, SamplingParams
    llm = LLM(model="smollm2")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, n=2, seed=1))
    print(out[0].outputs[0].text, out[0].outputs[1].token_ids, out[0].outputs[0].finish_reason)
    print(llm.chat([{"role": "user", "content": "Hi!"}])[0].outputs[0].text)

One call runs every prompt (times `n`) as one continuous batch, with a progress bar over the
requests as they finish.  Without `sampling_params` it samples with the model's own defaults
(`get_default_sampling_params()`: SmolLM2's temperature 0.2 and top-p 0.9), as vLLM's `LLM` does
under `generation_config="auto"`; given params are taken as they are.  Choice j of a prompt
samples with seed + j, so `n` choices differ while a given seed still reproduces the whole result.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from typing import Any

import attrs
import structlog
from tqdm import tqdm

from memstep.core import sampling_params as core_params
from memstep.core.config import EngineConfig, with_vllm_names
from memstep.core.engine import Engine
from memstep.core.generation_config import sampling_defaults
from memstep.core.logging import setup_logging
from memstep.core.sampling_params import InvalidRequest
from memstep.executors.process.inprocess import local_engine, release_device_cache

Prompt = str | list[int]
Messages = list[dict[str, str]]


@attrs.frozen(kw_only=True)
class SamplingParams(core_params.SamplingParams):
    """The engine's sampling params plus `n`, the number of completions per prompt."""

    n: int = 1

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if not (isinstance(self.n, int) and self.n >= 1):
            raise InvalidRequest("n must be >= 1")

    def for_choice(self, j: int) -> core_params.SamplingParams:
        data = attrs.asdict(self)
        del data["n"]
        data["seed"] = None if self.seed is None else self.seed + j  # None: drawn per choice
        return core_params.SamplingParams(**data)


@attrs.define
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[list] = attrs.Factory(list)


@attrs.define
class RequestOutput:
    """All choices of one prompt, as vLLM's RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # SamplingParams.prompt_logprobs: as vLLM's, None for the first token, then per prompt
    # token [logprob, [[id, logprob], ...], rank] given the tokens before it; None when not asked
    prompt_logprobs: list[list | None] | None = None


class LLM:
    """Owns an in-process engine (model loaded once) and runs batches of prompts on it.

    `config` takes EngineConfig's fields by vLLM's names (`gpu_memory_utilization`); a former
    memstep name still works, with a DeprecationWarning.

    `close()` (or leaving `with LLM(...) as llm:`, or deleting the last reference) shuts the
    engine down and gives its memory back: its KV pages, arena, buffers and (on CUDA) weights,
    and the allocator's cached blocks, so that a second `LLM` in the process (a notebook, a
    benchmark comparing two configs) finds the memory the first had.  What stays is the
    process's read-only cache of a GGUF's dequantized weights, which the next CPU engine of
    the same model shares instead of loading again.
    """

    def __init__(self, model: str = "smollm2", **config: Any):
        if not structlog.is_configured():  # structlog's default: every debug line on stdout
            setup_logging("console", "warning")  # stderr, as a library should
        cfg = EngineConfig(model=model, **with_vllm_names(config))
        self.engine: Engine = local_engine(cfg)
        self._finalizer = weakref.finalize(self, _release, self.engine)

    def close(self) -> None:
        """Shut the engine down and give its memory back (see the class's docstring); further
        calls do nothing."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """The params a call without any samples with: the model's defaults under
        `generation_config` ("auto": its generation_config.json or, for the shipped SmolLM2, its
        card's; "vllm": SamplingParams' bare ones), as vLLM's method of that name."""
        return SamplingParams(
            **sampling_defaults(self.engine.source, self.engine.cfg.generation_config)
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | core_params.SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt (text or token ids); results in prompt order. A text's ids get
        the tokenizer's own special tokens (a Llama or Gemma tokenizer's BOS; SmolLM2's adds
        none), as vLLM's `LLM.generate` encodes it; token ids are taken as given."""
        batch = _prompt_list(prompts)
        tok = self.engine.tokenizer
        ids = [tok.with_special_tokens(tok.encode(p)) if isinstance(p, str) else p for p in batch]
        texts = [p if isinstance(p, str) else None for p in batch]
        return self._run(ids, texts, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | core_params.SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation or many, through the model's chat template."""
        chats = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.engine.tokenizer.apply_chat_template(list(m)) for m in chats]  # type: ignore[arg-type]
        return self._run(list(texts), list(texts), sampling_params, use_tqdm)

    def _run(
        self,
        prompts: list[Prompt],
        texts: list[str | None],
        params: SamplingParams | core_params.SamplingParams | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        params = params if params is not None else self.get_default_sampling_params()
        n = getattr(params, "n", 1)
        choices = [
            params.for_choice(j) if isinstance(params, SamplingParams) else params for j in range(n)
        ]
        ids = self._add_all(prompts, choices)
        bar = tqdm(total=len(prompts) * n, desc="requests", unit="req", disable=not use_tqdm)
        done = self._until_idle(bar)
        bar.close()
        return [
            RequestOutput(
                request_id=row[0],
                prompt=text,
                prompt_token_ids=self._prompt_ids(prompt),
                outputs=[_choice(j, done[rid]) for j, rid in enumerate(row)],
                prompt_logprobs=done[row[0]].get("prompt_logprobs"),
            )
            for row, prompt, text in zip(ids, prompts, texts, strict=True)
        ]

    def _add_all(
        self, prompts: list[Prompt], choices: list[core_params.SamplingParams]
    ) -> list[list[str]]:
        """Queue every choice of every prompt, or none: a refused prompt (too long, say) aborts
        the ones queued before it, so that the next call does not run them."""
        added: list[str] = []
        try:
            for prompt in prompts:
                added += [self.engine.add_request(prompt, c) for c in choices]
        except InvalidRequest:
            for rid in added:
                self.engine.abort(rid)
            raise
        n = len(choices)
        return [added[i : i + n] for i in range(0, len(added), n)]

    def _until_idle(self, bar: tqdm) -> dict[str, Any]:
        """Step the engine until every request finished, advancing `bar` as they do."""
        done: dict[str, Any] = {}
        while self.engine.has_work():
            finished = 0
            for out in self.engine.step():
                row = done.setdefault(out.request_id, {"text": "", "ids": [], "logprobs": []})
                row["text"] += out.new_text
                row["ids"] += out.new_token_ids
                row["logprobs"] += out.logprobs
                if out.prompt_logprobs:
                    row["prompt_logprobs"] = [None, *out.prompt_logprobs]
                if out.finished:
                    row["reason"] = out.finish_reason or "stop"
                    finished += 1
            if finished:
                bar.update(finished)
        return done

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        return self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def _release(engine: Engine) -> None:
    """Shut `engine` down and return its memory: the executor drops its worker (every tensor
    with it), a collection frees what cycles held, and the CUDA allocator hands its cached
    blocks back, so that reserved memory returns to where it was before the engine."""
    engine.shutdown()
    gc.unfreeze()  # the worker froze its start-up objects (LiveTensorMeter.freeze): cycles too
    gc.collect()
    release_device_cache()


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or many, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


def _choice(index: int, row: dict[str, Any]) -> CompletionOutput:
    return CompletionOutput(index, row["text"], row["ids"], row["reason"], row["logprobs"])
