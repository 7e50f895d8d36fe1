"""memstep: an LLM serving engine built as a step state machine with a replayable event log.

`from memstep import LLM, SamplingParams` is the offline API (`api/llm.py`).  It is loaded on
first use, so that `import memstep.<folder>` (the HTTP front, the clients) never pulls in torch.
"""

from typing import Any

from memstep.events.version import VERSION as __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "SamplingParams"):
        from memstep.api import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'memstep' has no attribute {name!r}")
