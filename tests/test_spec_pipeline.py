"""Speculative decoding's per-request metrics through the service pipeline, as real processes on a real
nats-server: tokenizer, a worker with `--speculative-algorithm ngram`, the standalone detokenizer (so the
numbers cross NATS twice, as TokenOut and as StreamOut; a worker's in-process detokenizer runs the same
Detokenizer on the same TokenOut) and a gateway, serving the embedded default model. Greedy requests
with repeating prompts: `meta_info.spec_accept_length` / `spec_accept_rate` must equal what the offline
Engine with the same options reports, and the worker's Prometheus counters must add up to them.

One set of processes serves the whole module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from transformers import AutoTokenizer

from services.detokenizer.detokenizer import Detokenizer
from services.worker.frontend.engine import Engine
from shared.model_path import DEFAULT_MODEL_NAME
from shared.natsd import NatsServer, start_nats_server
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchTokenOut,
    Finish,
    NatsGenerateRequest,
    Sampling,
    TokenOut,
    Usage,
)
from tests.gateway_helpers import GatewayThread, nats_generate, wait_for_workers
from tests.services_helpers import ServiceProcess, metric_value

WORKER = "w1"
K = 4
SPEC_OPTIONS = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": K}
MAX_TOTAL_TOKENS = 8192
GREEDY = {"temperature": 0.0, "max_new_tokens": 32}
# Repeating prompts, so prompt lookup finds continuations; each is sent to the worker once (a cached
# prefix would change the prefill's shape, not the answer, but the test need not rely on that).
CAT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat."
COUNTING = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5,"
COLORS = "red, green, blue, red, green, blue, red, green, blue,"
SPEC_KEYS = ("spec_accept_length", "spec_accept_rate")
SPEC_COUNTERS = (
    "rs_worker_spec_verify_steps_total",
    "rs_worker_spec_proposed_tokens_total",
    "rs_worker_spec_accepted_tokens_total",
    "rs_worker_spec_accept_length_count",
    "rs_worker_spec_accept_length_sum",
)


@dataclass
class Stack:
    nats: NatsServer
    worker: ServiceProcess
    gateway: GatewayThread


@pytest.fixture(scope="module")
def stack(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("spec_pipeline_logs")
    nats_server = start_nats_server()
    common = ["--nats-url", nats_server.url, "--metrics-port", "0", "--model-path", str(default_model_path)]
    spec = ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", str(K)]
    worker_args = ["--worker-id", WORKER, "--max-total-tokens", str(MAX_TOTAL_TOKENS), *spec]
    worker = ServiceProcess.start("worker", [*common, *worker_args], log_dir)
    services = [
        ServiceProcess.start("tokenizer", common, log_dir),
        worker,
        ServiceProcess.start("detokenizer", [*common, "--worker-id", WORKER], log_dir),
    ]
    gateway: GatewayThread | None = None
    try:
        for service in services:
            service.wait_ready()
        gateway = GatewayThread(nats_server.url, enable_grpc=False)
        wait_for_workers(gateway.url, 1, timeout=30)
        yield Stack(nats_server, worker, gateway)
    finally:
        if gateway is not None:
            gateway.close()
        for service in services:
            service.kill()
        nats_server.stop()


@pytest.fixture(scope="module")
def engine(default_model_path: Path) -> Iterator[Engine]:
    with Engine(str(default_model_path), max_total_tokens=MAX_TOTAL_TOKENS, **SPEC_OPTIONS) as eng:
        yield eng


def spec_counters(stack: Stack) -> dict[str, float]:
    text = stack.worker.scrape()
    return {name: metric_value(text, name, f'model_name="{DEFAULT_MODEL_NAME}"') for name in SPEC_COUNTERS}


def generate(stack: Stack, prompt: str, sampling: dict[str, Any], stream: bool = False) -> httpx.Response:
    body = {"text": prompt, "sampling_params": sampling, "stream": stream}
    response = httpx.post(f"{stack.gateway.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def assert_same_acceptance(meta: dict[str, Any], reference: dict[str, Any]) -> None:
    assert {k: meta[k] for k in SPEC_KEYS} == {k: reference[k] for k in SPEC_KEYS}
    assert 1.0 <= meta["spec_accept_length"] <= K + 1
    assert 0.0 <= meta["spec_accept_rate"] <= 1.0


def test_generate_meta_info_has_the_offline_engines_acceptance(stack: Stack, engine: Engine) -> None:
    expected = engine.generate(CAT, GREEDY)
    before = spec_counters(stack)
    result = generate(stack, CAT, GREEDY).json()
    after = spec_counters(stack)

    assert result["output_ids"] == expected["output_ids"]
    meta = result["meta_info"]
    assert_same_acceptance(meta, expected["meta_info"])
    assert meta["spec_accept_length"] > 1.0  # the repetition was found: some drafts were accepted
    # The worker's counters for this one request give back the same two numbers.
    delta = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    steps = delta["rs_worker_spec_verify_steps_total"]
    accepted = delta["rs_worker_spec_accepted_tokens_total"]
    proposed = delta["rs_worker_spec_proposed_tokens_total"]
    assert steps > 0 and proposed > 0 and accepted > 0
    assert (accepted + steps) / steps == pytest.approx(meta["spec_accept_length"])
    assert accepted / proposed == pytest.approx(meta["spec_accept_rate"])
    assert delta["rs_worker_spec_accept_length_count"] == 1
    assert delta["rs_worker_spec_accept_length_sum"] == pytest.approx(meta["spec_accept_length"])


def test_streamed_generate_reports_acceptance_on_the_last_chunk_only(stack: Stack, engine: Engine) -> None:
    expected = engine.generate(COUNTING, GREEDY)
    response = generate(stack, COUNTING, GREEDY, stream=True)
    events = [e[6:] for e in response.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 1
    assert chunks[-1]["output_ids"] == expected["output_ids"]
    assert_same_acceptance(chunks[-1]["meta_info"], expected["meta_info"])
    for chunk in chunks[:-1]:
        assert chunk["meta_info"]["finish_reason"] is None
        assert not set(SPEC_KEYS) & set(chunk["meta_info"])


def test_nats_front_door_final_chunk_carries_acceptance(stack: Stack, engine: Engine) -> None:
    expected = engine.generate(COLORS, GREEDY)

    request = NatsGenerateRequest(v=PROTOCOL_VERSION, text=COLORS, sampling=Sampling(**GREEDY))
    chunks = nats_generate(stack.nats.url, request)
    final = chunks[-1]
    assert final.error is None
    assert [t for c in chunks for t in c.token_ids] == expected["output_ids"]
    assert_same_acceptance(msgspec.to_builtins(final), expected["meta_info"])
    assert all(c.spec_accept_length is None and c.spec_accept_rate is None for c in chunks[:-1])


def test_a_request_without_a_speculative_step_has_no_acceptance_keys(stack: Stack, engine: Engine) -> None:
    """One token comes from the prefill alone: no decode step ran, so nothing was speculated (the
    same as a worker without speculation: the scheduler reports no numbers for either)."""
    one = {"temperature": 0, "max_new_tokens": 1}
    expected = engine.generate("Hello there, how are", one)
    result = generate(stack, "Hello there, how are", one).json()
    assert result["output_ids"] == expected["output_ids"]
    assert result["meta_info"]["finish_reason"] == {"type": "length", "matched": 1}
    assert not set(SPEC_KEYS) & set(expected["meta_info"])
    assert not set(SPEC_KEYS) & set(result["meta_info"])


def test_detokenizer_passes_acceptance_to_the_final_stream_out(default_model_path: Path) -> None:
    """The Detokenizer both the standalone service and a worker's `--with-detokenizer` run."""
    detok = Detokenizer(AutoTokenizer.from_pretrained(default_model_path))
    first = TokenOut(rid="r", gateway_id="g", token_ids=[28], first=True)
    final = TokenOut(
        rid="r", gateway_id="g", token_ids=[29, 30], finish=Finish("length", matched=3),
        usage=Usage(prompt_tokens=5, completion_tokens=3, spec_accept_length=2.0, spec_accept_rate=0.25),
    )
    (head,) = detok.process(BatchTokenOut(v=PROTOCOL_VERSION, worker_id="w", step=1, items=[first]))["g"].items
    (tail,) = detok.process(BatchTokenOut(v=PROTOCOL_VERSION, worker_id="w", step=2, items=[final]))["g"].items
    assert head.usage is None
    assert (tail.usage.spec_accept_length, tail.usage.spec_accept_rate) == (2.0, 0.25)
