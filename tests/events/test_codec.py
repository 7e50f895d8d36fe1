"""The record codec: every registered record round-trips, every malformation is a CodecError."""

from __future__ import annotations

import typing
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from memstep.events import codec, plan
from memstep.events.codec import CodecError, decode, encode, from_obj, to_obj
from memstep.events.sampling_params import SamplingParams
from memstep.events.types import (
    REGISTRY,
    DraftLengthChanged,
    EngineStarted,
    ExecutorLost,
    InputMark,
    LeakSuspected,
    LedgerEntry,
    MemoryReport,
    PhaseChanged,
    RecordsLost,
    RecoveryDone,
    RecoveryStarted,
    RequestAborted,
    RequestAdded,
    RequestFinished,
    RequestNamed,
    RequestPreempted,
    RequestResumed,
    RequestTimed,
    SpecThresholdChanged,
    StateEntered,
    StateExited,
    StepFinished,
    StepPlanned,
)

LEDGER = [
    LedgerEntry(owner="decode", buffer="kv_pages", nbytes=64 << 20, step_claimed=0),
    LedgerEntry(owner="spec", buffer="draft_logits", nbytes=3 << 20, step_claimed=41),
]
MEMORY = MemoryReport(
    live_bytes=812_646_400,
    reserved_bytes=1_073_741_824,
    num_segments=14,
    num_allocs=90_211,
    arena_claimed_bytes=67 << 20,
    kv_pages_used=37,
)
SAMPLES: list[object] = [
    MEMORY,
    LEDGER[0],
    EngineStarted(
        memstep_version="0.1.0",
        config={"max_batch": 8, "page_size": 16, "dtype": "bfloat16", "spec": None},
        model_identity="random:tiny:seed=0",
    ),
    RequestAdded(
        step=3,
        request_id="req-0007",
        prompt_token_ids=[1, 15043, 29892, 920, 526, 366, 29973],
        params=SamplingParams(temperature=0.7, top_p=0.95, max_tokens=64, seed=1234),
        arrival_time=1717171717.25,
    ),
    RequestAborted(step=9, request_id="req-0007"),
    PhaseChanged(step=4, old="prefill", new="decode"),
    StepPlanned(step=4, kind="decode", batch=[["req-0007", 1], ["req-0008", 1]], num_tokens=2),
    StateExited(step=40, kind="decode", bytes_released=0, ledger=LEDGER[:1]),
    StateEntered(step=41, kind="spec", bytes_claimed=3 << 20, ledger=LEDGER),
    StepFinished(
        step=41,
        kind="spec",
        sampled=[["req-0007", [319, 4086]], ["req-0008", []]],
        num_proposed=4,
        num_accepted=1,
        memory=MEMORY,
    ),
    RequestFinished(
        step=70, request_id="req-0007", reason="length", prompt_tokens=7, completion_tokens=64
    ),
    LeakSuspected(step=50, kind="spec", what="held_after_exit", nbytes=3 << 20, detail="logits"),
    InputMark(seq=7, crc=0x9E3779B9),
    RecordsLost(
        step=90, num_records=12, first_step=80, last_step=88, reason="[Errno 27] File too large"
    ),
    ExecutorLost(
        step=12,
        reason="executor process 4242 died (killed by SIGKILL)",
        during="step",
        gave_up=False,
    ),
    RecoveryStarted(
        step=12, num_losses=1, num_readmitted=16, num_waiting=20, tokens_to_recompute=512
    ),
    RecoveryDone(step=12, num_readmitted=16, tokens_to_recompute=512, num_starts=1, seconds=2.84),
    RequestResumed(
        step=0,
        request_id="req-0007",
        prompt_token_ids=[1, 15043, 29892, 920],
        params=SamplingParams(temperature=0.8, max_tokens=64, seed=1234),
        output_token_ids=[319, 4086, 13],
        arrival_time=1717171717.25,
    ),
    RequestNamed(step=3, request_id="req-0007", client_id="3f2a-story-0"),
    RequestPreempted(step=44, request_id="req-0008", cause="preemption", num_tokens=519),
    SpecThresholdChanged(step=88, threshold=8, rates=[[1, 61.5, 52.25], [8, 190.0, 312.75]]),
    SpecThresholdChanged(step=301, threshold=None, rates=[[8, 330.5, 312.0]]),
    DraftLengthChanged(step=40, request_id="req-12", old=3, new=2),
    RequestTimed(
        step=31, request_id="req-7", reason="length", ttft_s=0.041, e2e_s=1.93, queue_s=None
    ),
    SamplingParams(
        max_tokens=32,
        temperature=0.6,
        seed=9,
        stop_token_ids=[2, 13],
        logit_bias={"7": 3.0, "11": -50},
        stop=[".", "\n\n"],
        guided_choice=["yes", "no"],
        prompt_logprobs=1,
    ),
]


def sample_id(rec: object) -> str:
    return type(rec).__name__


# --- strategies built from the annotations, independently of the codec ---------------------

TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
INTS = st.integers(-(2**63), 2**64 - 1)  # the whole msgpack integer range
MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | INTS | st.floats(allow_nan=False) | TEXT | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)
SCALARS: dict[Any, st.SearchStrategy[Any]] = {
    int: INTS,
    float: st.floats(allow_nan=False),
    str: TEXT,
    bool: st.booleans(),
    bytes: st.binary(max_size=16),
    list: st.lists(MSGPACK_VALUES, max_size=4),
    dict: st.dictionaries(TEXT, MSGPACK_VALUES, max_size=4),
}


def values_for(tp: Any) -> st.SearchStrategy[Any]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in SCALARS:
        return SCALARS[tp]
    if type(None) in args:
        (inner,) = [arg for arg in args if arg is not type(None)]
        return st.none() | values_for(inner)
    if origin is list:
        return st.lists(values_for(args[0]), max_size=6)
    if origin is dict:
        return st.dictionaries(TEXT, values_for(args[1]), max_size=4)
    return records_of(tp)


# SamplingParams refuses most values of its fields' types: valid ones, by field
SAMPLING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(8, 100),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(0, 50),
    "seed": st.none() | st.integers(0, 2**63 - 1),
    "stop_token_ids": st.lists(st.integers(0, 2**31), max_size=3),
    "min_tokens": st.integers(0, 8),
    "logit_bias": st.dictionaries(st.integers(0, 2**31), st.floats(-100, 100), max_size=3),
    "stop": st.lists(TEXT.filter(bool), max_size=3),
    "prompt_logprobs": st.none() | st.integers(0, 20),
}


def records_of(cls: type) -> st.SearchStrategy[Any]:
    if cls is SamplingParams:
        return st.builds(cls, **SAMPLING_FIELDS)
    hints = typing.get_type_hints(cls)
    # deferred, so that building the strategy of a self-nesting record does not recurse forever
    fields = {
        f.name: st.deferred(lambda tp=hints[f.name]: values_for(tp)) for f in attrs.fields(cls)
    }
    return st.builds(cls, **fields)


RECORD_CLASSES = [REGISTRY[name] for name in sorted(REGISTRY)]
ANY_RECORD = st.sampled_from(RECORD_CLASSES).flatmap(records_of)


def decode_or_codec_error(data: bytes) -> object | None:
    """Decode `data`; the only acceptable outcomes are a registered record or CodecError."""
    try:
        rec = decode(data)
    except CodecError:
        return None
    assert REGISTRY.get(type(rec).__name__) is type(rec)
    return rec


# --- round trips ---------------------------------------------------------------------------


def test_samples_cover_every_class_in_types():
    # other modules' records (events/plan.py) are covered by the generated round trips below
    in_types = {name for name, cls in REGISTRY.items() if cls.__module__ == MemoryReport.__module__}
    missing = in_types - {sample_id(rec) for rec in SAMPLES}
    assert not missing, f"add a realistic sample of {sorted(missing)} to SAMPLES"


@pytest.mark.parametrize("rec", SAMPLES, ids=sample_id)
def test_realistic_record_round_trips(rec):
    assert decode(encode(rec)) == rec
    assert from_obj(to_obj(rec)) == rec


@given(ANY_RECORD)
def test_any_record_round_trips(rec):
    assert decode(encode(rec)) == rec


@given(records_of(plan.StepPlan))  # importing plan also puts its records in ANY_RECORD
def test_step_plan_carries_its_seq_plans_as_rows(rec):
    """SeqPlan is a row record: inside a StepPlan each is its values in field order, with
    no type tag or keys; alone it is a tagged map as any record."""
    names = [f.name for f in attrs.fields(plan.SeqPlan)]
    rows = to_obj(rec)["seqs"]
    assert [list(row) for row in rows] == [[getattr(s, n) for n in names] for s in rec.seqs]
    assert decode(encode(rec)) == rec
    if rec.seqs:
        assert to_obj(rec.seqs[0])["t"] == "SeqPlan"


def plan_rows(*seqs: plan.SeqPlan) -> dict:
    """A StepPlan as the executor unpacks it: its seqs as lists of values."""
    return msgpack.unpackb(encode(plan.StepPlan(0, "no_spec", list(seqs), [])), raw=False)


def test_a_bad_row_value_is_named_with_its_row_and_field():
    seq = plan.SeqPlan("r", 0, [1, 2], [0], True, 0, 2)
    obj = plan_rows(seq, seq)
    obj["seqs"][1][2] = [1, "2"]  # token_ids
    match = r"StepPlan\.seqs\[1\]: SeqPlan\.token_ids\[1\]: expected int, got str"
    with pytest.raises(CodecError, match=match):
        from_obj(obj)
    obj = plan_rows(seq, seq)
    obj["seqs"][1][1] = "0"  # start_pos: an exact-typed value, checked with the row's others
    with pytest.raises(CodecError, match=r"StepPlan\.seqs\[1\]: SeqPlan\.start_pos: expected int"):
        from_obj(obj)
    obj = plan_rows(seq)
    obj["seqs"][0] = obj["seqs"][0][:-1]
    width = len(attrs.fields(plan.SeqPlan))
    with pytest.raises(
        CodecError, match=rf"StepPlan\.seqs\[0\]: expected a SeqPlan row of {width}"
    ):
        from_obj(obj)


def test_a_long_plan_is_checked_by_column_and_a_bad_item_in_its_last_row_is_named():
    """A plan's rows are checked a column at a time (events/codec.py `_rows_by_column`): every
    item of every list still counts, and what is wrong is then named row by row."""
    seqs = [plan.SeqPlan(f"r{i}", i, [i], list(range(i % 40)), True, 0, i) for i in range(1000)]
    obj = plan_rows(*seqs)
    assert from_obj(obj) == plan.StepPlan(0, "no_spec", seqs, [])
    obj["seqs"][999][3][-1] = True  # a bool in block_table, which msgpack keeps apart from int
    with pytest.raises(CodecError, match=r"seqs\[999\]: SeqPlan\.block_table\[38\]: expected int"):
        from_obj(obj)


def test_an_all_empty_column_skips_its_decoder_but_not_its_type_check():
    """A column whose values are all empty (the logprobs of a step without them) is taken
    without calling its decoder per row; an empty value of the wrong container type is still
    refused, and named."""
    seqs = [plan.SeqResult(f"r{i}", [i], [], 0, 0) for i in range(100)]
    mem = MemoryReport(*range(9))
    rec = plan.StepResult(0, "no_spec", seqs, mem, [], [], [])
    obj = msgpack.unpackb(encode(rec), raw=False)
    assert from_obj(obj) == rec
    obj["seqs"][57][2] = {}  # logprobs: an empty map where a list is typed
    with pytest.raises(CodecError, match=r"seqs\[57\]: SeqResult\.logprobs: expected list"):
        from_obj(obj)


def test_nested_records_encode_as_tagged_maps():
    rec = StateExited(step=40, kind="decode", bytes_released=0, ledger=LEDGER[:1])
    expected = {
        "t": "StateExited",
        "step": 40,
        "kind": "decode",
        "bytes_released": 0,
        "ledger": [
            {
                "t": "LedgerEntry",
                "owner": "decode",
                "buffer": "kv_pages",
                "nbytes": 64 << 20,
                "step_claimed": 0,
            },
        ],
    }
    assert to_obj(rec) == expected
    assert msgpack.unpackb(encode(rec), raw=False) == expected


def test_bin_and_str_stay_distinct():
    data = encode(
        EngineStarted(memstep_version="0.1.0", config={"k": b"\x00\xff"}, model_identity="m")
    )
    assert decode(data).config == {"k": b"\x00\xff"}


def test_int_is_accepted_for_float_and_converted():
    obj = to_obj(SAMPLES[3]) | {"arrival_time": 12}
    rec = from_obj(obj)
    assert type(rec.arrival_time) is float and rec.arrival_time == 12.0


# --- malformations -------------------------------------------------------------------------

VALID = encode(SAMPLES[3])


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "not a msgpack record"),
        (b"\xc1", "not a msgpack record"),  # a byte msgpack never uses
        (VALID[:-1], "not a msgpack record"),
        (VALID + b"\x00", "not a msgpack record"),
        (b"\xa2\xff\xfe", "not a msgpack record"),  # invalid UTF-8 in a str
        (b"\xdd\xff\xff\xff\xff", "not a msgpack record"),  # array claiming 4 G items
        (b"\x91" * 5000 + b"\xc0", "not a msgpack record"),  # nested 5000 deep
        (msgpack.packb([1, 2]), "expected a record map, got list"),
        (msgpack.packb({"step": 1}), "no 't'"),
        (msgpack.packb({"t": "Nope"}), "unknown record type 'Nope'"),
        (msgpack.packb({"t": 7}), "unknown record type 7"),
        (msgpack.packb({"t": [[[[[[7]]]]]]}), r"unknown record type \[\[\[\[\.\.\.\]\]\]\]$"),
        (msgpack.packb({"t": "__init__"}), "unknown record type"),
        (
            msgpack.packb(
                {"t": "PhaseChanged", "step": msgpack.ExtType(5, b"x"), "old": "a", "new": "b"}
            ),
            "holds a value of type ExtType",
        ),
    ],
)
def test_malformed_bytes_raise_codec_error(data, match):
    with pytest.raises(CodecError, match=match):
        decode(data)


FIELDS = [(rec, f.name) for rec in SAMPLES for f in attrs.fields(type(rec))]


def field_id(case: tuple[object, str]) -> str:
    return f"{sample_id(case[0])}.{case[1]}"


@pytest.mark.parametrize("case", FIELDS, ids=field_id)
def test_missing_field_is_named_unless_it_has_a_default(case):
    """A field without a default is refused by name when missing; one with a default (a field
    added since: an older log's record lacks it) takes its default, and the rest are read."""
    rec, field = case
    obj = to_obj(rec)
    del obj[field]
    default = attrs.fields_dict(type(rec))[field].default
    if default is attrs.NOTHING:
        with pytest.raises(CodecError, match=f"{sample_id(rec)}: missing field '{field}'"):
            decode(msgpack.packb(obj))
        return
    got = decode(msgpack.packb(obj))
    want = default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]
    assert got == attrs.evolve(rec, **{field: want})


def test_a_missing_defaulted_field_beside_an_unknown_one_is_refused():
    rec = next(r for r in SAMPLES if type(r).__name__ == "MemoryReport")
    obj = to_obj(rec)
    del obj["grammar_cache_bytes"]
    obj["bogus"] = 1
    with pytest.raises(CodecError, match="MemoryReport: (missing|unexpected) field"):
        decode(msgpack.packb(obj))


@pytest.mark.parametrize("rec", SAMPLES, ids=sample_id)
def test_extra_field_is_named(rec):
    obj = to_obj(rec) | {"bogus": 1}
    with pytest.raises(CodecError, match=f"{sample_id(rec)}: unexpected field 'bogus'"):
        decode(msgpack.packb(obj))


def wrong_value(tp: Any) -> object:
    """A value that the annotation `tp` must refuse."""
    given = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(given) == 1 and type(None) in typing.get_args(tp):
        return wrong_value(given[0])  # X | None refuses what X refuses
    if tp is int:
        return True  # a bool is not an int
    if tp in (float, bool, bytes):
        return "7"
    return 7  # str, lists, dicts and records all refuse an int


@pytest.mark.parametrize("case", FIELDS, ids=field_id)
def test_wrong_type_is_named(case):
    rec, field = case
    obj = to_obj(rec) | {field: wrong_value(typing.get_type_hints(type(rec))[field])}
    with pytest.raises(CodecError, match=rf"{sample_id(rec)}\.{field}: expected"):
        decode(msgpack.packb(obj))


def test_wrong_list_item_is_named_with_its_index():
    obj = to_obj(SAMPLES[3]) | {"prompt_token_ids": [1, 2, True]}
    with pytest.raises(
        CodecError, match=r"RequestAdded\.prompt_token_ids\[2\]: expected int, got bool"
    ):
        from_obj(obj)


def test_wrong_nested_field_names_both_classes():
    obj = to_obj(StateEntered(step=41, kind="spec", bytes_claimed=1, ledger=LEDGER))
    obj["ledger"][1]["nbytes"] = "3 MiB"
    match = r"StateEntered\.ledger\[1\]: LedgerEntry\.nbytes: expected int, got str"
    with pytest.raises(CodecError, match=match):
        from_obj(obj)


def test_nested_record_of_the_wrong_class_is_refused():
    obj = to_obj(SAMPLES[9]) | {"memory": to_obj(LEDGER[0])}
    with pytest.raises(CodecError, match="expected a MemoryReport record, got LedgerEntry"):
        from_obj(obj)


def test_oversized_payload_is_refused_before_unpacking(monkeypatch):
    monkeypatch.setattr(codec, "MAX_RECORD_BYTES", len(VALID) - 1)
    with pytest.raises(CodecError, match="exceeds"):
        decode(VALID)


def nested(depth: int, leaf: Any = 1) -> Any:
    """`leaf` inside `depth` lists, built without recursion."""
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@pytest.mark.parametrize("container", ["list", "map"])
def test_unpack_refuses_nesting_beyond_max_depth(container):
    wrap = (lambda v: [v]) if container == "list" else (lambda v: {"k": v})
    value: Any = 1
    for _ in range(codec.MAX_DEPTH):
        value = wrap(value)
    assert codec.unpack(msgpack.packb(value)) == value  # exactly MAX_DEPTH levels is fine
    with pytest.raises(CodecError, match=f"nested deeper than {codec.MAX_DEPTH} levels"):
        codec.unpack(msgpack.packb(wrap(value)))


def test_deep_value_beside_a_long_flat_list_is_found():
    value = {"tokens": list(range(100_000)), "deep": nested(codec.MAX_DEPTH)}
    with pytest.raises(CodecError, match="nested deeper"):
        codec.unpack(msgpack.packb(value))


def test_unpack_refuses_nesting_deeper_than_msgpack_can_count():
    with pytest.raises(CodecError, match="nested deeper"):
        codec.unpack(b"\x91" * 100_000 + b"\x01")


@pytest.mark.parametrize(
    "value", [msgpack.ExtType(5, b"x"), msgpack.Timestamp(1, 0)], ids=["ext", "timestamp"]
)
def test_unpack_refuses_ext_types_at_any_depth(value):
    for wrapped in (value, nested(5, value), {"a": [1, {"b": value}]}):
        with pytest.raises(CodecError, match=f"value of type {type(value).__name__}"):
            codec.unpack(msgpack.packb(wrapped))


@pytest.mark.parametrize(
    "value",
    [nested(codec.MAX_DEPTH + 1), {"a": [msgpack.Timestamp(1, 0)]}, {"a": msgpack.ExtType(5, b"")}],
    ids=["deep", "timestamp", "ext"],
)
def test_decode_walks_untyped_fields_as_unpack_walks_frames(value):
    """`decode` walks only untyped list and dict fields (the rest is typed): a value there
    nested too deeply or holding an ext type is refused as a whole frame is, and named; the
    same value typed elsewhere fails that field's check."""
    obj = to_obj(SAMPLES[2]) | {"config": {"stop": value}}  # EngineStarted.config: untyped
    with pytest.raises(CodecError, match="value of type|nested deeper") as err:
        decode(msgpack.packb(obj))
    assert "ExtType" in str(err.value) or "EngineStarted.config" in str(err.value)
    obj = to_obj(SAMPLES[3])
    obj["params"]["stop_token_ids"] = [value]
    match = r"RequestAdded.params: SamplingParams.stop_token_ids\[0\]: expected int|ExtType"
    with pytest.raises(CodecError, match=match):
        decode(msgpack.packb(obj))


def test_every_record_fits_within_max_depth():
    assert all(len(schema_depths(cls)) <= codec.MAX_DEPTH for cls in REGISTRY.values())
    assert max(len(schema_depths(cls)) for cls in REGISTRY.values()) >= 4  # nesting counted


def schema_depths(tp: Any, seen: tuple = ()) -> list[None]:
    """One item per container level of the deepest value `tp` can hold (as a list, for len)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if codec._is_record(tp):
        assert tp not in seen, f"{tp.__name__} nests itself"
        hints = typing.get_type_hints(tp).values()
        return [None, *max((schema_depths(h, (*seen, tp)) for h in hints), key=len, default=[])]
    if origin is tuple:
        return [None, *max((schema_depths(a, seen) for a in args if a is not ...), key=len)]
    if tp in (list, dict) or origin in (list, dict):
        return [None, *(schema_depths(args[-1], seen) if args else [])]
    return max((schema_depths(a, seen) for a in args), key=len, default=[])


@pytest.mark.parametrize(
    ("value", "start", "end"),
    [
        (nested(100_000), "[[[[", "]]]]"),  # reprlib's "..." past three levels
        ({"a": {"b": {"c": {"d": 1}}}}, "{'a': {'b': {'c': {...}}}}", ""),
        ("x" * 10_000, "'xxxx", "xxxx'"),
        (b"\xff" * 10_000, "b'\\xff", "\\xff'"),
        ("Nope", "'Nope'", ""),
    ],
    ids=["deep-list", "deep-map", "long-str", "long-bytes", "short"],
)
def test_describe_is_bounded_in_depth_and_length(value, start, end):
    text = codec.describe(value)
    assert len(text) <= 60 and "..." in text or text == repr(value)
    assert text.startswith(start) and text.endswith(end)


def test_encode_refuses_unregistered_and_unpackable_values():
    @attrs.frozen
    class Unregistered:
        step: int

    with pytest.raises(CodecError, match="Unregistered is not a registered record"):
        encode(Unregistered(step=1))
    with pytest.raises(CodecError, match="RequestAborted: cannot encode"):
        encode(RequestAborted(step=2**64, request_id="r"))


# --- annotations no current record uses ----------------------------------------------------


@attrs.frozen
class ProbeInner:
    name: str


@attrs.frozen
class Probe:
    maybe: int | None
    blob: bytes
    flag: bool
    scores: dict[str, float]
    inners: list[ProbeInner]
    inner: ProbeInner | None
    anything: list
    mapping: dict


@attrs.frozen
class Unsupported:
    tags: set[str]


@pytest.fixture
def probes(monkeypatch):
    for cls in (ProbeInner, Probe, Unsupported):
        monkeypatch.setitem(REGISTRY, cls.__name__, cls)


FULL_PROBE = Probe(
    maybe=3,
    blob=b"\x00\x01",
    flag=True,
    scores={"a": 0.5},
    inners=[ProbeInner("x"), ProbeInner("y")],
    inner=ProbeInner("z"),
    anything=[1, "two", [3.0], {"four": None}],
    mapping={"k": [b"v"]},
)


@pytest.mark.parametrize(
    "rec",
    [FULL_PROBE, Probe(None, b"", False, {}, [], None, [], {})],
    ids=["full", "empty"],
)
def test_probe_round_trips(probes, rec):
    assert decode(encode(rec)) == rec


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("maybe", "3", r"Probe\.maybe: expected int, got str"),
        ("blob", "bytes", r"Probe\.blob: expected bytes, got str"),
        ("flag", 1, r"Probe\.flag: expected bool, got int"),
        ("scores", {"a": "high"}, r"Probe\.scores\['a'\]: expected float, got str"),
        ("scores", {b"a": 1.0}, r"Probe\.scores: expected str keys, got bytes"),
        ("inners", [{"t": "ProbeInner"}], r"Probe\.inners\[0\]: ProbeInner: missing field 'name'"),
        ("inner", {"t": "Probe"}, r"Probe\.inner: expected a ProbeInner record, got Probe"),
        ("anything", (1, 2), r"Probe\.anything: expected list, got tuple"),
        ("mapping", [], r"Probe\.mapping: expected dict, got list"),
    ],
)
def test_probe_wrong_values_are_named(probes, field, value, match):
    obj = to_obj(FULL_PROBE) | {field: value}
    with pytest.raises(CodecError, match=match):
        from_obj(obj)


def test_int_is_converted_inside_dict_of_float(probes):
    rec = from_obj(to_obj(FULL_PROBE) | {"scores": {"a": 2}})
    assert type(rec.scores["a"]) is float


def test_unsupported_annotation_is_a_programming_error(probes):
    with pytest.raises(TypeError, match="cannot handle annotation"):
        encode(Unsupported(tags={"a"}))


# --- hostile input -------------------------------------------------------------------------


@given(st.binary(max_size=300))
def test_random_bytes_only_raise_codec_error(data):
    decode_or_codec_error(data)


MUTATIONS = st.tuples(
    st.sampled_from(["flip", "delete", "insert", "truncate"]),
    st.integers(0, 10**6),  # position, wrapped to the payload's length
    st.integers(0, 255),  # the byte inserted, or the mask flipped with
)


def mutate(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, position, byte in ops:
        i = position % (len(buf) + 1)
        if op == "insert":
            buf.insert(i, byte)
        elif op == "truncate":
            del buf[i:]
        elif buf and op == "flip":
            buf[i % len(buf)] ^= byte or 1
        elif buf:
            del buf[i % len(buf)]
    return bytes(buf)


@given(st.sampled_from(SAMPLES), st.lists(MUTATIONS, min_size=1, max_size=4))
def test_mutated_payloads_only_raise_codec_error(rec, ops):
    data = mutate(encode(rec), ops)
    decoded = decode_or_codec_error(data)
    if data == encode(rec):
        assert decoded == rec


@given(
    st.sampled_from(sorted(REGISTRY)).flatmap(
        lambda name: st.fixed_dictionaries(
            {"t": st.just(name)},
            optional={f.name: MSGPACK_VALUES for f in attrs.fields(REGISTRY[name])}
            | {"extra": MSGPACK_VALUES},
        )
    )
)
def test_random_field_values_only_raise_codec_error(obj):
    rec = decode_or_codec_error(msgpack.packb(obj))
    if rec is not None:
        assert from_obj(to_obj(rec)) == rec
