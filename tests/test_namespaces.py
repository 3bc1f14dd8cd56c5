"""Namespaces (`--namespace`, alias of `--subject-prefix`): two deployments on one NATS and one Redis,
both with a worker called w0 and a gateway called g0, stay apart: every request is answered by its own
deployment exactly as if it were alone, and an API key belongs to the namespace it was created in.
Against the scripted pipeline on a real nats-server and the real Redis at REDIS_URL."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from services.cli import main as cli_main
from services.gateway.config import GatewayConfig
from shared import flags
from shared.natsd import NatsServer
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, GatewayThread, wait_for_workers

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")


@pytest.fixture(scope="module")
def namespaces() -> Iterator[tuple[str, str]]:
    names = (f"ns{uuid.uuid4().hex[:8]}", f"ns{uuid.uuid4().hex[:8]}")
    yield names
    client = redis.Redis.from_url(REDIS_URL)
    for name in names:
        for key in client.scan_iter(f"radixserve:{name}:*"):
            client.delete(key)


def gateway_config(nats_url: str, namespace: str, *more: str) -> GatewayConfig:
    """A gateway's config as its command line gives it, namespace spelled --namespace."""
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser, GatewayConfig)
    argv = ["--nats-url", nats_url, "--namespace", namespace, "--gateway-id", "g0", "--port", "0",
            "--grpc-port", "0", "--drain-timeout", "2", *more]
    return flags.build(GatewayConfig, parser.parse_args(argv), {})


def complete(url: str, prompt: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": FAKE_MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)


def test_two_deployments_on_one_nats_answer_exactly_as_alone(nats: NatsServer, namespaces: tuple[str, str]) -> None:
    pipelines = [FakePipeline(nats.url, workers=("w0",), prefix=ns) for ns in namespaces]
    gateways: list[GatewayThread] = []
    try:
        for ns in namespaces:
            config = gateway_config(nats.url, ns)
            assert config.subject_prefix == ns
            gateways.append(GatewayThread(nats.url, **{f: getattr(config, f) for f in ("subject_prefix", "gateway_id")}))
            wait_for_workers(gateways[-1].url, 1)
        prompts = {i: [f"{ns} request {n} says hello" for n in range(8)] for i, ns in enumerate(namespaces)}
        jobs = [(i, prompts[i][n]) for n in range(8) for i in (0, 1)]  # interleaved
        with ThreadPoolExecutor(len(jobs)) as pool:
            replies = list(pool.map(lambda job: complete(gateways[job[0]].url, job[1]), jobs))
        for (_, prompt), reply in zip(jobs, replies):
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == prompt + " "  # the echo, word by word
        for i, pipeline in enumerate(pipelines):
            assert sorted(r.text for r in pipeline.requests) == sorted(prompts[i])
    finally:
        for gateway in gateways:
            gateway.close()
        for pipeline in pipelines:
            pipeline.close()


def test_an_api_key_belongs_to_the_namespace_it_was_created_in(nats: NatsServer, namespaces: tuple[str, str]) -> None:
    mine, other = namespaces
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["keys", "--redis-url", REDIS_URL, "--namespace", mine, "create", "alice"]) == 0
    key = out.getvalue().strip()
    assert redis.Redis.from_url(REDIS_URL).hlen(f"radixserve:{mine}:apikeys") == 1
    assert redis.Redis.from_url(REDIS_URL).hlen(f"radixserve:{other}:apikeys") == 0
    gateways = {ns: GatewayThread(nats.url, subject_prefix=ns, redis_url=REDIS_URL) for ns in namespaces}
    try:
        models = {ns: httpx.get(f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
                  for ns, gw in gateways.items()}
        assert models[mine].status_code == 200, models[mine].text
        assert models[other].status_code == 401, models[other].text
    finally:
        for gateway in gateways.values():
            gateway.close()
