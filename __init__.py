"""memstep: an LLM serving engine built as a step state machine with a replayable event log."""

from memstep.events.version import VERSION as __version__

__all__ = ["__version__"]
