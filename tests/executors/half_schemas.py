"""Traffic where the odd requests carry a JSON schema, and the check of its constrained texts:
for the memory tests of constrained steps on the CPU (test_structured_memory.py) and on the GPU
(test_gpu.py)."""

from __future__ import annotations

import json

import jsonschema

from memstep.core.sampling_params import SamplingParams


def half_schemas(num: int, schema: dict, max_tokens: int) -> tuple[list[str], list]:
    """(prompts, params) of `num` seeded requests at temperature 1, the odd ones with `schema`."""
    text = json.dumps(schema)
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, guided_json=text * (i % 2))
        for i in range(num)
    ]
    return [f"Request {i}: JSON as asked." for i in range(num)], params


def check_constrained(done: list, schema: dict) -> None:
    """Each odd completion ended by its grammar ("stop") with a text that validates."""
    for completion in done[1::2]:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
