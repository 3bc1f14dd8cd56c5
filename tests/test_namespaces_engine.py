"""Two deployments on one NATS, with real workers (tests/test_namespaces.py does the same with the
scripted pipeline) on a tiny seeded Qwen3 (the namespaces are the point here, not the model): each under its own namespace (--subject-prefix, or its alias --namespace), both
with a worker called w0, under interleaved load. Every answer equals the offline Engine's, as if each deployment were alone
(sharing the prefix, both workers took every request and answers came back doubled), and an API key
kept in Redis for one namespace is unknown to the other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from pathlib import Path

import httpx

from services.gateway.auth import KeyStore
from services.worker.frontend.engine import Engine
from shared.natsd import NatsServer
from tests.gateway_helpers import GatewayThread, wait_for_workers
from tests.services_helpers import ServiceProcess

REDIS_URL = "redis://127.0.0.1:6379"
PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is", "Bees make"]


def test_two_namespaces_on_one_nats_answer_as_if_alone(
    nats: NatsServer, qwen3_path: Path, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:6]
    namespaces = [f"one{suffix}", f"two{suffix}"]
    keys = {}
    for ns in namespaces:
        store = KeyStore([], REDIS_URL, ns)
        keys[ns] = asyncio.run(_create_key(store, f"tenant-{ns}"))
    workers = [
        ServiceProcess.start(
            "worker",
            ["--nats-url", nats.url, "--namespace" if i else "--subject-prefix", ns, "--metrics-port", "0",
             "--model-path", str(qwen3_path), "--worker-id", "w0", "--with-detokenizer",
             "--max-total-tokens", "4096"],
            tmp_path, label=ns,
        )
        for i, ns in enumerate(namespaces)
    ]
    gateways: list[GatewayThread] = []
    try:
        for worker in workers:
            worker.wait_ready()
        gateways = [
            GatewayThread(nats.url, subject_prefix=ns, local_tokenizer=str(qwen3_path), redis_url=REDIS_URL,
                          api_key="static-unused")
            for ns in namespaces
        ]
        for gateway in gateways:
            wait_for_workers(gateway.url, 1, timeout=30)

        def ask(job: tuple[int, str]) -> tuple[int, str, httpx.Response]:
            g, prompt = job
            gateway = gateways[g]
            key = keys[gateway.config.subject_prefix]
            body = {"model": qwen3_path.name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
            answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120,
                                headers={"Authorization": f"Bearer {key}"})
            return g, prompt, answer

        jobs = [(g, p) for p in PROMPTS for g in (0, 1)]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(ask, jobs))
        # A key of one namespace is unknown in the other.
        crossed = httpx.post(
            f"{gateways[1].url}/v1/completions", timeout=30, headers={"Authorization": f"Bearer {keys[namespaces[0]]}"},
            json={"model": qwen3_path.name, "prompt": "hi", "max_tokens": 2},
        )
    finally:
        for gateway in gateways:
            gateway.close()
        for worker in workers:
            worker.kill()
    with Engine(str(qwen3_path), max_total_tokens=4096) as engine:
        expected = {p: engine.generate(p, {"temperature": 0, "max_new_tokens": 12}) for p in PROMPTS}
    for g, prompt, answer in answers:
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["text"] == expected[prompt]["text"], (g, prompt)
        assert answer.json()["usage"]["completion_tokens"] == len(expected[prompt]["output_ids"])
    assert crossed.status_code == 401


async def _create_key(store: KeyStore, name: str) -> str:
    try:
        return await store.create(name)
    finally:
        await store.close()
