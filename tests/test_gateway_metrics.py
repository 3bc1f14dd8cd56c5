"""The gateway's metrics (services/gateway/metrics.py): observe_many against prometheus_client's own
observe, called n times (on a histogram and on one model's child of a labelled one); and, against the
scripted pipeline on a real nats-server, every metric carries the model a request reached
(model_name): N completions give N counted requests and N latencies under the workers' model, a request
for a model nobody serves is counted under the name it asked for, and the in-flight, migration and
live-worker series are per model."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram

from services.gateway.metrics import observe_many
from shared.metrics import INTER_TOKEN_LATENCY_BUCKETS
from shared.natsd import NatsServer
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, GatewayThread, wait_for_workers
from tests.services_helpers import metric_value

PREFIX = "gwmetrics"


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


def test_observe_many_on_one_models_series_equals_observe() -> None:
    fast, slow = CollectorRegistry(), CollectorRegistry()
    h_fast = Histogram("itl", "x", ["model_name"], buckets=INTER_TOKEN_LATENCY_BUCKETS, registry=fast)
    h_slow = Histogram("itl", "x", ["model_name"], buckets=INTER_TOKEN_LATENCY_BUCKETS, registry=slow)
    observe_many(h_fast.labels("m"), 0.03, 5)
    for _ in range(5):
        h_slow.labels("m").observe(0.03)
    assert samples(fast) == samples(slow)
    assert samples(fast)[("itl_count", (("model_name", "m"),))] == 5


@pytest.fixture(scope="module")
def pipeline(nats: NatsServer) -> Iterator[FakePipeline]:
    fake = FakePipeline(nats.url, workers=("w1", "w2"), prefix=PREFIX)
    yield fake
    fake.close()


def test_requests_latencies_and_gauges_are_labelled_with_the_model(nats: NatsServer, pipeline: FakePipeline) -> None:
    gw = GatewayThread(nats.url, subject_prefix=PREFIX)
    try:
        wait_for_workers(gw.url, 2)
        completions = 0
        for body in ({"model": FAKE_MODEL, "prompt": "one two", "max_tokens": 8},
                     {"model": FAKE_MODEL, "prompt": "three four five", "max_tokens": 8},
                     {"prompt": "six", "max_tokens": 8}):  # names no model: routed to the one served
            answer = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=10)
            assert answer.status_code == 200, answer.text
            completions += answer.json()["usage"]["completion_tokens"]
        unknown = httpx.post(f"{gw.url}/v1/completions", json={"model": "no-such-model", "prompt": "x"}, timeout=10)
        assert unknown.status_code == 404, unknown.text
        text = httpx.get(f"{gw.url}/metrics", timeout=5).text
        live = f'rs_gateway_live_workers{{model_name="{FAKE_MODEL}"}} 2.0'
        deadline = time.monotonic() + 10  # the liveness watchdog sets it on its next tick
        while live not in text and time.monotonic() < deadline:
            time.sleep(0.1)
            text = httpx.get(f"{gw.url}/metrics", timeout=5).text
    finally:
        gw.close()
    model = f'model_name="{FAKE_MODEL}"'
    assert metric_value(text, "rs_gateway_requests_total", f'endpoint="/v1/completions",{model},status="200"') == 3
    assert metric_value(
        text, "rs_gateway_requests_total", 'endpoint="/v1/completions",model_name="no-such-model",status="404"'
    ) == 1
    assert metric_value(text, "rs_gateway_e2e_request_latency_seconds_count", model) == 3
    assert metric_value(text, "rs_gateway_time_to_first_token_seconds_count", model) == 3
    assert metric_value(text, "rs_gateway_generation_tokens_total", model) == completions > 0
    assert metric_value(text, "rs_gateway_requests_in_flight", model) == 0
    assert metric_value(text, "rs_gateway_live_workers", model) == 2
    assert metric_value(text, "rs_gateway_migrations_total", model) == 0  # there from the first live worker
    # Nothing is counted under a model no request reached.
    assert 'rs_gateway_e2e_request_latency_seconds_count{model_name="no-such-model"}' not in text
