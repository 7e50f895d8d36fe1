"""memstep: an LLM serving engine built as a step state machine with a replayable event log."""

__version__ = "0.1.0"
