"""Input at the edges of what the protocol carries gets a 400 in OpenAI's error shape naming the field,
never a 500: integers beyond 64 bits (or int32 where ids and counts travel so), token ids beyond
int32, invalid Unicode (a lone surrogate, which JSON's \\ud800 escape can spell), and the limits on
top_logprobs_num, batch size and n. gRPC answers INVALID_ARGUMENT and the NATS front door an error
final for the same input. Against a scripted pipeline (tests/gateway_helpers.FakePipeline) on a real
nats-server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from services.gateway.protos import radixserve_pb2, radixserve_pb2_grpc
from shared.natsd import NatsServer
from shared.protocol import PROTOCOL_VERSION, NatsGenerateRequest, Sampling
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, GatewayThread, nats_generate, serving_gateway

MAX_BATCH = 4


@pytest.fixture(scope="module")
def gateway(nats: NatsServer, pipeline: FakePipeline) -> Iterator[GatewayThread]:
    with serving_gateway(nats.url, max_batch_size=MAX_BATCH) as gw:
        yield gw


def post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    """A JSON body written by hand, so it can hold what json.dumps would not write (\\ud800 alone)."""
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


def assert_400(response: httpx.Response, param: str) -> str:
    """The OpenAI error shape, status 400, naming `param`; returns the message."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, 400)
    return str(error["message"])


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a \\ud800 b"}]}', "messages.0.content"),
        ("/v1/completions", '{"prompt": ["fine", "x\\udc00"]}', "prompt.1"),
        ("/generate", '{"text": "a", "sampling_params": {"stop": ["\\udbff"]}}', "sampling_params.stop.0"),
        ("/tokenize", '{"prompt": "\\ud83d"}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(http: httpx.Client, path: str, body: str, param: str) -> None:
    assert "invalid Unicode" in assert_400(post_raw(http, path, body), param)


def test_a_surrogate_pair_is_the_character_it_spells(http: httpx.Client) -> None:
    response = post_raw(http, "/v1/completions", '{"prompt": "smile \\ud83d\\ude00", "max_tokens": 5}')
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "smile \N{GRINNING FACE} "


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat(max_tokens=2**64), "max_tokens"),
        ("/v1/chat/completions", chat(max_completion_tokens=2**31), "max_completion_tokens"),
        ("/v1/chat/completions", chat(seed=2**70), "seed"),
        ("/v1/completions", {"prompt": "a", "min_tokens": 2**64}, "min_tokens"),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2**64}}, "sampling_params.max_new_tokens"),
        ("/generate", {"text": "a", "sampling_params": {"seed": -(2**64)}}, "sampling_params.seed"),
    ],
)
def test_an_integer_beyond_its_field_range_is_400_naming_it(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    assert_400(http.post(path, json=body), param)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [1099511627776]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [3, 2**31]]}, "prompt"),
        ("/generate", {"input_ids": [5, -1]}, "input_ids"),
        ("/generate", {"input_ids": [[5], [2**64]]}, "input_ids"),
        ("/v1/completions", {"prompt": "a", "stop_token_ids": [2**40]}, "stop_token_ids"),
        ("/v1/chat/completions", chat(logit_bias={"99999999999": 1}), "logit_bias"),
        ("/detokenize", {"tokens": [1, 2**40]}, "tokens"),
    ],
)
def test_a_token_id_beyond_int32_is_400_naming_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    assert_400(http.post(path, json=body), param)


def test_top_logprobs_num_is_capped_at_20(http: httpx.Client) -> None:
    message = assert_400(http.post("/generate", json={"text": "a", "top_logprobs_num": 100000}), "top_logprobs_num")
    assert "20" in message
    answer = http.post("/generate", json={"text": "a b", "top_logprobs_num": 20})
    assert [len(step) for step in answer.json()["meta_info"]["output_top_logprobs"]] == [20, 20]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"text": ["p"] * (MAX_BATCH + 1)}, "text"),
        ("/generate", {"input_ids": [[1]] * (MAX_BATCH + 1)}, "input_ids"),
        ("/v1/completions", {"prompt": ["p"] * (MAX_BATCH + 1)}, "prompt"),
    ],
)
def test_a_batch_beyond_max_batch_size_is_400(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    assert f"the limit is {MAX_BATCH}" in assert_400(http.post(path, json=body), param)


def test_a_batch_of_max_batch_size_is_served(http: httpx.Client) -> None:
    answer = http.post("/v1/completions", json={"prompt": ["p q"] * MAX_BATCH, "max_tokens": 2})
    assert [c["text"] for c in answer.json()["choices"]] == ["p q "] * MAX_BATCH


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/v1/chat/completions", chat(n=129), "n"), ("/generate", {"text": "a", "sampling_params": {"n": 129}},
                                                 "sampling_params.n")],
)
def test_n_beyond_128_is_400(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    assert_400(http.post(path, json=body), param)


def test_a_huge_integer_in_free_form_json_travels_as_a_float(http: httpx.Client, pipeline: FakePipeline) -> None:
    body = chat(rid="huge-kwarg", chat_template_kwargs={"budget": 2**70, "small": 3})
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    sent = next(r for r in pipeline.requests if r.rid == "huge-kwarg")
    assert sent.chat_template_kwargs == {"budget": float(2**70), "small": 3}


def test_an_integer_written_as_a_whole_float_is_that_integer(http: httpx.Client, pipeline: FakePipeline) -> None:
    assert http.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2.0, "rid": "whole"}).status_code == 200
    assert next(r for r in pipeline.requests if r.rid == "whole").sampling.max_new_tokens == 2
    assert_400(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2.5}), "max_tokens")


def test_unknown_routes_and_methods_answer_in_the_error_shape(http: httpx.Client) -> None:
    missing = http.get("/v2/nothing")
    assert (missing.status_code, missing.json()["error"]["type"]) == (404, "not_found_error")
    wrong = http.put("/flush_cache")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (405, 405)
    assert wrong.headers["allow"] == "GET, POST"


def test_an_unexpected_exception_is_a_500_in_the_error_shape(http: httpx.Client, gateway: GatewayThread) -> None:
    registry = gateway.service.dispatcher.registry

    def broken() -> list[str]:
        raise RuntimeError("a bug")

    registry.models = broken  # type: ignore[method-assign]
    try:
        for response in (http.get("/v1/models"), http.post("/generate", json={"text": "a", "model": "x"})):
            assert response.status_code == 500
            assert response.json()["error"]["type"] == "internal_error"
            assert "a bug" not in response.text  # the traceback goes to the log, not the client
    finally:
        del registry.models
    assert http.get("/v1/models").status_code == 200


@pytest.mark.parametrize(
    "fields",
    [{"top_logprobs_num": 100000}, {"input_ids": radixserve_pb2.TokenIds(ids=[1, -5])},
     {"sampling_params": radixserve_pb2.SamplingParams(max_new_tokens=-1)}],
)
def test_grpc_answers_such_input_with_invalid_argument(gateway: GatewayThread, fields: dict[str, Any]) -> None:
    prompt = {} if "input_ids" in fields else {"text": "a"}
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        stub = radixserve_pb2_grpc.RadixServeStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(radixserve_pb2.GenerateRequest(**prompt, **fields), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_answers_a_request_that_does_not_parse_with_invalid_argument(gateway: GatewayThread) -> None:
    field = radixserve_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["text"].number
    bad_utf8 = bytes([field << 3 | 2, 3]) + "\ud800".encode("utf-8", "surrogatepass")
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        generate = channel.unary_stream("/radixserve.v1.RadixServe/Generate", request_serializer=bytes,
                                        response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as caught:
            list(generate(bad_utf8, timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in str(caught.value.details())


@pytest.mark.parametrize("method", ["Check", "Watch"])
def test_grpc_health_answers_a_request_that_does_not_parse_with_invalid_argument(
    gateway: GatewayThread, method: str
) -> None:
    """Watch writes its stream with context.write rather than yielding it, and is refused all the same."""
    bad_utf8 = bytes([1 << 3 | 2, 3]) + "\ud800".encode("utf-8", "surrogatepass")  # HealthCheckRequest.service
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        path = f"/grpc.health.v1.Health/{method}"
        call = (channel.unary_unary if method == "Check" else channel.unary_stream)(
            path, request_serializer=bytes, response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as caught:
            answer = call(bad_utf8, timeout=10)
            if method == "Watch":
                next(answer)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in str(caught.value.details())


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (NatsGenerateRequest(v=PROTOCOL_VERSION, text="a", top_logprobs_num=2**63), "top_logprobs_num"),
        (NatsGenerateRequest(v=PROTOCOL_VERSION, input_ids=[1, 2**40]), "input_ids"),
        (NatsGenerateRequest(v=PROTOCOL_VERSION, text="a", sampling=Sampling(max_new_tokens=2**40)), "max_new_tokens"),
    ],
)
def test_the_nats_front_door_answers_such_input_with_a_400_final(
    nats: NatsServer, gateway: GatewayThread, request_: NatsGenerateRequest, field: str
) -> None:
    (final,) = nats_generate(nats.url, request_, timeout=10)
    assert final.final and final.error is not None
    assert final.error.startswith("400: ") and field in final.error


def test_the_openapi_document_has_the_limits(http: httpx.Client) -> None:
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["GenerateBody"]["properties"]["top_logprobs_num"]["maximum"] == 20
    assert schemas["ChatCompletionRequest"]["properties"]["n"]["maximum"] == 128
    batches = [o for o in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"] if "maxItems" in o]
    assert [o["maxItems"] for o in batches] == [MAX_BATCH, MAX_BATCH]
    assert '"x-batch"' not in json.dumps(schemas)  # the marker document() replaces


def test_an_unexpected_exception_on_the_nats_front_door_is_a_500_final(nats: NatsServer, gateway: GatewayThread) -> None:
    dispatcher = gateway.service.dispatcher

    async def broken(spec: Any) -> Any:
        raise RuntimeError("a bug")

    dispatcher.submit = broken  # type: ignore[method-assign]
    try:
        (final,) = nats_generate(nats.url, NatsGenerateRequest(v=PROTOCOL_VERSION, text="a", rid="bug"), timeout=10)
    finally:
        del dispatcher.submit
    assert (final.final, final.rid) == (True, "bug")
    assert final.error is not None and final.error.startswith("500: ") and "a bug" not in final.error
