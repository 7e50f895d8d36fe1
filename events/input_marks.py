"""The marks that keep a log's inputs in their recorded order (log format 3 on).

A replay feeds a log's inputs back to a fresh engine, so an input copied, moved or taken out of a
log replays a different run, and may still report it "identical" (a second `RequestAdded` of an
id in flight is refused by the engine and passed over).  So the writer puts an `InputMark`
before each input record: the input's place among the log's inputs (0, 1, 2, ...) and the CRC of
its bytes.  The reader checks that every input follows its mark, that the marks count up by one
and that each CRC is that of the input after it, and refuses the log otherwise
(`InputOrderError`).  Damage (a torn or corrupt stretch, a `RecordsLost` gap) may take marks or
inputs with it: after it the count may jump ahead, never back.  The marks are the log's own:
the reader takes them out, so no one else sees them.
"""

from __future__ import annotations

import zlib

from memstep.events.types import InputMark, RecordsLost, is_input

INPUT_MARKS_SINCE = 3  # the log format that first holds them


class InputOrderError(ValueError):
    """A log's inputs are not the ones recorded, in the order recorded."""


class InputCounter:
    """The writer's count of the inputs it appended; each input's mark."""

    def __init__(self) -> None:
        self.num_inputs = 0
        self.num_flushed = 0  # inputs handed to the OS: a discard goes back to it

    def mark(self, payload: bytes) -> InputMark:
        self.num_inputs += 1
        return InputMark(self.num_inputs - 1, zlib.crc32(payload))


class InputChecker:
    """The reader's check of each record against the marks before it (`take`)."""

    def __init__(self, first_seq: int | None = 0):
        self.next_seq = first_seq  # None: take the first mark's (a part read on its own)
        self.pending: InputMark | None = None
        self.damaged = False  # damage since the last mark: marks or inputs may be gone

    def take(self, rec: object, payload: bytes, offset: int) -> bool:
        """Whether `rec` (read at `offset`) is a record for the reader's caller; False for a mark.
        Raises InputOrderError when the inputs are not as recorded."""
        if isinstance(rec, InputMark):
            self._mark(rec, offset)
            return False
        if is_input(rec):
            self._input(rec, payload, offset)
        elif self.pending is not None and not self.damaged:
            raise InputOrderError(
                f"input {self.pending.seq}'s mark at byte {offset} is followed by"
                f" a {type(rec).__name__}, not by its input: an input was taken"
                " out of the log"
            )
        if isinstance(rec, RecordsLost):
            self.lost()
        return True

    def lost(self) -> None:
        """Records were lost here (damage, or a writer's gap)."""
        self.damaged, self.pending = True, None

    def _mark(self, mark: InputMark, offset: int) -> None:
        expected = self.next_seq if self.next_seq is not None else mark.seq
        if self.pending is not None and not self.damaged:
            raise InputOrderError(
                f"input {self.pending.seq}'s mark has no input after it (next "
                f"comes the mark of input {mark.seq}, at byte {offset})"
            )
        if mark.seq < expected:
            raise InputOrderError(
                f"input {mark.seq} comes again at byte {offset}, after input "
                f"{expected - 1}: the log's inputs are duplicated or out of "
                "order"
            )
        if mark.seq > expected and not self.damaged:
            raise InputOrderError(
                f"input {mark.seq} comes at byte {offset} where input {expected} is due: "
                "the log's inputs are out of order, or some were taken out"
            )
        self.pending, self.damaged, self.next_seq = mark, False, mark.seq + 1

    def _input(self, rec: object, payload: bytes, offset: int) -> None:
        name = f"{type(rec).__name__} {getattr(rec, 'request_id', '')}".strip()
        mark, self.pending = self.pending, None
        if mark is None:
            if self.damaged:  # its mark was in the damaged stretch
                return
            raise InputOrderError(
                f"the {name} at byte {offset} has no input mark before it: an "
                "input copied or added after recording"
            )
        if zlib.crc32(payload) != mark.crc:
            raise InputOrderError(
                f"the {name} at byte {offset} is not input {mark.seq} as "
                "recorded: the log's inputs were reordered or changed"
            )
