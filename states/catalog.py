"""Every step kind by name (the start-up phases that own buffers, and the serving kinds), and
the kinds one engine runs: a planted leak, where the config asks for one, stands in for the kind
it imitates."""

from __future__ import annotations

from memstep.states.kinds import KindEnv, NoSpec, Spec, StepKind
from memstep.states.planted import PLANTS
from memstep.states.startup import Capture, Warmup

KINDS: dict[str, type[StepKind]] = {
    "warmup": Warmup,
    "capture": Capture,
    "no_spec": NoSpec,
    "spec": Spec,
}


def make_kinds(env: KindEnv) -> dict[str, StepKind]:
    kinds: dict[str, StepKind] = {name: cls(env) for name, cls in KINDS.items()}
    plant = env.cfg.debug_plant_leak
    if plant is not None:
        kind_name, make = PLANTS[plant]
        kinds[kind_name] = make(env, kinds)
    return kinds
