"""The gateway's metrics carry the model a request reached (model_name), against the scripted
pipeline on a real nats-server: N completions give N counted requests and N latencies under the
workers' model, a request for a model nobody serves is counted under the name it asked for, and the
in-flight and live-worker gauges are per model."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from shared.natsd import NatsServer
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, GatewayThread, wait_for_workers
from tests.services_helpers import metric_value

PREFIX = "gwmetrics"


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
