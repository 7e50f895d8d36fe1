"""The recorder: header from EngineStarted, a flush per step, rotation, the `--record` flags.
The tiny random model: what is recorded matters here, not the model."""

from __future__ import annotations

import argparse
import json

import pytest
from replay_helpers import isolate_heap, memstep

from memstep import __version__
from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.events.log import LogReader, LogWriter, read_log
from memstep.events.types import (
    EngineStarted,
    RequestAdded,
    StateEntered,
    StateExited,
    StepFinished,
    StepPlanned,
    is_input,
)
from memstep.executors.process.inprocess import local_engine
from memstep.replay.recorder import (
    DEFAULT_RECORD_PATH,
    Recorder,
    RecordPathTaken,
    add_record_arguments,
    open_recorder,
    parse_size,
)

TINY = EngineConfig(model="random:tiny", max_num_seqs=4, num_threads=1)


def test_header_and_first_record_and_one_flush_per_step(tmp_path):
    isolate_heap()
    path = tmp_path / "run.memlog"
    recorder = Recorder(path)
    engine = local_engine(TINY, sinks=[recorder])
    with LogReader(path) as reader:
        assert reader.header["config"] == TINY.replace(seed=engine.cfg.seed).to_dict()
        assert isinstance(engine.cfg.seed, int)  # drawn at start, since TINY sets none
        assert reader.header["model_identity"] == engine.source.identity == "random:tiny:seed=0"
        assert reader.header["memstep_version"] == __version__
        first = next(iter(reader))
    assert first == EngineStarted(__version__, engine.cfg.to_dict(), "random:tiny:seed=0")
    size = path.stat().st_size
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
    assert path.stat().st_size == size  # an input waits for the end of its step
    engine.step()
    grown = path.stat().st_size
    assert grown > size
    _, records, problems = read_log(path)
    assert problems == []
    kinds = [RequestAdded, StepPlanned, StateExited, StateEntered, StepFinished]
    assert [type(r) for r in records[-5:]] == kinds
    assert (records[-3].kind, records[-2].kind) == ("capture", "no_spec")
    engine.shutdown()
    recorder.close()


def test_rotated_log_is_read_and_replayed_as_one(tmp_path):
    path = tmp_path / "rotated.memlog"
    cfg = TINY.replace(speculative_method="ngram", speculative_disable_by_batch_size=3)
    isolate_heap()
    recorder = open_recorder(path, rotate_bytes=4096)
    assert recorder is not None
    engine = local_engine(cfg, sinks=[recorder])
    engine.generate(
        [[i + 1, 2, 3] for i in range(10)], SamplingParams(temperature=0.0, max_tokens=6)
    )
    engine.shutdown()
    recorder.close()
    parts = recorder.parts
    assert len(parts) >= 3 and all(p.stat().st_size <= 4096 for p in parts[:-1])
    code, out, err = memstep("replay", str(path), "--json")
    assert code == 0, out + err
    report = json.loads(out)
    _, records, problems = read_log(path)
    assert problems == [] and report["identical"] and report["num_records"] == len(records)
    assert report["comparison"]["num_compared"] == sum(not is_input(r) for r in records)


def test_record_path_is_never_overwritten_and_time_is_filled_in(tmp_path):
    taken = tmp_path / "taken.memlog"
    taken.write_bytes(b"keep me")
    with pytest.raises(RecordPathTaken, match="never overwritten"):
        open_recorder(taken)
    assert taken.read_bytes() == b"keep me"
    recorder = open_recorder(tmp_path / "run-{time}.memlog")
    assert recorder is not None and "{time}" not in recorder.path.name
    assert recorder.path.name.startswith("run-2") and open_recorder(None) is None


def test_record_flags():
    p = argparse.ArgumentParser()
    add_record_arguments(p)
    args = p.parse_args(["--record", "a.memlog", "--record-rotate-bytes", "64M"])
    assert (args.record, args.record_rotate_bytes) == ("a.memlog", 64 << 20)
    assert p.parse_args([]).record is None
    served = argparse.ArgumentParser()
    add_record_arguments(served, by_default=True)
    assert served.parse_args([]).record == DEFAULT_RECORD_PATH
    off = served.parse_args(["--no-record"])
    assert off.record is None and open_recorder(off) is None
    assert [parse_size(s) for s in ("4096", "1k", "2GiB", "0")] == [4096, 1024, 2 << 30, 0]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_generate_command_records_a_replayable_log(tmp_path):
    path = tmp_path / "generate.memlog"
    argv = ["--model", "random:tiny", "--raw", "--prompt", "hello there", "--max-tokens", "5"]
    code, out, err = memstep("generate", *argv, "--record", str(path))
    assert code == 0, err
    code, out, err = memstep("replay", str(path))
    assert code == 0, err
    assert "identical:" in out


def test_a_log_written_without_the_recorder_header_still_replays(tmp_path):
    """`memstep serve` writes its own header (no model identity); EngineStarted has it."""
    path = tmp_path / "served.memlog"
    isolate_heap()
    with LogWriter(path, {"command": "serve", "config": TINY.to_dict()}) as writer:
        engine = local_engine(TINY, sinks=[writer.append])
        engine.generate([[3, 4, 5], [6, 7]], SamplingParams(temperature=0.0, max_tokens=4))
        engine.shutdown()
    code, out, err = memstep("replay", str(path))
    assert code == 0, out + err
    assert "identical:" in out and "! " not in out
