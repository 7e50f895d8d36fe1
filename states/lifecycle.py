"""The state machine as one object: the current state, the table check, the kinds and their
arena, and the check that an exit hook really let go of what it released.

The executor owns the one `Lifecycle`; the engine core learns of every move from the records a
move returns (they travel in the step and phase replies), never keeps a copy of its own.
"""

from __future__ import annotations

import gc

import attrs
import torch

from memstep.events.types import LeakSuspected, StateEntered, StateExited
from memstep.states import table
from memstep.states.arena import Arena, tensor_bytes
from memstep.states.kinds import StepKind


@attrs.frozen
class Move:
    """What one move did: the exit hook of the old state, the enter hook of the new, and any
    buffer the exit hook released but something still holds."""

    exited: list[StateExited]
    entered: list[StateEntered]
    leaks: list[LeakSuspected]


STAY = Move([], [], [])


class Lifecycle:
    def __init__(self) -> None:
        self.state = "boot"
        self.kinds: dict[str, StepKind] = {}
        self.arena: Arena | None = None

    def install(self, kinds: dict[str, StepKind], arena: Arena) -> None:
        """The kinds and the arena they claim from, once the profile has sized it."""
        self.kinds, self.arena = kinds, arena

    @property
    def claimed_bytes(self) -> int:
        return 0 if self.arena is None else self.arena.claimed_bytes

    def move(self, target: str, step: int) -> Move:
        """Go to `target` (a phase or a kind), running the hooks; raises `TransitionNotAllowed`
        for a move the table does not list."""
        source = self.state
        table.check(source, target)
        if source == target:
            return STAY
        exited, leaks = self._exit(source, step)
        self.state = target
        return Move(exited, self._enter(target, step), leaks)

    def _exit(self, source: str, step: int) -> tuple[list[StateExited], list[LeakSuspected]]:
        if source not in self.kinds or self.arena is None:
            return [], []
        released = self.kinds[source].exit(self.arena, step)
        gc.collect()  # a reference cycle must not pass for a leak; a live reference does
        exited = [StateExited(step, source, released, self.arena.ledger())]
        leaks = [
            LeakSuspected(step, source, "held_after_exit", 0, f"{owner}.{name} still referenced")
            for owner, name in self.arena.check_released()
        ]
        return exited, leaks

    def holdings(self) -> dict[str, tuple[int, int, str]]:
        """What each kind keeps outside its arena buffers: per attribute holding tensors (in
        lists, tuples or dicts too), their count, bytes and shapes ("[4, 576] float32")."""
        out: dict[str, tuple[int, int, str]] = {}
        for kind in self.kinds.values():
            for attr, value in vars(kind).items():
                if attr not in ("held", "env"):
                    out |= held_by(f"{kind.name}.{attr}", value)
        return out

    def _enter(self, target: str, step: int) -> list[StateEntered]:
        if target not in self.kinds or self.arena is None:
            return []
        claimed = self.kinds[target].enter(self.arena, step)
        return [StateEntered(step, target, claimed, self.arena.ledger())]


def held_by(path: str, value: object) -> dict[str, tuple[int, int, str]]:
    """`path`'s entry in `holdings()`: the count, bytes and shapes of the tensors `value` holds
    (in lists, tuples or dicts too); nothing where it holds none."""
    tensors = _tensors_in(value)
    if not tensors:
        return {}
    shapes = sorted({f"{list(t.shape)} {str(t.dtype)[6:]}" for t in tensors})
    return {path: (len(tensors), tensor_bytes(tensors), ", ".join(shapes))}


def _tensors_in(value: object, depth: int = 3) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors_in(item, depth - 1)]
    return []


def growth_of(before: dict, after: dict) -> str:
    """The holdings that grew between two `holdings()`, as a leak report names them."""
    grew = []
    for path, (count, nbytes, shapes) in after.items():
        count0, nbytes0, _ = before.get(path, (0, 0, ""))
        if nbytes > nbytes0:
            grew.append(f"{path} +{count - count0} tensors {shapes} ({nbytes - nbytes0:+,} B)")
    return "; ".join(grew) or "held by no step kind"
