"""observe_many (services/gateway/metrics.py) against prometheus_client's own observe, called n times."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram

from services.gateway.metrics import observe_many
from shared.metrics import INTER_TOKEN_LATENCY_BUCKETS


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize("observations", [[(0.0004, 127)], [(0.02, 1), (0.5, 3), (1e9, 2), (0.003, 0), (0.007, 64)]])
def test_observe_many_equals_observe_called_that_many_times(observations: list[tuple[float, int]]) -> None:
    fast, slow = CollectorRegistry(), CollectorRegistry()
    h_fast = Histogram("itl", "x", buckets=INTER_TOKEN_LATENCY_BUCKETS, registry=fast)
    h_slow = Histogram("itl", "x", buckets=INTER_TOKEN_LATENCY_BUCKETS, registry=slow)
    for value, count in observations:
        observe_many(h_fast, value, count)
        for _ in range(count):
            h_slow.observe(value)
    got, want = samples(fast), samples(slow)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key[0] == "itl_sum":
            assert math.isclose(got[key], value, rel_tol=1e-12)
        else:
            assert got[key] == value, key
    assert want[("itl_count", ())] == sum(count for _, count in observations)
