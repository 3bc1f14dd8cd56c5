"""A burst of requests is admitted together, through the worker service as through the offline Engine.

A worker reads the requests of a burst from NATS in one delivery; it hands them to its scheduler as one
command, so the scheduler's first prefill has all of them. Before, each request went to the scheduler
on its own, and a scheduler in its own process (as on CUDA) woke on the first one and prefilled it
alone while the worker was still reading the others: one prefill step more than the Engine needs for
the same prompts, and a burst split across steps (on the H200, 132-133 steps where the Engine took
131). Here the worker serves a tiny checkpoint with its scheduler in a process of its own, the burst
comes straight over NATS (one publish each, sent in one flush), and its steps (prefill and decode) and
greedy tokens must equal the Engine's for the same prompts and settings.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from prometheus_client import CollectorRegistry

from services.worker.config import EngineConfig
from services.worker.frontend import service as worker_service
from services.worker.frontend.engine import Engine
from services.worker.frontend.service import WorkerService
from services.worker.frontend.service_config import WorkerServiceConfig
from shared.natsd import NatsServer
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchTokenOut,
    GenerateRequest,
    Sampling,
    Subjects,
    decoder,
    encode,
)
from tests.gateway_helpers import LoopThread

WORKER = "w1"
BURST = 8
PROMPT_LEN = 24
NEW_TOKENS = 6
# 8 prompts of 24 tokens in chunks of 64: three prefill steps when admitted together, four when the
# first prompt is prefilled alone.
ENGINE_OPTIONS: dict[str, Any] = dict(
    device="cpu", chunked_prefill_size=64, max_total_tokens=2048, scheduler_process=True, cpu_threads=1
)


@pytest.fixture(autouse=True)
def private_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    real = worker_service.WorkerMetrics
    monkeypatch.setattr(
        worker_service, "WorkerMetrics", lambda *args: real(*args, registry=CollectorRegistry())
    )


def burst_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 300) for _ in range(PROMPT_LEN)] for _ in range(BURST)]


def step_counts(stats: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    names = ("num_steps", "num_prefill_steps", "num_decode_steps")
    return {name: stats[name] - before[name] for name in names}


@pytest.fixture(scope="module")
def worker(qwen3_path: Path, nats: NatsServer) -> Iterator[WorkerService]:
    """The worker service on its own event loop thread, its scheduler in a process of its own."""
    engine = EngineConfig.from_kwargs(str(qwen3_path), **ENGINE_OPTIONS)
    config = WorkerServiceConfig(
        nats_url=nats.url, worker_id=WORKER, served_model_name="tiny", metrics_port=None, engine=engine
    )
    loop = LoopThread("worker-loop")
    service = WorkerService(config)
    try:
        loop.run(service.start(), timeout=120)
        yield service
    finally:
        loop.run(service.drain(), timeout=60)
        loop.close()


async def send_burst(url: str, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Publish every prompt to the worker at once and collect each one's tokens until its final."""
    subjects = Subjects()
    nc = await nats.connect(url)
    tokens: dict[str, list[int]] = {f"b{i}": [] for i in range(len(prompts))}
    finished: set[str] = set()
    done = asyncio.Event()
    dec = decoder(BatchTokenOut)

    async def on_step(raw: Any) -> None:
        for item in dec.decode(raw.data).items:
            tokens[item.rid].extend(item.token_ids)
            if item.finish is not None:
                finished.add(item.rid)
        if len(finished) == len(prompts):
            done.set()

    try:
        await nc.subscribe(subjects.detok(WORKER), cb=on_step)
        await nc.flush()
        sampling = Sampling(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        for rid, ids in zip(tokens, prompts):
            # Nothing awaited between the publishes suspends: nats-py writes them in one flush.
            await nc.publish(
                subjects.worker_requests(WORKER),
                encode(
                    GenerateRequest(
                        v=PROTOCOL_VERSION,
                        rid=rid,
                        gateway_id="g1",
                        input_ids=ids,
                        sampling=sampling,
                        stream=True,
                    )
                ),
            )
        await asyncio.wait_for(done.wait(), timeout=120)
    finally:
        await nc.close()
    return tokens


def test_a_burst_through_the_worker_takes_the_engines_steps(worker: WorkerService, qwen3_path: Path) -> None:
    prompts = burst_prompts()
    client = worker.client
    assert client is not None
    before = client.control("get_info")["stats"]
    served = asyncio.run(send_burst(worker.config.nats_url, prompts))
    pipeline_steps = step_counts(client.control("get_info")["stats"], before)

    with Engine(str(qwen3_path), **ENGINE_OPTIONS) as engine:
        before = engine.get_server_info()["stats"]
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        )
        engine_steps = step_counts(engine.get_server_info()["stats"], before)

    # Three prefill chunks (8 x 24 tokens in 64-token chunks), then NEW_TOKENS - 1 decode steps.
    assert engine_steps == {
        "num_steps": 3 + NEW_TOKENS - 1,
        "num_prefill_steps": 3,
        "num_decode_steps": NEW_TOKENS - 1,
    }
    assert pipeline_steps == engine_steps
    assert [served[f"b{i}"] for i in range(BURST)] == [out["output_ids"] for out in outs]


class _Client:
    """Records what reaches the scheduler, and when."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def add(self, *reqs: Any) -> None:
        self.commands.append([req.rid for req in reqs])


class _Sub:
    pending_msgs = 0


class _Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid


def test_a_lone_request_goes_to_the_scheduler_at_once_and_a_delivery_together() -> None:
    async def main() -> list[list[list[str]]]:
        service = WorkerService(WorkerServiceConfig(worker_id="w", served_model_name="tiny"))
        service._loop = asyncio.get_running_loop()
        client, sub = _Client(), _Sub()
        service.client, service._requests_sub = client, sub  # type: ignore[assignment]
        seen = []
        # A lone request (nothing else waiting in the subscription): handed over within the call.
        service._arrived.append(_Req("a"))  # type: ignore[arg-type]
        service._admit()
        seen.append(list(client.commands))
        # Three requests of one delivery: nothing goes while the next ones wait to be read, then all at once.
        for i, rid in enumerate(("b", "c", "d")):
            sub.pending_msgs = 2 - i
            service._arrived.append(_Req(rid))  # type: ignore[arg-type]
            service._admit()
            seen.append(list(client.commands))
        # A delivery whose last message never reaches the handler (dropped as malformed): what came
        # is handed over on the loop's next turn.
        sub.pending_msgs = 1
        service._arrived.append(_Req("e"))  # type: ignore[arg-type]
        service._admit()
        seen.append(list(client.commands))
        await asyncio.sleep(0)
        seen.append(list(client.commands))
        return seen

    seen = asyncio.run(main())
    assert seen[0] == [["a"]]
    assert seen[1] == seen[2] == [["a"]]
    assert seen[3] == [["a"], ["b", "c", "d"]]
    assert seen[4] == [["a"], ["b", "c", "d"]]
    assert seen[5] == [["a"], ["b", "c", "d"], ["e"]]


def test_engine_generate_hands_its_prompts_over_in_one_command(qwen3_path: Path) -> None:
    sent: list[int] = []
    with Engine(str(qwen3_path), scheduler_process=False, cpu_threads=1) as engine:
        real = engine._client.add
        lock = threading.Lock()

        def add(*reqs: Any) -> None:
            with lock:
                sent.append(len(reqs))
            real(*reqs)

        engine._client.add = add  # type: ignore[method-assign]
        engine.generate(input_ids=burst_prompts()[:5], sampling_params={"max_new_tokens": 2})
    assert sent == [5]
