"""Fuzz the API socket: random and mutated frames each get an answer; the server never dies."""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Iterator
from pathlib import Path

import attrs
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memstep.api.client import Client
from memstep.cli.serve import ServerProcess
from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.events import codec
from memstep.events.wire import (
    API_REQUESTS,
    AbortReply,
    ErrorReply,
    GenerateDelta,
    GenerateDone,
    GenerateRequest,
    HealthReply,
    Keepalive,
    StatsReply,
)
from memstep.executors.process.inprocess import local_engine

NUM_FRAMES = 2000
TIMEOUT_MS = 20_000
TINY_SERVER = ["--model", "random:tiny", "--num-threads", "1"]
FINAL = (ErrorReply, GenerateDone, HealthReply, StatsReply, AbortReply)
ERROR_CODES = {
    "malformed_frame",
    "frame_too_large",
    "unknown_type",
    "missing_field",
    "invalid_field",
    "unknown_field",
    "invalid_request",
    "unknown_request",
    "duplicate_request",
}

SEEDS = [
    {"t": "HealthRequest", "request_id": "h"},
    {"t": "StatsRequest", "request_id": "s"},
    {"t": "AbortRequest", "request_id": "a", "target_id": "g"},
    {"t": "GenerateRequest", "request_id": "g", "prompt": "fuzz", "params": {"max_tokens": 3}},
    {
        "t": "GenerateRequest",
        "request_id": "g",
        "prompt_token_ids": [5, 6, 7],
        "params": {"max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "seed": 3},
        "stream": True,
    },
    {
        "t": "GenerateRequest",
        "request_id": "g",
        "messages": [{"role": "user", "content": "hi"}],
        "params": {"max_tokens": 2, "top_k": 5, "stop": ["x"]},
    },
]
KEYS = sorted({k for seed in SEEDS for k in seed} | {"max_tokens", "top_p", "temperature"})

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from(["GenerateRequest", "HealthRequest", "AbortRequest", "g", "h"]),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=12,
)


@st.composite
def mutated_map(draw) -> bytes:
    obj = dict(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(KEYS))
        action = draw(st.sampled_from(["set", "delete", "params"]))
        if action == "delete":
            obj.pop(key, None)
        elif action == "set":
            obj[key] = draw(values)
        else:
            params = obj.get("params")
            params = dict(params) if isinstance(params, dict) else {}
            params[draw(st.sampled_from(KEYS))] = draw(values)
            obj["params"] = params
    return msgpack.packb(obj, use_bin_type=True)


@st.composite
def mutated_bytes(draw) -> bytes:
    data = bytearray(msgpack.packb(draw(st.sampled_from(SEEDS))))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i:]
            if not data:
                break
        else:
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


frames = st.one_of(
    st.binary(max_size=64),
    values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    mutated_map(),
    mutated_bytes(),
)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(TINY_SERVER) as proc:
        proc.wait_ready()
        yield proc


def answer(sock: zmq.Socket, frame: bytes) -> object:
    """Send one frame; read replies until the one that ends it, and return that one."""
    sock.send(frame)
    while True:
        assert sock.poll(TIMEOUT_MS), f"no reply to {frame!r}"
        reply = codec.decode(sock.recv())
        if isinstance(reply, FINAL):
            return reply
        assert isinstance(reply, GenerateDelta | Keepalive), reply


def test_fuzzed_frames_all_get_answers_and_the_server_survives(server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    sent: list[bytes] = []
    codes: dict[str, int] = {}

    @settings(
        max_examples=NUM_FRAMES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(frame=frames)
    def one_frame(frame: bytes) -> None:
        sent.append(frame)
        reply = answer(sock, frame)
        if isinstance(reply, ErrorReply):
            assert reply.code in ERROR_CODES, reply
            codes[reply.code] = codes.get(reply.code, 0) + 1

    one_frame()
    assert not sock.poll(300), "a frame got more than one final reply"
    sock.close(0)
    assert len(sent) >= NUM_FRAMES
    assert len(codes) >= 6, f"the fuzz reached too few kinds of errors: {codes}"
    assert server.proc.poll() is None, "the server died"
    with Client(server.address, timeout=10) as client:
        assert client.health().status == "ok"
        done = client.generate("still here", max_tokens=4, temperature=0.0)
        assert len(done.token_ids) == 4
        assert client.stats().num_inflight == 0


# --- the frame storm: every kind of malformed frame, with real requests riding along ---------
#
# A fixed-seed generator makes frames that are each broken in one known way, so the server must
# answer each with one ErrorReply of a known code, in order; they are sent BATCH at a time.  Real
# generate requests go on another connection meanwhile and must get the in-process completions.
# Frames over 4 x max_frame_bytes go on their own connection: ZeroMQ closes it unread (§6).

STORM_SEED = 14
STORM_SLICE = 10_000  # make test; the slow test sends STORM_ALL
STORM_ALL = 100_000
BATCH = 50
DROP_EVERY = 2_000  # one 10 MB frame per this many
MAX_FRAME = 1 << 20  # the server's default max_frame_bytes
RSS_BOUND = 64 << 20  # the core's peak resident memory may grow this much over its baseline
REAL_PROMPTS = 6
REAL_MAX_TOKENS = 6

ANY_ERROR = frozenset(ERROR_CODES - {"duplicate_request", "unknown_request"})
MALFORMED = frozenset({"malformed_frame"})
VALID = {
    "GenerateRequest": {
        "t": "GenerateRequest",
        "request_id": "f",
        "prompt": "fuzz",
        "params": {"max_tokens": 2},
        "stream": False,
    },
    "AbortRequest": {"t": "AbortRequest", "request_id": "f", "target_id": "nobody"},
    "HealthRequest": {"t": "HealthRequest", "request_id": "f"},
    "StatsRequest": {"t": "StatsRequest", "request_id": "f"},
}
WRONG_TYPES = {  # field -> values of a type it never takes
    "request_id": [0, None, 1.5, b"f", ["f"], {"f": 1}, True, "", "f" * 129],
    "prompt": [5, b"fuzz", ["fuzz"], {"p": "q"}, True, 1.5],
    "prompt_token_ids": ["1", [1, "2"], [1.5], {"a": 1}, [None], [True], 7],
    "messages": ["hi", [1], [{"role": 1}], [{"role": "user", "content": None}], {"role": "u"}],
    "params": [[1], "x", 1, None, True, b"\x80"],
    "stream": [1, 0, "yes", None, 1.0, []],
    "target_id": [1, None, b"g", [], {}],
}
BAD_PARAMS = [  # each a GenerateRequest the engine refuses: NaN, infinities, 64-bit extremes
    ("temperature", [math.nan, math.inf, -math.inf, -(2**63), -1e308, "hot"]),
    ("top_p", [math.nan, math.inf, 0.0, 2**64 - 1, -1, None]),
    ("min_p", [math.nan, -math.inf, 2**64 - 1, -(2**63)]),
    ("repetition_penalty", [math.nan, math.inf, 0, -math.inf]),
    ("presence_penalty", [math.nan, math.inf, 2**64 - 1, -(2**63)]),
    ("frequency_penalty", [math.nan, -math.inf, 2**64 - 1, -(2**63)]),
    ("max_tokens", [2**64 - 1, 2**63, -(2**63), 0, math.nan, 1e300, True]),
    ("seed", [2**64 - 1, 2**63, -1, math.inf]),
    ("logprobs", [2**64 - 1, -(2**63), 21, math.nan]),
    ("top_k", [-(2**63), math.nan, math.inf, -1]),
    ("stop_token_ids", [[math.nan], ["x"], 5]),
    ("stop", [[""], [1], "x", [math.inf]]),
]
FLOAT32 = {  # msgpack float 32 encodings, which msgpack.packb never writes by default
    "temperature": [b"\xca\x7f\xc0\x00\x00", b"\xca\xff\x80\x00\x00"],  # NaN, -inf
    "top_p": [b"\xca\x7f\x80\x00\x00", b"\xca\x7f\xc0\x00\x01"],  # inf, a NaN payload
}
OPENERS = [b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\xdf\x00\x00\x00\x01\xa1k"]  # [x], {"k": x}
DEPTHS = [33, 1000, 1023, 1024, 1025, 100_000]
HUGE = [  # headers that claim far more than the frame holds
    b"\xdb\xff\xff\xff\xf0",  # str 32: 4 GB
    b"\xc6\xff\xff\xff\xf0",  # bin 32
    b"\xdd\xff\xff\xff\xf0",  # array 32: 4 G items
    b"\xdf\xff\xff\xff\xf0",  # map 32
    b"\xc9\xff\xff\xff\xf0\x05",  # ext 32
    b"\xda\xff\xff",  # str 16: 64 KB
    b"\xdc\xff\xff\x01",  # array 16 with one item of 65,535
]
NOT_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"ok\xe2\x82", b"\x80"]
POSITIONS = [  # where a broken value goes: every field of every request, every sampling param
    "frame",
    "t",
    *sorted({f.name for cls in API_REQUESTS.values() for f in attrs.fields(cls)}),
    *(f"params.{f.name}" for f in attrs.fields(SamplingParams)),
]


Frame = tuple[bytes, frozenset[str], str]  # the frame, the error codes it may get, where it breaks


def pack_map(fields: dict[str, bytes]) -> bytes:
    """A msgpack map whose values are packed already: one may be hand-made bytes."""
    body = b"".join(msgpack.packb(key) + value for key, value in fields.items())
    return bytes([0x80 | len(fields)]) + body


def packed_fields(obj: dict) -> dict[str, bytes]:
    return {key: msgpack.packb(value) for key, value in obj.items()}


def with_value(rng: random.Random, value: bytes) -> tuple[bytes, str]:
    """A valid request with one field, sampling param or the whole frame set to `value`.

    The field may be one its type lacks (`prompt` in a HealthRequest): broken bytes are refused
    while unpacking, before fields are looked at.  Returns the frame and where `value` went.
    """
    where = rng.choice(POSITIONS)
    fields = packed_fields(VALID[rng.choice(sorted(VALID))])
    if where == "frame":
        return value, where
    if where.startswith("params."):
        fields = packed_fields(VALID["GenerateRequest"])
        fields["params"] = pack_map({where[7:]: value})
    else:
        fields[where] = value
    return pack_map(fields), where


def random_bytes(rng: random.Random) -> Frame:
    return rng.randbytes(rng.randint(0, 64)), ANY_ERROR, ""


def truncated(rng: random.Random) -> Frame:
    obj = dict(VALID[rng.choice(sorted(VALID))])
    if rng.random() < 0.5:
        obj["request_id"] = "x" * rng.randint(1, 128)
    data = msgpack.packb(obj)
    return data[: rng.randrange(len(data))], MALFORMED, ""


def wrong_type(rng: random.Random) -> Frame:
    obj = dict(VALID[rng.choice(sorted(VALID))])
    field = rng.choice([key for key in obj if key != "t"])
    obj[field] = rng.choice(WRONG_TYPES[field])
    return msgpack.packb(obj), frozenset({"invalid_field"}), field


def unknown_type(rng: random.Random) -> Frame:
    obj = dict(VALID[rng.choice(sorted(VALID))])
    names = ["Shutdown", "StepPlan", "ExecutorStop", "ErrorReply", "", "healthrequest", 7, None]
    names += [1.5, b"HealthRequest", ["HealthRequest"], {"t": "HealthRequest"}, True]
    names += ["".join(rng.choices("abcXYZ\u00e9\u4e2d", k=rng.randint(1, 30)))]
    if rng.random() < 0.2:
        del obj["t"]
    else:
        obj["t"] = rng.choice(names)
    return msgpack.packb(obj), frozenset({"unknown_type"}), ""


def deep(rng: random.Random) -> Frame:
    depth = rng.choice(DEPTHS)
    leaf = rng.choice([b"\x01", b"\xc0", b"\xa1x", b"\x80"])
    frame, where = with_value(rng, rng.choice(OPENERS) * depth + leaf)
    return frame, MALFORMED, f"{where}@{depth}"


def huge_length(rng: random.Random) -> Frame:
    frame, where = with_value(rng, rng.choice(HUGE) + rng.randbytes(rng.randint(0, 8)))
    return frame, MALFORMED, where


def not_utf8(rng: random.Random) -> Frame:
    raw = rng.choice(NOT_UTF8)
    text = bytes([0xA0 | len(raw)]) + raw  # a fixstr holding bytes that are not UTF-8
    if rng.random() < 0.3:  # as a key
        return (
            b"\x82" + msgpack.packb("t") + msgpack.packb("HealthRequest") + text,
            MALFORMED,
            "key",
        )
    frame, where = with_value(rng, text)
    return frame, MALFORMED, where


def bad_number(rng: random.Random) -> Frame:
    fields = packed_fields(VALID["GenerateRequest"])
    if rng.random() < 0.15:
        name = rng.choice(sorted(FLOAT32))
        fields["params"] = pack_map({name: rng.choice(FLOAT32[name])})
        return pack_map(fields), frozenset({"invalid_request"}), name
    if rng.random() < 0.15:
        del fields["prompt"]
        fields["prompt_token_ids"] = msgpack.packb([5, rng.choice([2**64 - 1, -(2**63), 512])])
        return pack_map(fields), frozenset({"invalid_request"}), "prompt_token_ids"
    name, bad = rng.choice(BAD_PARAMS)
    fields["params"] = msgpack.packb({name: rng.choice(bad)})
    return pack_map(fields), frozenset({"invalid_request"}), name


def too_large(rng: random.Random) -> Frame:
    size = rng.randint(MAX_FRAME + 1, 4 * MAX_FRAME)
    return rng.randbytes(16) + bytes(size - 16), frozenset({"frame_too_large"}), ""


KINDS = {  # kind -> (maker, weight)
    "random_bytes": (random_bytes, 20),
    "truncated": (truncated, 15),
    "wrong_type": (wrong_type, 15),
    "unknown_type": (unknown_type, 10),
    "deep": (deep, 15),
    "huge_length": (huge_length, 10),
    "not_utf8": (not_utf8, 8),
    "bad_number": (bad_number, 15),
    "too_large": (too_large, 0.2),
}


def storm(seed: int, count: int) -> Iterator[tuple[str, Frame]]:
    """Yield (kind, frame) for `count` frames, the same for a seed."""
    rng = random.Random(seed)
    names = list(KINDS)
    weights = [KINDS[name][1] for name in names]
    for _ in range(count):
        kind = rng.choices(names, weights)[0]
        yield kind, KINDS[kind][0](rng)


@attrs.define
class Storm:
    """What one storm saw: replies by code, frames by kind, real completions, core memory."""

    codes: collections.Counter = attrs.Factory(collections.Counter)
    kinds: collections.Counter = attrs.Factory(collections.Counter)
    places: dict[str, set[str]] = attrs.Factory(lambda: collections.defaultdict(set))
    dropped: int = 0
    real_sent: int = 0
    real_done: dict[str, GenerateDone] = attrs.Factory(dict)
    real_streamed: dict[str, list[int]] = attrs.Factory(dict)
    rss_baseline: int = 0
    rss_peak: int = 0
    rss_end: int = 0


def storm_reference() -> list[list[int]]:
    """Greedy completions of the real prompts from an in-process engine on the same model."""
    rng = random.Random(STORM_SEED)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 20))] for _ in range(REAL_PROMPTS)]
    engine = local_engine(EngineConfig(model="random:tiny", num_threads=1))
    try:
        done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=REAL_MAX_TOKENS))
    finally:
        engine.shutdown()
    return [[*prompt, *out.token_ids] for prompt, out in zip(prompts, done, strict=True)]


def run_storm(server: ServerProcess, count: int) -> Storm:
    """Send `count` storm frames, BATCH at a time, with a real request beside each batch."""
    ctx = zmq.Context.instance()
    fuzz, real = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock in (fuzz, real):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
    reference = storm_reference()
    out = Storm()
    pid = server.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    out.rss_baseline = proc_status_bytes(pid, "VmRSS")
    pending: list[tuple[bytes, frozenset[str]]] = []
    for i, (kind, (frame, codes, where)) in enumerate(storm(STORM_SEED, count)):
        out.kinds[kind] += 1
        out.places[kind].add(where)
        pending.append((frame, codes))
        if len(pending) == BATCH or i == count - 1:
            send_real(real, out, reference)
            answer_batch(fuzz, pending, out)
            collect_real(real, out, wait_ms=0)
            pending = []
        if i % DROP_EVERY == DROP_EVERY - 1:
            send_dropped_frame(ctx, server.address)
            out.dropped += 1
    while len(out.real_done) < out.real_sent:
        assert collect_real(real, out, wait_ms=TIMEOUT_MS), "real requests stopped being answered"
    out.rss_peak = proc_status_bytes(pid, "VmHWM")
    out.rss_end = proc_status_bytes(pid, "VmRSS")
    for sock in (fuzz, real):
        assert not sock.poll(300), "a frame got more than one final reply"
        sock.close(0)
    for request_id, done in out.real_done.items():
        n = int(request_id.split("-")[1])
        expected = reference[n % REAL_PROMPTS]
        assert done.finish_reason == "length", done
        assert done.token_ids == expected[-REAL_MAX_TOKENS:], (request_id, done)
        if n % 2:
            assert out.real_streamed[request_id] == done.token_ids
    return out


def proc_status_bytes(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def send_real(real: zmq.Socket, out: Storm, reference: list[list[int]]) -> None:
    """One real generate request; every other one streams."""
    n = out.real_sent
    prompt = reference[n % REAL_PROMPTS][:-REAL_MAX_TOKENS]
    params = {"max_tokens": REAL_MAX_TOKENS, "temperature": 0.0}
    msg = GenerateRequest(f"real-{n}", prompt_token_ids=prompt, params=params, stream=n % 2 == 1)
    real.send(codec.encode(msg))
    out.real_streamed[msg.request_id] = []
    out.real_sent += 1


def collect_real(real: zmq.Socket, out: Storm, wait_ms: int) -> bool:
    """Read what has come back for the real requests; False when nothing came in `wait_ms`."""
    if not real.poll(wait_ms):
        return False
    while real.poll(0):
        reply = codec.decode(real.recv())
        if isinstance(reply, GenerateDelta):
            out.real_streamed[reply.request_id].extend(reply.token_ids)
        elif isinstance(reply, GenerateDone):
            assert reply.request_id not in out.real_done, reply
            out.real_done[reply.request_id] = reply
        else:
            assert isinstance(reply, Keepalive), reply
    return True


def answer_batch(fuzz: zmq.Socket, batch: list[tuple[bytes, frozenset[str]]], out: Storm) -> None:
    """Send a batch; each frame must get one ErrorReply of its expected codes, in order."""
    for frame, _ in batch:
        fuzz.send(frame)
    for frame, codes in batch:
        assert fuzz.poll(TIMEOUT_MS), f"no reply to {frame[:80]!r}"
        reply = codec.decode(fuzz.recv())
        assert isinstance(reply, ErrorReply), (frame[:80], reply)
        assert reply.code in codes, (frame[:80], reply)
        out.codes[reply.code] += 1


def send_dropped_frame(ctx: zmq.Context, address: str) -> None:
    """A 10 MB frame, over 4 x max_frame_bytes, on its own connection: ZeroMQ cuts it unread."""
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(address)
    big.send(bytes(10 << 20))
    assert not big.poll(200), "a frame past ZMQ_MAXMSGSIZE got a reply"
    big.close(0)


def check_storm(server: ServerProcess, out: Storm, count: int) -> None:
    assert sum(out.kinds.values()) == sum(out.codes.values()) == count
    assert set(out.kinds) == set(KINDS), out.kinds  # every kind of malformation was sent
    assert {f"{where}@100000" for where in POSITIONS} <= out.places["deep"]  # in every field
    assert set(POSITIONS) <= out.places["huge_length"] & out.places["not_utf8"]
    assert out.dropped == count // DROP_EVERY >= 1
    assert "internal_error" not in out.codes, out.codes
    assert out.real_sent == len(out.real_done) >= count // BATCH
    growth = out.rss_peak - out.rss_baseline
    assert growth <= RSS_BOUND, f"core RSS grew {growth >> 20} MiB (bound {RSS_BOUND >> 20} MiB)"
    assert server.proc.poll() is None, "the server died"
    with Client(server.address, timeout=10) as client:
        assert client.health().status == "ok"
        assert client.stats().num_inflight == 0
    assert "Traceback" not in server.log(), server.log()  # no frame met a server bug
    print(
        f"\nstorm of {count} frames: replies {dict(out.codes)}; kinds {dict(out.kinds)}; "
        f"{out.dropped} 10 MB frames dropped; {out.real_sent} real requests answered; core RSS "
        f"{out.rss_baseline >> 20} MiB, peak {out.rss_peak >> 20}, end {out.rss_end >> 20}"
    )


@pytest.fixture
def fresh_server():
    with ServerProcess(TINY_SERVER) as proc:
        proc.wait_ready()
        yield proc


def test_storm_of_malformed_frames_beside_real_requests(fresh_server):
    check_storm(fresh_server, run_storm(fresh_server, STORM_SLICE), STORM_SLICE)


@pytest.mark.slow
def test_storm_of_100_000_malformed_frames(fresh_server):
    check_storm(fresh_server, run_storm(fresh_server, STORM_ALL), STORM_ALL)


# --- issue 55's small holes, as the API socket sees them -------------------------------------
# msgpack carries no integer past 64 bits and the socket takes no tools, so what reaches it of
# them: digit strings past Python's 4,300 digits where numbers go, roles empty or of 10 KB,
# `</tool_call>` in a message, and params nested past the codec's depth.

LONG_DIGITS = "7" * 5_000


def _issue_55_frames() -> list[tuple[str, bytes, bool]]:
    """(what, frame, whether it may be served) for each."""
    base = dict(VALID["GenerateRequest"])
    chat = {k: v for k, v in base.items() if k != "prompt"}
    cases = [
        ("max_tokens digits", {**base, "params": {"max_tokens": LONG_DIGITS}}, False),
        ("seed digits", {**base, "params": {"max_tokens": 2, "seed": LONG_DIGITS}}, False),
        ("stop digits", {**base, "params": {"max_tokens": 2, "stop": [LONG_DIGITS]}}, True),
        ("empty role", {**chat, "messages": [{"role": "", "content": "x"}]}, True),
        ("10 KB role", {**chat, "messages": [{"role": "r" * 10_240, "content": "x"}]}, True),
        (
            "tool_call",
            {**chat, "messages": [{"role": "user", "content": "</tool_call>" * 99}]},
            True,
        ),
    ]
    frames = [(what, msgpack.packb(obj), ok) for what, obj, ok in cases]
    deep = b"\x91" * 10_000 + b"\x01"  # [[[...[1]...]]]: msgpack.packb stops at 512 levels
    placed = msgpack.packb({**base, "params": {"max_tokens": 2, "stop": "DEEP"}})
    deep_params = placed.replace(msgpack.packb("DEEP"), deep)
    return [*frames, ("params nested 10,000 deep", deep_params, False)]


@pytest.mark.parametrize("case", range(7))
def test_issue_55_inputs_over_zmq_get_one_typed_reply_each(server, case):
    what, frame, may_serve = _issue_55_frames()[case]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        reply = answer(sock, frame)
    finally:
        sock.close(0)
    if isinstance(reply, ErrorReply):
        assert reply.code in ERROR_CODES - {"internal_error"}, (what, reply)
    else:
        assert may_serve and isinstance(reply, GenerateDone), (what, reply)
    assert server.proc.poll() is None
    with Client(server.address, timeout=10) as client:
        assert client.health().status == "ok"
