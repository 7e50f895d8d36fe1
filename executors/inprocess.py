"""The executor in the engine's own process: the same worker and the same message codec as the
process executor, minus the socket.  Used by tests, replay and `generate`."""

from __future__ import annotations

from memstep.core.config import EngineConfig
from memstep.events import codec
from memstep.events.plan import PhaseReply, StepPlan, StepResult
from memstep.executors.worker import Worker


class InProcessExecutor:
    def __init__(self, cfg: EngineConfig, max_model_len: int):
        self.worker = Worker(cfg, max_model_len)

    def enter_phase(self, phase: str, step: int) -> PhaseReply:
        reply = self.worker.enter_phase(phase, step)
        return codec.decode(codec.encode(reply))

    def execute(self, plan: StepPlan) -> StepResult:
        # every message crosses the codec, as it would cross the socket
        result = self.worker.execute(codec.decode(codec.encode(plan)))
        return codec.decode(codec.encode(result))

    def close(self) -> None:
        pass
