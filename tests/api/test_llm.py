"""`from memstep import LLM, SamplingParams` with the real model: vLLM-shaped outputs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memstep import LLM, SamplingParams
from memstep.core.sampling_params import InvalidRequest
from memstep.events.types import RequestAdded


@pytest.fixture(scope="module")
def llm():
    return LLM(model="smollm2", dtype="float32")


def test_chat_says_paris_in_vllm_shape(llm):
    [out] = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=16),
        use_tqdm=False,
    )
    choice = out.outputs[0]
    assert "Paris" in choice.text and choice.finish_reason in ("stop", "length")
    assert choice.token_ids and llm.engine.tokenizer.decode(choice.token_ids).startswith(
        choice.text.strip()[:3]
    )
    assert out.prompt_token_ids and out.finished


def test_generate_n_choices_distinct_and_seeded(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, n=2, seed=11)
    prompts = ["The capital of France is", [504, 3575, 282]]
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in first] == [2, 2]
    assert [c.index for c in first[0].outputs] == [0, 1]
    assert first[0].outputs[0].text != first[0].outputs[1].text
    assert [[c.token_ids for c in o.outputs] for o in first] == [
        [c.token_ids for c in o.outputs] for o in again
    ]
    assert first[0].prompt == "The capital of France is" and first[1].prompt is None
    assert first[1].prompt_token_ids == [504, 3575, 282]


def test_without_params_it_samples_with_the_models_defaults(llm):
    """As vLLM's LLM under generation_config "auto": SmolLM2's card's temperature 0.2 and top-p
    0.9 (the engine's RequestAdded record holds what it sampled with), not bare temperature 1.0;
    params given are taken as they are."""
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.2, top_p=0.9)
    added: list[RequestAdded] = []
    llm.engine.sinks.append(lambda rec: added.append(rec) if isinstance(rec, RequestAdded) else 0)
    try:
        llm.generate("The capital of France is", use_tqdm=False)
        llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.engine.sinks.pop()
    assert [(a.params.temperature, a.params.top_p) for a in added] == [(0.2, 0.9), (1.0, 1.0)]


def test_a_progress_bar_counts_the_requests(llm, capsys):
    llm.generate(["a", "b", "c"], SamplingParams(temperature=0.0, max_tokens=2, n=2))
    err = capsys.readouterr().err
    assert "6/6" in err and "req" in err


def test_bad_params_are_refused_and_the_engine_keeps_serving(llm):
    with pytest.raises(InvalidRequest, match="n must be"):
        SamplingParams(temperature=0.0, n=0)
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingParams(temperature=-1.0)
    assert (
        llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
        .outputs[0]
        .text
    )


def test_a_refused_prompt_in_a_batch_leaves_nothing_queued(llm):
    too_long = [504] * (llm.engine.max_model_len + 1)
    with pytest.raises(InvalidRequest, match="context"):
        llm.generate(
            ["Hi", "Hello", too_long],
            SamplingParams(temperature=0.0, max_tokens=2, n=2),
            use_tqdm=False,
        )
    assert not llm.engine.requests and not llm.engine.has_work()
    [out] = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(out.outputs) == 1 and out.outputs[0].token_ids


def test_importing_memstep_does_not_import_torch():
    code = (
        "import memstep, memstep.serving.http_front.http_server, sys; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_readme_example_gives_two_different_texts(llm):
    """`SamplingParams(n=2, seed=1)` as the README writes it: vLLM's default temperature (1.0)
    samples, so the two choices differ (with the old greedy default they were the same)."""
    [out] = llm.generate(["The capital of France is"], SamplingParams(n=2, seed=1), use_tqdm=False)
    assert out.outputs[0].text != out.outputs[1].text


def test_vllm_names_are_taken_and_the_old_name_warns():
    new = LLM(model="random:tiny", gpu_memory_utilization=0.5, num_threads=1)
    assert new.engine.cfg.gpu_memory_utilization == 0.5
    with pytest.warns(DeprecationWarning, match="use gpu_memory_utilization"):
        old = LLM(model="random:tiny", memory_utilization=0.4, num_threads=1)
    assert old.engine.cfg.gpu_memory_utilization == 0.4
    new.engine.shutdown()
    old.engine.shutdown()


def test_llm_writes_nothing_but_the_callers_own_output_to_stdout():
    """The README's example in a fresh process: stdout holds what it prints and nothing else
    (structlog, unconfigured, wrote every debug line there), and nothing is logged below
    warning on stderr."""
    code = (
        "from memstep import LLM, SamplingParams\n"
        "llm = LLM(model='smollm2', num_threads=1)\n"
        "out = llm.generate(['The capital of France is'], SamplingParams(max_tokens=3, "
        "temperature=0), use_tqdm=False)\n"
        "print(repr(out[0].outputs[0].text))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("\n") == 1 and "Paris" in run.stdout, run.stdout
    assert run.stderr == ""
