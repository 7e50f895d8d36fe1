"""Per-request sampling parameters, as the core and users import them.

The record lives in events/sampling_params.py, the ground floor, because it crosses every seam as
itself: the engine logs it in `RequestAdded`, sends it in an admission's plan (`Admission`), and
the executor samples with it.
"""

from memstep.events.sampling_params import DEFAULT_TEMPERATURE, InvalidRequest, SamplingParams

__all__ = ["DEFAULT_TEMPERATURE", "InvalidRequest", "SamplingParams"]
