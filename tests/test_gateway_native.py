"""The gateway's SGLang-style native API (/generate and the operational routes) against a scripted
pipeline (tests/gateway_helpers.FakePipeline) on a real nats-server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from shared.natsd import NatsServer
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, GatewayThread, wait_for_workers


@pytest.fixture(scope="module")
def pipeline(nats: NatsServer) -> Iterator[FakePipeline]:
    fake = FakePipeline(nats.url, workers=("w1", "w2"))
    yield fake
    fake.close()


@pytest.fixture(scope="module")
def gateway(nats: NatsServer, pipeline: FakePipeline) -> Iterator[GatewayThread]:
    gw = GatewayThread(nats.url)
    wait_for_workers(gw.url, 2)
    yield gw
    gw.close()


@pytest.fixture(scope="module")
def http(gateway: GatewayThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=15) as client:
        yield client


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.text.split("\n\n") if line.startswith("data: ")]


def test_generate_answers_in_sglang_shape(http: httpx.Client, pipeline: FakePipeline) -> None:
    body = {"text": "one two", "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "rid": "native-1"}
    response = http.post("/generate", json=body)
    out = response.json()
    assert out["text"] == "one two "
    assert out["output_ids"] == [100, 101]
    meta = out["meta_info"]
    assert meta["id"] == "native-1"
    assert meta["finish_reason"] == {"type": "stop"}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (2, 2, 0)
    sent = next(r for r in pipeline.requests if r.rid == "native-1")
    assert (sent.text, sent.sampling.max_new_tokens, sent.sampling.temperature) == ("one two", 8, 0.0)
    assert response.headers["x-radixserve-worker"] == sent.worker_id


def test_generate_passes_logit_bias_as_token_ids(http: httpx.Client, pipeline: FakePipeline) -> None:
    body = {"text": "one", "sampling_params": {"logit_bias": {"11": -100, "12": 0.5}}, "rid": "native-bias"}
    assert http.post("/generate", json=body).status_code == 200
    assert next(r for r in pipeline.requests if r.rid == "native-bias").sampling.logit_bias == {11: -100.0, 12: 0.5}
    bad = http.post("/generate", json={"text": "one", "sampling_params": {"logit_bias": {"x1": 1}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_generate_passes_grammars_with_a_schema_object_as_json_text(http: httpx.Client, pipeline: FakePipeline) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}}}
    for rid, params, field, value in (
        ("g-schema-obj", {"json_schema": schema}, "json_schema", json.dumps(schema)),
        ("g-schema-text", {"json_schema": '{"type": "object"}'}, "json_schema", '{"type": "object"}'),
        ("g-regex", {"regex": "a|b"}, "regex", "a|b"),
        ("g-ebnf", {"ebnf": 'root ::= "a"'}, "ebnf", 'root ::= "a"'),
    ):
        assert http.post("/generate", json={"text": "one", "sampling_params": params, "rid": rid}).status_code == 200
        assert getattr(next(r for r in pipeline.requests if r.rid == rid).sampling, field) == value
    for params, message in (({"regex": "("}, "regex cannot be compiled"),
                            ({"json_schema": "{", "regex": "a"}, "json_schema and regex cannot be combined")):
        bad = http.post("/generate", json={"text": "one", "sampling_params": params})
        assert bad.status_code == 400 and message in bad.json()["error"]["message"]
        assert bad.json()["error"]["param"] == next(iter(params))


def test_generate_from_input_ids_with_logprobs(http: httpx.Client) -> None:
    body = {"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 2}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.1, 100, None], [-0.2, 101, None]]
    assert meta["output_top_logprobs"][0] == [[-0.1, 0, None], [-0.2, 1, None]]


def test_generate_a_batch_returns_a_list(http: httpx.Client) -> None:
    out = http.post("/generate", json={"text": ["a", "b c"], "sampling_params": {"n": 2}}).json()
    assert [o["text"] for o in out] == ["a ", "a ", "b c ", "b c "]


def test_generate_stream_sends_the_text_so_far(http: httpx.Client) -> None:
    response = http.post("/generate", json={"text": "x y z", "stream": True})
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["text"] for c in chunks] == ["x ", "x y ", "x y z ", "x y z "]
    assert [c["meta_info"]["finish_reason"] for c in chunks] == [None, None, None, {"type": "stop"}]
    assert chunks[-1]["output_ids"] == [100, 101, 102]


def test_requests_spread_over_the_least_loaded_workers(http: httpx.Client, pipeline: FakePipeline) -> None:
    # Start from what routing sees as idle: no request left on either fake worker by an earlier test,
    # and a load report saying so from each (a report still counting one would tilt the split).
    pipeline.wait_until(lambda: not pipeline.in_flight("w1") and not pipeline.in_flight("w2"))
    pipeline.wait_until(lambda: all(
        w["load"]["num_running"] == w["load"]["num_waiting"] == 0 for w in http.get("/get_server_info").json()["workers"]))
    before = len(pipeline.requests)
    out = http.post("/generate", json={"text": ["w"] * 6}).json()
    assert len(out) == 6
    workers = [r.worker_id for r in pipeline.requests[before:]]
    assert sorted(workers) == ["w1"] * 3 + ["w2"] * 3


def test_health_and_health_generate(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok", "workers": 2}
    out = http.get("/health_generate")
    assert out.status_code == 200
    assert out.json()["output_ids"] == [100]


def test_ready_is_200_only_while_a_live_worker_serves_the_model(http: httpx.Client) -> None:
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ok", "workers": 2, "models": [FAKE_MODEL]}
    assert http.get("/ready", params={"model": FAKE_MODEL}).status_code == 200
    other = http.get("/ready", params={"model": "no-such-model"})
    assert other.status_code == 503 and other.json() == {"status": "no live worker serving 'no-such-model' yet", "workers": 0}


def test_model_info_lists_the_model_and_its_workers(http: httpx.Client) -> None:
    info = http.get("/get_model_info").json()
    assert info["model_path"] == FAKE_MODEL
    assert info["is_generation"] is True
    assert info["models"] == [{"model_path": FAKE_MODEL, "context_len": 64, "max_total_tokens": 1000, "workers": ["w1", "w2"]}]


def test_server_info_shows_each_workers_info(http: httpx.Client, gateway: GatewayThread) -> None:
    info = http.get("/get_server_info").json()
    assert info["gateway_id"] == gateway.config.gateway_id
    assert [w["worker_id"] for w in info["workers"]] == ["w1", "w2"]
    assert all(w["ok"] and w["info"]["kv_free"] == 1000 and w["load"]["model"] == FAKE_MODEL for w in info["workers"])


def test_flush_cache_asks_every_worker_and_reports_refusal(http: httpx.Client, pipeline: FakePipeline) -> None:
    assert http.post("/flush_cache").status_code == 200
    pipeline.refuse_flush = True
    try:
        refused = http.post("/flush_cache")
    finally:
        pipeline.refuse_flush = False
    assert refused.status_code == 400
    assert refused.json()["success"] is False


def test_abort_request_ends_a_running_request_with_abort(http: httpx.Client, gateway: GatewayThread, pipeline: FakePipeline) -> None:
    with httpx.Client(base_url=gateway.url, timeout=15) as other:
        with other.stream("POST", "/generate", json={"text": "HANG on", "rid": "to-abort", "stream": True}) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["text"] == "HANG "
            assert http.post("/abort_request", json={"rid": "to-abort"}).json()["in_flight_here"] == 1
            rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert json.loads(rest[-2])["meta_info"]["finish_reason"]["type"] == "abort"
    assert rest[-1] == "[DONE]"
    assert any(rid == "to-abort" for _, rid in pipeline.aborts)


def test_metrics_count_requests_and_tokens(http: httpx.Client) -> None:
    http.post("/generate", json={"text": "m n"})
    text = http.get("/metrics").text
    assert f'rs_gateway_requests_total{{endpoint="/generate",model_name="{FAKE_MODEL}",status="200"}}' in text
    assert "rs_gateway_time_to_first_token_seconds_count" in text
    assert "rs_gateway_inter_token_latency_seconds_count" in text
    assert "rs_gateway_e2e_request_latency_seconds_count" in text
    generated = next(line for line in text.splitlines() if line.startswith("rs_gateway_generation_tokens_total"))
    assert float(generated.split()[-1]) >= 2


def test_openapi_spec_lists_every_route(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    for path in (
        "/v1/chat/completions", "/v1/completions", "/v1/models", "/generate", "/health", "/ready", "/health_generate",
        "/get_model_info", "/get_server_info", "/flush_cache", "/abort_request", "/metrics",
    ):
        assert path in paths
