"""The fuzzers' shared budget: PAGEDSERVE_FUZZ_EXAMPLES cases a target (the suite's short
run by default; `make faults` runs the full one)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
