"""The state machine as one object: the current state, the table check, the kinds and their
arena, and the check that an exit hook really let go of what it released.

The executor owns the one `Lifecycle`; the engine core learns of every move from the records a
move returns (they travel in the step and phase replies), never keeps a copy of its own.
"""

from __future__ import annotations

import gc

import attrs

from memstep.events.types import LeakSuspected, StateEntered, StateExited
from memstep.states import table
from memstep.states.arena import Arena
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

    def _enter(self, target: str, step: int) -> list[StateEntered]:
        if target not in self.kinds or self.arena is None:
            return []
        claimed = self.kinds[target].enter(self.arena, step)
        return [StateEntered(step, target, claimed, self.arena.ledger())]
