"""The gateway's gRPC API with the stubs generated from proto/ (services/gateway/protos.py): streaming
Generate, Abort, ModelInfo, status codes, cancel -> abort, grpc.health.v1 (Check, Watch, List) and
server reflection. Against a scripted pipeline (tests/gateway_helpers.FakePipeline) on a real
nats-server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.gateway.protos import radixserve_pb2, radixserve_pb2_grpc
from shared.natsd import NatsServer
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, GatewayThread


@pytest.fixture(scope="module")
def channel(gateway: GatewayThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gateway.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> Any:
    return radixserve_pb2_grpc.RadixServeStub(channel)


def request(**fields: Any) -> Any:
    return radixserve_pb2.GenerateRequest(**fields)


def test_generate_streams_deltas_then_a_final_with_usage(stub: Any, pipeline: FakePipeline) -> None:
    sampling = radixserve_pb2.SamplingParams(max_new_tokens=10, temperature=0.0, stop=["never"])
    responses = list(stub.Generate(request(text="hello grpc world", sampling_params=sampling, rid="g-1"), timeout=10))
    assert "".join(r.text for r in responses) == "hello grpc world "
    assert [t for r in responses for t in r.token_ids] == [100, 101, 102]
    assert all(r.rid == "g-1" for r in responses)
    assert [r.final for r in responses] == [False] * (len(responses) - 1) + [True]
    final = responses[-1]
    assert final.finish.type == "stop"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 3)
    sent = next(r for r in pipeline.requests if r.rid == "g-1")
    assert (sent.sampling.max_new_tokens, sent.sampling.temperature, sent.sampling.stop) == (10, 0.0, ["never"])
    assert sent.sampling.top_p is None  # unset optional fields stay unset


def test_generate_passes_logit_bias(stub: Any, pipeline: FakePipeline) -> None:
    sampling = radixserve_pb2.SamplingParams(logit_bias={9: -100.0, 4: 1.5})
    list(stub.Generate(request(text="biased", sampling_params=sampling, rid="g-bias"), timeout=10))
    assert next(r for r in pipeline.requests if r.rid == "g-bias").sampling.logit_bias == {9: -100.0, 4: 1.5}
    bad = radixserve_pb2.SamplingParams(logit_bias={9: 500.0})
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request(text="biased", sampling_params=bad), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logit_bias for token 9 must be a number in [-100, 100]" in caught.value.details()


def test_generate_passes_a_grammar(stub: Any, pipeline: FakePipeline) -> None:
    sampling = radixserve_pb2.SamplingParams(json_schema='{"type": "object"}')
    list(stub.Generate(request(text="json", sampling_params=sampling, rid="g-json"), timeout=10))
    sent = next(r for r in pipeline.requests if r.rid == "g-json").sampling
    assert (sent.json_schema, sent.regex, sent.ebnf) == ('{"type": "object"}', None, None)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request(text="x", sampling_params=radixserve_pb2.SamplingParams(regex="[")), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "regex cannot be compiled" in caught.value.details()


def test_generate_from_token_ids_and_chat_with_logprobs(stub: Any) -> None:
    ids = list(stub.Generate(request(input_ids=radixserve_pb2.TokenIds(ids=[7, 8])), timeout=10))
    assert "".join(r.text for r in ids) == "t7 t8 "
    chat = radixserve_pb2.ChatMessages(messages=[radixserve_pb2.ChatMessage(role="user", content="q r")])
    out = list(stub.Generate(request(chat=chat, return_logprob=True, top_logprobs_num=1), timeout=10))
    logprobs = [lp for r in out for lp in r.logprobs]
    assert [(lp.token_id, round(lp.logprob, 5)) for lp in logprobs] == [(100, -0.1), (101, -0.2)]
    assert [c.token_id for c in logprobs[0].top_logprobs] == [0]


def test_logprob_start_len_reaches_the_tokenizer_and_a_bad_one_is_invalid_argument(stub: Any, pipeline: FakePipeline) -> None:
    """Set, it goes on with the request; unset or -1, the request asks for no prompt log-probs; below -1
    it is refused at the door. (Past the prompt's end only the worker can tell: tests/api_stack/test_echo_logprobs_api.py.)"""
    for rid, fields in (("g-start", {"logprob_start_len": 2}), ("g-unset", {}), ("g-none", {"logprob_start_len": -1})):
        list(stub.Generate(request(text="a b c", rid=rid, return_logprob=True, **fields), timeout=10))
    sent = {r.rid: r.logprob_start_len for r in pipeline.requests if r.rid in ("g-start", "g-unset", "g-none")}
    assert sent == {"g-start": 2, "g-unset": None, "g-none": None}
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request(text="a b c", return_logprob=True, logprob_start_len=-2), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "`logprob_start_len` must be an integer >= -1, got -2"


def test_stop_string_and_length_finishes(stub: Any) -> None:
    stopped = list(stub.Generate(request(text="a b c", sampling_params=radixserve_pb2.SamplingParams(stop=["b"])), timeout=10))
    assert stopped[-1].finish.matched_text == "b"
    cut = list(stub.Generate(request(text="a b c", sampling_params=radixserve_pb2.SamplingParams(max_new_tokens=1)), timeout=10))
    assert (cut[-1].finish.type, "".join(r.text for r in cut)) == ("length", "a ")


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "ERROR x"}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "x", "sampling_params": radixserve_pb2.SamplingParams(top_p=3.0)}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "x", "model": "nope"}, grpc.StatusCode.NOT_FOUND),
    ],
)
def test_errors_are_grpc_statuses(stub: Any, fields: dict[str, Any], code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request(**fields), timeout=10))
    assert err.value.code() == code


def test_cancel_aborts_the_request_on_its_worker(stub: Any, pipeline: FakePipeline) -> None:
    call = stub.Generate(request(text="HANG around", rid="g-cancel"), timeout=10)
    assert next(call).text == "HANG "
    call.cancel()
    pipeline.wait_until(lambda: ("w1", "g-cancel") in pipeline.aborts)


def test_abort_rpc_ends_the_stream_with_abort(stub: Any) -> None:
    call = stub.Generate(request(text="HANG there", rid="g-abort"), timeout=10)
    assert next(call).text == "HANG "
    assert stub.Abort(radixserve_pb2.AbortRequest(rid="g-abort"), timeout=5).found is True
    rest = list(call)
    assert rest[-1].final and rest[-1].finish.type == "abort"


def test_model_info_lists_the_served_model(stub: Any) -> None:
    info = stub.ModelInfo(radixserve_pb2.ModelInfoRequest(), timeout=5)
    assert [(m.model, m.context_len, m.workers) for m in info.models] == [(FAKE_MODEL, 64, 1)]


def test_health_check_and_watch(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == serving
    assert health.Check(health_pb2.HealthCheckRequest(service="radixserve.v1.RadixServe"), timeout=5).status == serving
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert next(watch).status == serving
    watch.cancel()


def test_health_list_gives_every_service_its_status(channel: grpc.Channel) -> None:
    listed = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=5)
    assert {name: response.status for name, response in listed.statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING,
        "radixserve.v1.RadixServe": health_pb2.HealthCheckResponse.SERVING,
    }


def test_health_watch_follows_the_workers(nats: NatsServer) -> None:
    """With no worker the API is NOT_SERVING while the gateway itself (service "") serves; a worker
    that starts reporting turns it SERVING, and one that dies turns it back, on the open Watch."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    gw = GatewayThread(nats.url, subject_prefix="health")
    fake: FakePipeline | None = None
    try:
        with grpc.insecure_channel(gw.grpc_target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == serving
            watch = health.Watch(health_pb2.HealthCheckRequest(service="radixserve.v1.RadixServe"), timeout=30)
            assert next(watch).status == not_serving
            fake = FakePipeline(nats.url, workers=("hw",), prefix="health")
            assert next(watch).status == serving
            fake.kill_worker("hw")
            assert next(watch).status == not_serving
            watch.cancel()
    finally:
        gw.close()
        if fake is not None:
            fake.close()


def test_reflection_lists_and_describes_the_services(channel: grpc.Channel) -> None:
    database = ProtoReflectionDescriptorDatabase(channel)
    assert set(database.get_services()) == {
        "radixserve.v1.RadixServe", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"
    }
    # The descriptors come over the wire, so a client needs no .proto to call the API.
    service = DescriptorPool(database).FindServiceByName("radixserve.v1.RadixServe")
    generate = service.methods_by_name["Generate"]
    assert sorted(service.methods_by_name) == ["Abort", "Generate", "ModelInfo"]
    assert (generate.input_type.full_name, generate.output_type.full_name) == (
        "radixserve.v1.GenerateRequest", "radixserve.v1.GenerateResponse"
    )
    assert "sampling_params" in generate.input_type.fields_by_name
