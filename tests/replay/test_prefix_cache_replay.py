"""A log with prefix-cache hits (and preemptions that hit their own pages) replays exactly;
`inspect` and `plot` show the hit rate and the cached pages."""

from __future__ import annotations

import json

import pytest
from replay_helpers import isolate_heap, memstep

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import RequestFinished, StepFinished, StepPlanned
from memstep.executors.process.inprocess import local_engine
from memstep.replay.recorder import open_recorder
from memstep.replay.recording import load

CFG = EngineConfig(
    model="random:tiny", block_size=4, num_kv_blocks=40, max_num_seqs=6, num_threads=1
)


@pytest.fixture(scope="module")
def hits_log(tmp_path_factory):
    """Waves of requests that share a system prompt, in pages too few for all of them."""
    path = tmp_path_factory.mktemp("prefix") / "run.memlog"
    isolate_heap()
    recorder = open_recorder(path)
    assert recorder is not None
    engine = local_engine(CFG, sinks=[recorder])
    system = [(7 * i) % 500 + 3 for i in range(30)]
    try:
        for wave in range(3):
            for i in range(6):
                question = [wave * 40 + i * 5 + j + 1 for j in range(3 + i)]
                params = SamplingParams(max_tokens=12 + 4 * i, temperature=0.8, seed=wave * 10 + i)
                engine.add_request(system + question, params, arrival_time=1e9 + i)
            engine.run_until_idle()
        assert engine.scheduler.num_preemptions > 0, "the workload no longer preempts"
    finally:
        engine.shutdown()
        recorder.close()
    return path


def test_a_log_with_cache_hits_replays_identically(hits_log):
    records = load(hits_log).records
    planned = [r for r in records if isinstance(r, StepPlanned)]
    assert sum(len(p.cached) for p in planned) > 0, "the log holds no hit: the test checks nothing"
    code, out, err = memstep("replay", str(hits_log), "--json")
    assert code == 0, out + err
    assert json.loads(out)["identical"] is True


def test_replay_without_the_cache_differs(hits_log):
    """The hits are compared on replay: a what-if run with caching off reports a difference."""
    code, out, err = memstep(
        "replay", str(hits_log), "--set", "enable_prefix_caching=false", "--json"
    )
    assert code == 0, err  # a what-if run reports rather than fails
    assert json.loads(out)["identical"] is False


def test_inspect_and_plot_show_the_hit_rate_and_cached_pages(hits_log, tmp_path):
    records = load(hits_log).records
    finished = [r for r in records if isinstance(r, RequestFinished)]
    cached = sum(r.cached_tokens for r in finished)
    prompt = sum(r.prompt_tokens for r in finished)
    mems = [r.memory for r in records if isinstance(r, StepFinished)]
    code, out, _ = memstep("inspect", str(hits_log), "--json")
    assert code == 0
    s = json.loads(out)
    assert s["requests"]["cached_tokens"] == cached > 0
    assert s["requests"]["prefix_hit_rate"] == pytest.approx(cached / prompt)
    assert s["peak_kv_pages_cached"] == max(m.kv_pages_cached for m in mems) > 0
    assert s["final_kv_pages_cached"] == mems[-1].kv_pages_cached
    text = memstep("inspect", str(hits_log))[1]
    assert f"prefix cache: hit rate {cached / prompt:.3f}" in text
    png = tmp_path / "mem.png"
    code, _, err = memstep("plot", str(hits_log), "-o", str(png))
    assert code == 0, err
    assert png.stat().st_size > 30_000
