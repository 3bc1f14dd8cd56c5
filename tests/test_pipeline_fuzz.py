"""Hostile messages on the back half's NATS subjects leave every service up and answering right: arbitrary
bytes and well-typed but hostile msgpack (integers of any 64-bit value, NaN and infinite floats, odd
strings, wrong versions) on {p}.tokenize, {p}.tokenize.text, {p}.worker.{wid}.requests,
{p}.worker.{wid}.control and {p}.detok.{wid}, sent to a real tokenizer, worker and detokenizer serving a
tiny seeded checkpoint (tests/checkpoints.py). Afterwards each process is alive, none of their
handlers raised, and a greedy request gets the same tokens as before. Hypothesis with a bounded number
of examples."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.natsd import NatsServer, start_nats_server
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchTokenOut,
    ChatMessage,
    ControlRequest,
    Finish,
    GenerateRequest,
    Logprobs,
    Sampling,
    Subjects,
    TextTokenize,
    TokenizeRequest,
    TokenOut,
    TopLogprob,
    Usage,
)
from tests.gateway_helpers import LoopThread
from tests.services_helpers import FakeGateway, ServiceProcess

WORKER = "w1"
GATEWAY = "fuzz-gw"
SUBJECTS = Subjects()
FUZZ = settings(max_examples=30, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PROMPT = [5, 6, 7, 8]
GREEDY = Sampling(temperature=0.0, max_new_tokens=6)

int64s = st.integers(-(2**63), 2**64 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True)
versions = st.one_of(st.just(PROTOCOL_VERSION), st.just(PROTOCOL_VERSION), int64s)
rids = st.text(max_size=12)
# Small numbers most of the time, so hostile requests also get past the first check and run.
counts = st.one_of(st.none(), st.integers(0, 8), int64s)
samplings = st.builds(
    Sampling, max_new_tokens=counts, min_new_tokens=counts, temperature=st.none() | floats, top_p=st.none() | floats,
    top_k=counts, seed=st.none() | int64s, stop=st.none() | st.lists(st.text(max_size=4), max_size=2),
    stop_token_ids=st.none() | st.lists(int64s, max_size=2),
    logit_bias=st.none() | st.dictionaries(int64s, floats, max_size=2),
)
token_lists = st.lists(st.integers(0, 300) | int64s, max_size=6)
messages = st.lists(st.builds(ChatMessage, role=st.sampled_from(["user", "assistant"]) | st.text(max_size=6),
                              content=st.text(max_size=20)), max_size=3)
tokenize_requests = st.builds(
    TokenizeRequest, v=versions, rid=rids, gateway_id=st.just(GATEWAY), worker_id=st.just(WORKER) | st.text(max_size=4),
    sampling=samplings, text=st.none() | st.text(max_size=30), messages=st.none() | messages,
    input_ids=st.none() | token_lists, return_logprob=st.booleans(), top_logprobs_num=counts.map(lambda n: n or 0),
    priority=int64s, stream=st.booleans(),
)
generate_requests = st.builds(
    GenerateRequest, v=versions, rid=rids, gateway_id=st.just(GATEWAY), input_ids=token_lists, sampling=samplings,
    return_logprob=st.booleans(), top_logprobs_num=counts.map(lambda n: n or 0), priority=int64s, stream=st.booleans(),
)
text_questions = st.builds(TextTokenize, v=versions, text=st.none() | st.text(max_size=30),
                           messages=st.none() | messages, input_ids=st.none() | token_lists)
controls = st.builds(ControlRequest, v=versions, command=st.sampled_from(["abort", "get_info", "flush_cache"]) | st.text(
    max_size=8), rid=st.none() | rids)
token_outs = st.builds(
    BatchTokenOut, v=versions, worker_id=st.just(WORKER), step=int64s,
    items=st.lists(st.builds(
        TokenOut, rid=rids, gateway_id=st.just(GATEWAY), token_ids=token_lists,
        logprobs=st.none() | st.builds(Logprobs, st.lists(floats, max_size=3), top=st.none() | st.lists(
            st.lists(st.builds(TopLogprob, int64s, floats), max_size=2), max_size=2)),
        finish=st.none() | st.builds(Finish, type=st.text(max_size=6)),
        usage=st.none() | st.builds(Usage, prompt_tokens=int64s), first=st.booleans(),
        stop=st.none() | st.lists(st.text(max_size=3), max_size=2)), max_size=3),
)


def hostile(typed: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return st.binary(max_size=120) | typed.map(msgspec.msgpack.encode)


class Client:
    """A FakeGateway on a loop thread of its own."""

    def __init__(self, url: str) -> None:
        self.thread = LoopThread("pipeline-fuzz")
        self.gateway: FakeGateway = self.thread.run(FakeGateway.connect(url, GATEWAY))

    def publish(self, subject: str, data: bytes) -> None:
        async def send() -> None:
            await self.gateway.nc.publish(subject, data, reply=self.gateway.nc.new_inbox())
            await self.gateway.nc.flush()

        self.thread.run(send())

    def greedy(self, rid: str) -> list[int]:
        request = self.gateway.tokenize_request(rid, WORKER, sampling=GREEDY, input_ids=PROMPT)
        return self.thread.run(self.gateway.generate(request, timeout=60), timeout=90).token_ids

    def close(self) -> None:
        self.thread.run(self.gateway.nc.close())
        self.thread.close()


@pytest.fixture(scope="module")
def services(qwen3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, list[ServiceProcess]]]:
    log_dir = tmp_path_factory.mktemp("pipeline_fuzz_logs")
    nats_server = start_nats_server()
    common = ["--nats-url", nats_server.url, "--metrics-port", "0", "--model-path", str(qwen3_path)]
    started = [
        ServiceProcess.start("tokenizer", common, log_dir),
        ServiceProcess.start("worker", [*common, "--worker-id", WORKER, "--max-total-tokens", "2048"], log_dir),
        ServiceProcess.start("detokenizer", common, log_dir),
    ]
    try:
        for service in started:
            service.wait_ready()
        yield nats_server, started
    finally:
        for service in started:
            service.kill()
        nats_server.stop()


@pytest.fixture(scope="module")
def client(services: tuple[NatsServer, list[ServiceProcess]]) -> Iterator[Client]:
    c = Client(services[0].url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(client: Client) -> list[int]:
    """The greedy answer before any hostile message."""
    return client.greedy("before")


@FUZZ
@given(data=hostile(tokenize_requests))
def test_hostile_tokenize_requests(reference: list[int], client: Client, data: bytes) -> None:
    client.publish(SUBJECTS.tokenize, data)


@FUZZ
@given(data=hostile(text_questions))
def test_hostile_tokenizer_questions(reference: list[int], client: Client, data: bytes) -> None:
    client.publish(SUBJECTS.tokenize_text, data)


@FUZZ
@given(data=hostile(generate_requests))
def test_hostile_worker_requests(reference: list[int], client: Client, data: bytes) -> None:
    client.publish(SUBJECTS.worker_requests(WORKER), data)


@FUZZ
@given(data=hostile(controls))
def test_hostile_worker_controls(reference: list[int], client: Client, data: bytes) -> None:
    client.publish(SUBJECTS.worker_control(WORKER), data)


@FUZZ
@given(data=hostile(token_outs))
def test_hostile_detokenizer_batches(reference: list[int], client: Client, data: bytes) -> None:
    client.publish(SUBJECTS.detok(WORKER), data)


def test_every_service_is_up_and_answers_as_before(
    services: tuple[NatsServer, list[ServiceProcess]], client: Client, reference: list[int]
) -> None:
    asyncio.run(asyncio.sleep(1.0))  # what was queued is taken first
    for service in services[1]:
        assert service.proc.poll() is None, f"{service.service} exited:\n{service.log()[-4000:]}"
    assert client.greedy("after") == reference
    for service in services[1]:
        log = service.log()  # shared/bus.py logs a handler that raised so: nothing may
        assert "failed\nTraceback" not in log, log[log.find("failed\nTraceback") - 200:][:4000]
