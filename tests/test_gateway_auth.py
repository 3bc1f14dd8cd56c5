"""API keys at the gateway (services/gateway/auth.py): static keys, Redis-held keys with a
requests-per-minute limit and usage counters, `radixserve keys`, and what bad or missing keys get
(401), a key over its limit (429 + Retry-After), an unreachable Redis (the gateway refuses to start).
Against the scripted pipeline on a real nats-server and the real Redis at REDIS_URL."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli import main as cli_main
from services.gateway.config import GatewayConfig
from services.gateway.protos import radixserve_pb2, radixserve_pb2_grpc
from services.gateway.service import GatewayService
from shared.natsd import NatsServer
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, GatewayThread, wait_for_workers
from tests.keys_helpers import REDIS_URL, keys_cli, redis_namespace


@pytest.fixture(scope="module")
def prefix() -> Iterator[str]:
    yield from redis_namespace("auth")


@pytest.fixture(scope="module")
def pipeline(nats: NatsServer, prefix: str) -> Iterator[FakePipeline]:
    fake = FakePipeline(nats.url, workers=("w1",), prefix=prefix)
    yield fake
    fake.close()



def complete(url: str, key: str | None, prompt: str = "one two three") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = {"model": FAKE_MODEL, "prompt": prompt, "max_tokens": 8}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10)


def test_static_keys_guard_every_route_but_health_and_metrics(nats: NatsServer, prefix: str,
                                                              pipeline: FakePipeline) -> None:
    gw = GatewayThread(nats.url, subject_prefix=prefix, api_key="k-one, k-two")
    try:
        wait_for_workers(gw.url, 1)
        assert httpx.get(f"{gw.url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{gw.url}/metrics", timeout=5).status_code == 200
        missing = httpx.get(f"{gw.url}/v1/models", timeout=5)
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        assert "Authorization: Bearer" in missing.json()["error"]["message"]
        wrong = complete(gw.url, "k-three")
        assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "invalid API key"
        ok = complete(gw.url, "k-two")
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "one two three "
        # gRPC: the key travels as `authorization` metadata; the health service needs none.
        with grpc.insecure_channel(gw.grpc_target) as channel:
            stub = radixserve_pb2_grpc.RadixServeStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfo(radixserve_pb2.ModelInfoRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "missing API key" in refused.value.details()
            with pytest.raises(grpc.RpcError) as wrong_key:
                list(stub.Generate(radixserve_pb2.GenerateRequest(text="x y"), timeout=5,
                                   metadata=[("authorization", "Bearer nope")]))
            assert wrong_key.value.code() == grpc.StatusCode.UNAUTHENTICATED
            good = [("authorization", "Bearer k-one")]
            assert [m.model for m in stub.ModelInfo(radixserve_pb2.ModelInfoRequest(), timeout=5,
                                                    metadata=good).models] == [FAKE_MODEL]
            replies = list(stub.Generate(radixserve_pb2.GenerateRequest(text="x y"), timeout=5, metadata=good))
            assert "".join(r.text for r in replies) == "x y "
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
        # A refused key reached no model; the completion went to the fake workers' model.
        assert 'rs_gateway_requests_total{endpoint="auth",model_name="",status="401"} 2.0' in metrics
        assert f'rs_gateway_requests_total{{endpoint="/v1/completions",model_name="{FAKE_MODEL}",status="200"}} 1.0' in metrics
    finally:
        gw.close()


def test_redis_keys_with_a_rate_limit_usage_and_revocation(nats: NatsServer, prefix: str,
                                                          pipeline: FakePipeline) -> None:
    code, key = keys_cli(prefix, "create", "alice", "--rpm", "3")
    assert code == 0 and key.startswith("rs-")
    assert keys_cli(prefix, "create", "alice") == (1, "radixserve keys: a key named 'alice' exists already")
    # Redis keeps only the key's hash.
    assert not any(key.encode() in v for v in redis.Redis.from_url(REDIS_URL).hvals(f"radixserve:{prefix}:apikeys"))
    gw = GatewayThread(nats.url, subject_prefix=prefix, redis_url=REDIS_URL)
    try:
        wait_for_workers(gw.url, 1)
        if time.time() % 60 > 50:  # keep the next requests inside one rate window
            time.sleep(61 - time.time() % 60)
        replies = [complete(gw.url, key, "a b c"), complete(gw.url, key, "d e"), complete(gw.url, key, "f")]
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        limited = complete(gw.url, key)
        assert limited.status_code == 429, limited.text
        assert limited.json()["error"]["type"] == "rate_limit_error"
        assert 1 <= int(limited.headers["Retry-After"]) <= 60
        # Usage: the three generations' tokens, as their responses reported them.
        usage: dict = {}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and usage.get("requests") != 3:
            time.sleep(0.05)
            listed = keys_cli(prefix, "list")[1]
            usage = next(json.loads(line) for line in listed.splitlines() if '"alice"' in line)
        assert usage["rpm"] == 3 and usage["requests"] == 3
        assert usage["prompt_tokens"] == sum(r.json()["usage"]["prompt_tokens"] for r in replies)
        assert usage["completion_tokens"] == sum(r.json()["usage"]["completion_tokens"] for r in replies)
        assert keys_cli(prefix, "revoke", "alice") == (0, "revoked 'alice'")
        assert complete(gw.url, key).status_code == 401
        assert keys_cli(prefix, "revoke", "alice") == (1, "no key named 'alice'")
    finally:
        gw.close()


def test_a_gateway_whose_redis_is_unreachable_refuses_to_start(nats: NatsServer, prefix: str) -> None:
    config = GatewayConfig(nats_url=nats.url, subject_prefix=prefix, port=0, grpc_port=0, redis_url="redis://127.0.0.1:1")
    service = GatewayService(config)

    async def start_then_drain() -> None:
        try:
            await service.start()
        finally:
            await service.drain()

    with pytest.raises(ConnectionError, match=r"the API-key store \(Redis\) is unreachable"):
        asyncio.run(start_then_drain())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["keys", "--redis-url", "redis://127.0.0.1:1", "--subject-prefix", prefix, "list"])
    assert code == 1 and "unreachable" in out.getvalue()
