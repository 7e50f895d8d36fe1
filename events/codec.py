"""The one codec for every registered record: msgpack bytes <-> plain maps <-> attrs records.

A record travels as a msgpack map ``{"t": ClassName, <field>: <value>, ...}``; a field typed as
another record (or a list or dict of them) nests the same kind of map, except a list of a row
record (`row_record`: a step's sequences), whose items are arrays of their values in field
order.  Pickle is never used.

Decoding trusts nothing.  Every field is checked against the class annotations (int, float,
str, bool, bytes, ``X | None``, ``list``, ``list[X]``, ``tuple[X, ...]``, ``tuple[X, Y]``,
``dict``, ``dict[str, X]`` and registered records; a tuple travels as an array), and any
malformation raises `CodecError` naming the class and field.  Each class's field spec is
compiled once, on first use, so classes registered later are handled the same way.
Unpacking refuses nesting deeper than MAX_DEPTH and msgpack ext types, and error messages show
an untrusted value only through `describe`, so no input can reach Python's recursion limit.
"""

from __future__ import annotations

import functools
import itertools
import operator
import reprlib
import types
import typing
from collections.abc import Callable
from typing import Any

import attrs
import msgpack

from memstep.events.types import REGISTRY, ROW_RECORDS

MAX_RECORD_BYTES = 64 * 1024 * 1024  # payloads above this are refused before unpacking
MAX_DEPTH = 32  # containers inside containers; the deepest record class needs 5, a request 3
PLAIN_TYPES = frozenset({type(None), bool, int, float, str, bytes, list, dict})

# (value, where) -> checked value; `where` names the field for error messages (None: not
# tracked, see `from_obj`).
Decoder = Callable[[Any, str | None], Any]
# value -> plain msgpack value; None where the value is plain already.
Encoder = Callable[[Any], Any] | None


class CodecError(ValueError):
    """Raised for any input that is not a well-formed registered record."""


@attrs.frozen
class _Spec:
    """What the codec needs to know about one record class, computed once."""

    decoders: tuple[tuple[str, str, Decoder], ...]  # (field, "Class.field", decoder)
    # (field, its exact type, or None and its decoder): the unlocated first pass's
    fast: tuple[tuple[str, type | None, Decoder], ...]
    encoders: tuple[tuple[str, Encoder], ...]
    names: frozenset[str]
    # fields with a default: a record written before the field existed (an older log) lacks them
    # and takes the default; any other missing field, or an unknown one, is refused
    defaulted: frozenset[str]


_SPECS: dict[type, _Spec] = {}

_SHORT_REPR = reprlib.Repr()  # reprlib stops at maxlevel, so deep nesting never recurses far
_SHORT_REPR.maxlevel = 3
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 60


# --- public API ----------------------------------------------------------------------------


def encode(rec: object) -> bytes:
    """Encode a registered record as msgpack bytes."""
    obj = to_obj(rec)
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # e.g. an int beyond 64 bits
        raise CodecError(f"{type(rec).__name__}: cannot encode: {e}") from e


def decode(data: bytes) -> object:
    """Decode msgpack bytes into a registered record; raise CodecError on any malformation.

    The record's fields are checked against its class as `from_obj` does; only the values of
    untyped `list` and `dict` fields are walked by `check_plain` (a 1,000-sequence step plan
    has 3,000 small lists, and walking them all cost more than unpacking them)."""
    if len(data) > MAX_RECORD_BYTES:
        raise CodecError(f"record of {len(data)} bytes exceeds the {MAX_RECORD_BYTES} byte limit")
    try:
        obj = unpack(data, check=False)
    except CodecError as e:
        raise CodecError(f"not a msgpack record: {e}") from e
    return from_obj(obj)


def unpack(data: bytes, check: bool = True) -> Any:
    """Msgpack bytes -> a plain value no deeper than MAX_DEPTH; raise CodecError otherwise.

    Everything after this (validation, error messages, logging) may then walk the value without
    meeting Python's recursion limit, and sees only the msgpack types in PLAIN_TYPES.
    `check=False` leaves the depth and the timestamp type (msgpack's one ext type that
    bypasses the hook) to the caller; other ext types are refused as they are met.
    """
    try:
        # unpackb caps every str/bin/array/map length at len(data) and nesting at 1024 levels.
        obj = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True, ext_hook=_refuse_ext
        )
    except CodecError:
        raise
    except msgpack.StackError as e:
        raise CodecError(f"nested deeper than {MAX_DEPTH} levels") from e
    except Exception as e:  # msgpack raises many kinds on broken input
        raise CodecError(f"{type(e).__name__}: {clip(str(e))}") from e
    if check:
        check_plain(obj)
    return obj


def _refuse_ext(code: int, data: bytes) -> typing.NoReturn:
    raise CodecError("holds a value of type ExtType (msgpack ext types are refused)")


def check_plain(obj: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a value nested deeper than `max_depth` containers, or holding an ext type.

    It walks one level at a time, with lists instead of recursion, and scans each container's
    items at C speed (so a long token list costs one pass).
    """
    level: list[Any] = [[obj]]  # a wrapper, so the root is checked like any item
    for _ in range(max_depth + 1):
        nested: list[Any] = []
        for container in level:
            items = container.values() if type(container) is dict else container
            kinds = set(map(type, items))
            if not kinds <= PLAIN_TYPES:
                odd = next(iter(kinds - PLAIN_TYPES)).__name__
                raise CodecError(f"holds a value of type {odd} (msgpack ext types are refused)")
            if list in kinds or dict in kinds:
                nested.extend(item for item in items if type(item) in (list, dict))
        if not nested:
            return
        level = nested
    raise CodecError(f"nested deeper than {max_depth} levels")


def describe(value: object, limit: int = 60) -> str:
    """A short repr of an untrusted value, for error messages: bounded in depth and length."""
    return clip(_SHORT_REPR.repr(value), limit)


def clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def to_obj(rec: object) -> dict[str, Any]:
    """Turn a registered record into a plain map ``{"t": ClassName, field: value, ...}``."""
    cls = type(rec)
    if REGISTRY.get(cls.__name__) is not cls:
        raise CodecError(f"{cls.__name__} is not a registered record")
    obj: dict[str, Any] = {"t": cls.__name__}
    for name, encoder in _spec(cls).encoders:
        value = getattr(rec, name)
        obj[name] = value if encoder is None else encoder(value)
    return obj


def from_obj(obj: object) -> object:
    """Build a registered record from a plain map, validating every field strictly.

    The first pass tracks no locations (`where` None); a malformed value is decoded again
    with them, so that the error names its class, field and index."""
    try:
        try:
            return _record_from_obj(obj, None, None)
        except CodecError:
            _record_from_obj(obj, "", None)  # raises again, located
            raise
    except RecursionError as e:  # only reachable through self-nesting record classes
        raise CodecError("record nested too deeply") from e


def _at(where: str | None, label: str) -> str | None:
    """A location inside `where`, built only while locating an error."""
    return None if where is None else where + label


# --- decoding ------------------------------------------------------------------------------


def _record_from_obj(obj: Any, where: str | None, expected: type | None) -> object:
    if type(obj) is not dict:
        raise CodecError(f"{where}expected a record map, got {type(obj).__name__}")
    type_name = obj.get("t")
    if type_name is None:
        raise CodecError(f"{where}record map has no 't' (type name) key")
    cls = REGISTRY.get(type_name) if type(type_name) is str else None
    if cls is None:
        raise CodecError(f"{where}unknown record type {describe(type_name)}")
    if expected is not None and cls is not expected:
        raise CodecError(f"{where}expected a {expected.__name__} record, got {type_name}")
    spec = _spec(cls)
    absent: frozenset[str] | set[str] = frozenset()
    if len(obj) != len(spec.names) + 1:
        absent = spec.names - obj.keys()
        if not absent <= spec.defaulted or len(obj) - 1 + len(absent) != len(spec.names):
            _raise_key_mismatch(obj, cls, spec, where)
    kwargs = {}
    try:
        if where is None:  # the first pass: a bad value raises unlocated (see from_obj)
            for name, tp, decoder in spec.fast:
                if name in absent:
                    continue
                value = obj[name]
                if tp is None:
                    value = decoder(value, None)
                elif type(value) is not tp:
                    raise _mismatch(None, tp.__name__, value)
                kwargs[name] = value
        else:
            for name, label, decoder in spec.decoders:
                if name not in absent:
                    kwargs[name] = decoder(obj[name], where + label)
    except KeyError:
        _raise_key_mismatch(obj, cls, spec, where)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a validator on the class refused the values
        raise CodecError(f"{where}{type_name}: {e}") from e


def _raise_key_mismatch(obj: dict, cls: type, spec: _Spec, where: str | None) -> typing.NoReturn:
    missing = sorted(spec.names - obj.keys())
    if missing:
        raise CodecError(f"{where}{cls.__name__}: missing field {describe(missing[0])}")
    extra = [key for key in obj if key != "t" and key not in spec.names]
    raise CodecError(f"{where}{cls.__name__}: unexpected field {describe(extra[0])}")


def _mismatch(where: str | None, expected: str, value: Any) -> CodecError:
    return CodecError(f"{where}: expected {expected}, got {type(value).__name__}")


def _exact(tp: type) -> Decoder:
    def check(value: Any, where: str | None) -> Any:
        if type(value) is not tp:  # `type is`, so a bool is never accepted as an int
            raise _mismatch(where, tp.__name__, value)
        return value

    return check


def _plain(tp: type) -> Decoder:
    """An untyped list or dict: any plain values, nested no deeper than MAX_DEPTH."""

    def check(value: Any, where: str | None) -> Any:
        if type(value) is not tp:
            raise _mismatch(where, tp.__name__, value)
        if not value:  # most are empty (a step plan's params, once a request is admitted)
            return value
        try:
            check_plain(value)
        except CodecError as e:
            raise CodecError(f"{where}: {e}") from e
        return value

    return check


def _float(value: Any, where: str | None) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise _mismatch(where, "float", value)


def _optional(inner: Decoder) -> Decoder:
    def check(value: Any, where: str | None) -> Any:
        return None if value is None else inner(value, where)

    return check


_ITEM_TYPES: dict[Decoder, type] = {}  # each list-of-one-exact-type decoder: its item type


def _list_of_exact(tp: type) -> Decoder:
    allowed = {tp}

    def check(value: Any, where: str | None) -> Any:
        if type(value) is not list:
            raise _mismatch(where, f"list[{tp.__name__}]", value)
        if not set(map(type, value)) <= allowed:  # a C-speed scan of long token lists
            i = next(i for i, item in enumerate(value) if type(item) is not tp)
            raise _mismatch(f"{where}[{i}]", tp.__name__, value[i])
        return value

    _ITEM_TYPES[check] = tp
    return check


def _list_of(inner: Decoder) -> Decoder:
    def check(value: Any, where: str | None) -> Any:
        if type(value) is not list:
            raise _mismatch(where, "list", value)
        if where is None:
            return [inner(item, None) for item in value]
        return [inner(item, f"{where}[{i}]") for i, item in enumerate(value)]

    return check


def _dict_of(inner: Decoder) -> Decoder:
    def check(value: Any, where: str | None) -> Any:
        if type(value) is not dict:
            raise _mismatch(where, "dict", value)
        for key in value:
            if type(key) is not str:
                raise CodecError(f"{where}: expected str keys, got {type(key).__name__}")
        if where is None:
            return {key: inner(item, None) for key, item in value.items()}
        return {key: inner(item, f"{where}[{describe(key)}]") for key, item in value.items()}

    return check


def _rows_of(cls: type) -> Decoder:
    """A list of `cls` records as rows (`row_record`): each a list of its values in field
    order, each value checked as the field's. Unlocated, the exact-typed values of a row are
    checked in one comparison of their types and only the others go through decoders."""

    def check(value: Any, where: str | None) -> Any:
        if type(value) is not list:
            raise _mismatch(where, f"list[{cls.__name__}]", value)
        if where is None:
            rows = _rows_by_column(cls, value)
            if rows is not None:
                return rows
        spec = _spec(cls)
        width = len(spec.fast)
        exact_of, types, decoded = _row_layout(cls)
        out = []
        for i, row in enumerate(value):
            if type(row) not in (list, tuple) or len(row) != width:  # tuple: to_obj's own
                got = describe(row)
                raise CodecError(f"{where}[{i}]: expected a {cls.__name__} row of {width}, {got}")
            if where is None:
                if tuple(map(type, exact_of(row))) != types:
                    raise CodecError("a row value of the wrong type")  # located again
                args = list(row)
                for j, decoder in decoded:
                    args[j] = decoder(args[j], None)
            else:
                at = f"{where}[{i}]: "
                args = [
                    dec(item, at + label)
                    for (_, label, dec), item in zip(spec.decoders, row, strict=True)
                ]
            try:
                out.append(cls(*args))
            except (TypeError, ValueError) as e:
                raise CodecError(f"{where}[{i}]: {cls.__name__}: {e}") from e
        return out

    return check


_ROW_TYPES = frozenset((list, tuple))  # tuple: to_obj's own rows


def _rows_by_column(cls: type, rows: list) -> list | None:
    """The records of `rows` with every column checked at once: the types of a column's values
    in one scan at C speed, and the items of a list[int]-like column in one more, so that a
    thousand-sequence step plan costs a few scans per field instead of a few calls per row; a
    field of another kind goes through its decoder value by value, unless all its values are
    empty. None where any check fails: the row-by-row pass then decodes, and names what it
    finds wrong."""
    columns = _row_columns(cls)
    if not set(map(type, rows)) <= _ROW_TYPES or not set(map(len, rows)) <= {len(columns)}:
        return None
    values: list[typing.Sequence] = list(zip(*rows, strict=True)) or [()] * len(columns)
    decoded = False
    for j, (tp, item_tp, decoder) in enumerate(columns):
        column = values[j]
        if decoder is None:
            if not _all_of(column, tp) or (
                item_tp is not None and not _all_of(itertools.chain(*column), item_tp)
            ):
                return None
        elif tp is object or not _all_of(column, tp) or any(column):
            try:
                values[j] = [decoder(value, None) for value in column]
            except CodecError:
                return None
            decoded = True
        # else all empty (a step's logprobs, its params after admission): nothing to check
    try:
        return list(itertools.starmap(cls, zip(*values, strict=True) if decoded else rows))
    except (TypeError, ValueError):
        return None


def _all_of(values: typing.Iterable, tp: type) -> bool:
    """Whether every value is exactly of type `tp` (a bool is not an int), at C speed."""
    return set(map(type, values)) <= {tp}


@functools.cache
def _row_columns(cls: type) -> tuple[tuple[type, type | None, Decoder | None], ...]:
    """Per field of a row of `cls`: (its exact type, None, None), (list, the exact type of its
    items, None), (list or dict, None, its decoder) for another list or dict field (whose
    empty values need no decoder), or (object, None, its decoder)."""
    hints = typing.get_type_hints(cls)
    columns: list[tuple[type, type | None, Decoder | None]] = []
    for name, tp, decoder in _spec(cls).fast:
        container = typing.get_origin(hints[name]) or hints[name]
        if tp is not None:
            columns.append((tp, None, None))
        elif decoder in _ITEM_TYPES:
            columns.append((list, _ITEM_TYPES[decoder], None))
        elif container in (list, dict):
            columns.append((container, None, decoder))
        else:
            columns.append((object, None, decoder))
    return tuple(columns)


@functools.cache
def _row_layout(cls: type) -> tuple[Callable[[Any], tuple], tuple[type, ...], list]:
    """For a row of `cls`: a getter of its exact-typed values (a tuple), their types, and the
    (index, decoder) of the others; computed once per class."""
    fast = _spec(cls).fast
    exact = [i for i, (_, tp, _) in enumerate(fast) if tp is not None]
    types = tuple(tp for _, tp, _ in fast if tp is not None)
    getter: Callable[[Any], tuple]
    if len(exact) > 1:
        getter = operator.itemgetter(*exact)
    else:  # an itemgetter of one index returns the value, not a tuple
        getter = lambda row: tuple(row[i] for i in exact)  # noqa: E731
    return getter, types, [(i, dec) for i, (_, tp, dec) in enumerate(fast) if tp is None]


def _tuple_of(inner: Decoder) -> Decoder:
    """`tuple[X, ...]`: a msgpack array whose items decode as X's, as a tuple."""

    def check(value: Any, where: str | None) -> Any:
        return tuple(inner(value, where))

    return check


def _fixed_tuple(inners: tuple[Decoder, ...]) -> Decoder:
    """`tuple[X, Y]`: an array of exactly that many items, each decoded as its own type."""

    def check(value: Any, where: str | None) -> Any:
        if type(value) is not list or len(value) != len(inners):
            raise _mismatch(where, f"an array of {len(inners)}", value)
        return tuple(inner(item, where) for inner, item in zip(inners, value, strict=True))

    return check


def _nested(cls: type) -> Decoder:
    def check(value: Any, where: str | None) -> Any:
        return _record_from_obj(value, _at(where, ": "), cls)

    return check


_EXACT_TYPES = (int, str, bool, bytes)
_DECODERS: dict[Any, Decoder] = {tp: _exact(tp) for tp in _EXACT_TYPES}
_DECODERS |= {list: _plain(list), dict: _plain(dict)}
_DECODERS[float] = _float


def _decoder(tp: Any) -> Decoder:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _DECODERS:
        return _DECODERS[tp]
    if _is_optional(origin, args):
        return _optional(_decoder(_not_none(args)))
    if origin is list and args[0] in _EXACT_TYPES:
        return _list_of_exact(args[0])
    if origin is list and args[0] in ROW_RECORDS:
        return _rows_of(args[0])
    if origin is list:
        return _list_of(_decoder(args[0]))
    if origin is dict and args[0] is str:
        return _dict_of(_decoder(args[1]))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _tuple_of(_decoder(list[args[0]]))  # type: ignore[valid-type]
    if origin is tuple:
        return _fixed_tuple(tuple(map(_decoder, args)))
    if _is_record(tp):
        return _nested(tp)
    raise TypeError(f"the record codec cannot handle annotation {tp!r}")


# --- encoding ------------------------------------------------------------------------------


def _encoder(tp: Any) -> Encoder:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_record(tp):
        return to_obj
    if origin is list and args[0] in ROW_RECORDS:
        return _rows_encoder(args[0])
    if origin is tuple:
        return _as_lists
    if _is_optional(origin, args):
        return _map_encoder(_encoder(_not_none(args)), lambda f, v: None if v is None else f(v))
    if origin is list:
        return _map_encoder(_encoder(args[0]), lambda f, v: [f(x) for x in v])
    if origin is dict:
        return _map_encoder(_encoder(args[1]), lambda f, v: {k: f(x) for k, x in v.items()})
    return None


def _as_lists(value: tuple) -> list:
    """A tuple of plain values (or of tuples of them) as the lists msgpack and `from_obj` take."""
    return [_as_lists(item) if type(item) is tuple else item for item in value]


def _rows_encoder(cls: type) -> Encoder:
    """A list of `cls` records as rows: tuples of their values in field order (msgpack writes
    arrays). Its fields must be plain: a row holds no record."""
    names = tuple(field.name for field in attrs.fields(cls))
    hints = typing.get_type_hints(cls)
    if any(_encoder(hints[n]) is not None for n in names) or len(names) < 2:
        raise TypeError(f"{cls.__name__}: a row record needs two or more plain fields")
    values = operator.attrgetter(*names)
    return lambda rows: [values(row) for row in rows]


def _map_encoder(inner: Encoder, apply: Callable[[Callable[[Any], Any], Any], Any]) -> Encoder:
    """Lift the encoder of an element to its container; None stays None (nothing to encode)."""
    if inner is None:
        return None
    return lambda value: apply(inner, value)


# --- specs ---------------------------------------------------------------------------------


def _spec(cls: type) -> _Spec:
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = _build_spec(cls)
    return spec


def _build_spec(cls: type) -> _Spec:
    hints = typing.get_type_hints(cls)  # resolves the string annotations
    names = [field.name for field in attrs.fields(cls)]
    if "t" in names:
        raise TypeError(f"{cls.__name__}: a record field may not be named 't'")
    decoders = tuple((n, f"{cls.__name__}.{n}", _decoder(hints[n])) for n in names)
    exact = [hints[n] if hints[n] in _EXACT_TYPES else None for n in names]
    return _Spec(
        decoders=decoders,
        fast=tuple((n, tp, dec) for (n, _, dec), tp in zip(decoders, exact, strict=True)),
        encoders=tuple((n, _encoder(hints[n])) for n in names),
        names=frozenset(names),
        defaulted=frozenset(f.name for f in attrs.fields(cls) if f.default is not attrs.NOTHING),
    )


def _is_record(tp: Any) -> bool:
    return isinstance(tp, type) and REGISTRY.get(tp.__name__) is tp


def _is_optional(origin: Any, args: tuple[Any, ...]) -> bool:
    is_union = origin is types.UnionType or origin is typing.Union
    return is_union and len(args) == 2 and type(None) in args


def _not_none(args: tuple[Any, ...]) -> Any:
    return args[0] if args[1] is type(None) else args[1]
