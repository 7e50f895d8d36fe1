"""The worker and what one step needs: plan -> batch -> forward -> sample -> reply; the memory
plan, meter and leak detector; per-request state; the prompt tokens' scores.
"""
