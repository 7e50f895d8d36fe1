"""The CUDA caching allocator's configuration, set before the executor allocates anything.

memstep asks for expandable segments: one segment per stream that grows by mapping more pages,
instead of a new fixed-size segment for every request size the cache cannot serve.  Serving
allocates short-lived tensors of sizes that change with the batch (eager prefill and mixed
steps); with fixed segments each new size could take a new segment and keep it cached, so
reserved memory crept up past the memory plan under real traffic (the seed's incident, measured
again in issue 15), while expandable segments kept it flat.  The memory plan counts allocated
bytes; with expandable segments reserved stays within a page (2 MiB) rounding of that per
segment, so the plan's predicted peak is also the reserved bytes it allows.

With expandable segments torch counts no segments (`segment.all.current` stays 0:
docs/benchmarks.md, "Figures behind the code's constants"), so reserved bytes are the figure
that shows growth; the leak detector and the benchmarks' memory verdict watch both.  A user's
own PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) wins and is left as it is.
"""

from __future__ import annotations

import os

ALLOC_CONF = "expandable_segments:True"
ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def user_alloc_conf() -> str | None:
    return next((os.environ[n] for n in ENV_NAMES if os.environ.get(n)), None)


def configure_cuda_allocator() -> str:
    """Apply `ALLOC_CONF` unless the user set one; the configuration in force.  Call before the
    first CUDA allocation: segments the allocator already holds (an engine made earlier in the
    same process) keep the configuration they were made with."""
    own = user_alloc_conf()
    if own is not None:
        return own
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF  # for a process that has not started CUDA
    import torch

    # and for a process that has: torch 2.11 moved the setter (the old one warns)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (setter or torch.cuda.memory._set_allocator_settings)(ALLOC_CONF)
    return ALLOC_CONF
