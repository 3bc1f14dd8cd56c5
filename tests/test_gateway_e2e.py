"""The whole pipeline as real processes on a real nats-server, through the gateway's every door:
three gateways (one tokenizing every prompt itself, one the short ones), one tokenizer, two workers
(each detokenizing in-process) serving the embedded default `openai` client, httpx on the native API, generated gRPC stubs and nats-py; greedy answers equal the
offline Engine's. The last test kills a worker, so it stays last.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.protos import radixserve_pb2, radixserve_pb2_grpc
from services.worker.frontend.engine import Engine
from shared.natsd import NatsServer, start_nats_server
from shared.protocol import PROTOCOL_VERSION, NatsGenerateRequest, Sampling
from tests.gateway_helpers import nats_generate, wait_for_workers
from tests.services_helpers import ServiceProcess

QUESTION = "What is the capital of France?"
GREEDY_TOKENS = 24
WORKERS = ("w1", "w2")
LOCAL_MAX_CHARS = 600


@dataclass
class Gateway:
    process: ServiceProcess
    url: str
    grpc_target: str


@dataclass
class Stack:
    nats: NatsServer
    gateways: list[Gateway]
    workers: dict[str, ServiceProcess]
    model: str
    tokenizer: ServiceProcess


def _gateway_addresses(process: ServiceProcess) -> tuple[str, str]:
    match = re.search(r"HTTP on (http://[\d.]+:\d+) \(httptools\), gRPC on ([\d.]+:\d+)", process.log())
    assert match, f"the gateway logged no addresses:\n{process.log()[-2000:]}"
    return match.group(1), match.group(2)


@pytest.fixture(scope="module")
def stack(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("gateway_e2e_logs")
    nats_server = start_nats_server()
    common = ["--nats-url", nats_server.url, "--metrics-port", "0"]
    model = ["--model-path", str(default_model_path)]
    with pytest.MonkeyPatch.context() as env:
        # Two model processes share the test machine's cores: one thread each, no oversubscription.
        env.setenv("OMP_NUM_THREADS", "1")
        processes = [ServiceProcess.start("tokenizer", [*common, *model], log_dir)]
        workers = {
            wid: ServiceProcess.start(
                "worker", [*common, *model, "--worker-id", wid, "--with-detokenizer", "--max-total-tokens", "8192"],
                log_dir, label=wid,
            )
            for wid in WORKERS
        }
        # g2 tokenizes the default model's requests itself (--local-tokenizer); g1 uses the tokenizer
        # service; g3 tokenizes prompts up to LOCAL_MAX_CHARS itself and sends longer ones to the service.
        # g2 also reads tool calls (--tool-call-parser).
        local = {"g1": [], "g2": ["--local-tokenizer", str(default_model_path), "--tool-call-parser", "qwen3"],
                 "g3": ["--local-tokenizer", str(default_model_path), "--local-tokenizer-max-chars", str(LOCAL_MAX_CHARS)]}
        gateway_processes = [
            ServiceProcess.start(
                "gateway", [*common, "--gateway-id", gid, "--port", "0", "--grpc-port", "0", *local[gid]],
                log_dir, label=gid,
            )
            for gid in ("g1", "g2", "g3")
        ]
    processes += [*workers.values(), *gateway_processes]
    try:
        for process in processes:
            process.wait_ready()
        gateways = [Gateway(p, *_gateway_addresses(p)) for p in gateway_processes]
        for gateway in gateways:
            wait_for_workers(gateway.url, len(WORKERS), timeout=30)
        yield Stack(nats_server, gateways, workers, default_model_path.name, processes[0])
    finally:
        for process in processes:
            process.kill()
        nats_server.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateways[0].url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_chat_says_paris_exactly_like_the_offline_engine(client: openai.OpenAI, stack: Stack, engine: Engine) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model=stack.model, messages=messages, temperature=0, max_tokens=GREEDY_TOKENS)
    expected = engine.generate(engine.apply_chat_template(messages), {"temperature": 0, "max_new_tokens": GREEDY_TOKENS})
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].message.content == expected["text"]
    assert reply.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    assert reply.usage.completion_tokens == expected["meta_info"]["completion_tokens"]
    streamed = client.chat.completions.create(
        model=stack.model, messages=messages, temperature=0, max_tokens=GREEDY_TOKENS, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    # The same prompt again: its prefix is in the radix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_logit_bias_steers_the_answer_as_in_the_offline_engine(client: openai.OpenAI, stack: Stack, engine: Engine) -> None:
    """Banning the greedy answer's first two tokens (-100) gives another answer, the Engine's with the
    same bias, through tokenizer, worker and detokenizer."""
    messages = [{"role": "user", "content": QUESTION}]
    prompt = engine.apply_chat_template(messages)
    free = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 8})
    bias = {str(t): -100 for t in free["output_ids"][:2]}
    expected = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 8, "logit_bias": bias})
    reply = client.chat.completions.create(model=stack.model, messages=messages, temperature=0, max_tokens=8,
                                           logit_bias=bias)
    assert expected["output_ids"][0] not in free["output_ids"][:2]
    assert reply.choices[0].message.content == expected["text"] != free["text"]


def test_response_format_json_schema_answers_as_the_offline_engine(client: openai.OpenAI, stack: Stack, engine: Engine) -> None:
    """The schema travels gateway -> tokenizer -> worker; the answer is the Engine's under the same
    schema, an object of that schema, where the free answer is prose."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": QUESTION + " Answer in JSON."}]
    expected = engine.generate(engine.apply_chat_template(messages),
                               {"temperature": 0, "max_new_tokens": 30, "json_schema": json.dumps(schema)})
    reply = client.chat.completions.create(
        model=stack.model, messages=messages, temperature=0, max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    assert reply.choices[0].message.content == expected["text"]
    assert json.loads(expected["text"]) == {"city": "Paris"}
    assert reply.choices[0].finish_reason == "stop"


def test_tool_choice_required_gets_a_call_through_the_pipeline(stack: Stack) -> None:
    """g2 reads tool calls: forced by tool_choice, the default model's answer is a call, whole and
    streamed. One call (parallel_tool_calls false): allowed more, this untrained model repeats it."""
    g2 = openai.OpenAI(base_url=f"{stack.gateways[1].url}/v1", api_key="unused", max_retries=0, timeout=60)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}
    args = dict(model=stack.model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=[tool], tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=40)
    reply = g2.chat.completions.create(**args)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and not reply.choices[0].message.content
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    chunks = list(g2.chat.completions.create(**args, stream=True))
    streamed = [c for chunk in chunks if chunk.choices for c in (chunk.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [(call.function.name, call.function.arguments)]


def test_tokenize_and_detokenize_through_the_service_and_a_local_tokenizer(stack: Stack, engine: Engine) -> None:
    """g1 asks the tokenizer service ({p}.tokenize.text), g2 tokenizes itself: both answer as the
    Engine's tokenizer does. Bad ids are a 400 naming tokens; an unknown model a 404."""
    messages = [{"role": "user", "content": QUESTION}]
    expected_chat = engine.tokenizer.encode(engine.apply_chat_template(messages), add_special_tokens=False)
    expected_text = engine.tokenizer.encode(QUESTION)
    for gateway in stack.gateways[:2]:
        text = httpx.post(f"{gateway.url}/tokenize", json={"prompt": QUESTION}, timeout=30).json()
        assert text["tokens"] == expected_text and text["count"] == len(expected_text)
        assert text["max_model_len"] == engine.model_config.context_len
        chat = httpx.post(f"{gateway.url}/tokenize", json={"model": stack.model, "messages": messages}, timeout=30)
        assert chat.json()["tokens"] == expected_chat
        back = httpx.post(f"{gateway.url}/detokenize", json={"tokens": expected_text}, timeout=30).json()
        assert back["prompt"] == engine.tokenizer.decode(expected_text) == QUESTION
        bad = httpx.post(f"{gateway.url}/detokenize", json={"tokens": [10**7]}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        unknown = httpx.post(f"{gateway.url}/tokenize", json={"model": "nope", "prompt": "x"}, timeout=30)
        assert unknown.status_code == 404


def test_openai_completions_n2_logprobs_stop_and_usage(client: openai.OpenAI, stack: Stack, engine: Engine) -> None:
    prompt = "The three primary colors are"
    free = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    # The reference text is the decoded ids (the Engine's own text drops a length-finished last token).
    free_text = engine.tokenizer.decode(free["output_ids"], skip_special_tokens=True)
    stop = free_text[len(free_text) // 2 :][:3]
    reply = client.completions.create(
        model=stack.model, prompt=prompt, n=2, temperature=0, max_tokens=16, stop=[stop], logprobs=2,
        extra_body={"ignore_eos": True},
    )
    expected_text = free_text[: free_text.index(stop)]
    assert [c.text for c in reply.choices] == [expected_text, expected_text]
    assert [c.finish_reason for c in reply.choices] == ["stop", "stop"]
    per_choice = reply.usage.completion_tokens // 2
    for choice in reply.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == per_choice
        assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
        assert "".join(choice.logprobs.tokens).startswith(expected_text)
    streamed = client.completions.create(model=stack.model, prompt=prompt, temperature=0, max_tokens=16, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == free_text


def test_native_generate_streams_the_same_text_it_returns(stack: Stack) -> None:
    body = {"text": "Once upon a time", "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
    url = stack.gateways[1].url
    whole = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    streamed = httpx.post(f"{url}/generate", json=body | {"stream": True}, timeout=60)
    events = [e[6:] for e in streamed.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_prompt_longer_than_the_context_is_400(stack: Stack) -> None:
    response = httpx.post(f"{stack.gateways[0].url}/v1/completions", json={"prompt": [5] * 9000}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "(`prompt` too long)" in error["message"] and error["param"] == "prompt"


def test_grpc_generate_streams_and_health_serves(stack: Stack) -> None:
    reference = httpx.post(
        f"{stack.gateways[0].url}/generate",
        json={"text": "The sky is", "sampling_params": {"temperature": 0, "max_new_tokens": 10}}, timeout=60,
    ).json()
    with grpc.insecure_channel(stack.gateways[1].grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="radixserve.v1.RadixServe"), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = radixserve_pb2.GenerateRequest(
            text="The sky is", sampling_params=radixserve_pb2.SamplingParams(temperature=0, max_new_tokens=10)
        )
        responses = list(radixserve_pb2_grpc.RadixServeStub(channel).Generate(request, timeout=60))
    assert len(responses) > 1 and responses[-1].final
    assert "".join(r.text for r in responses) == reference["text"]
    assert [t for r in responses for t in r.token_ids] == reference["output_ids"]


def test_nats_client_on_v1_generate(stack: Stack) -> None:
    request = NatsGenerateRequest(
        v=PROTOCOL_VERSION, text="The sky is", sampling=Sampling(temperature=0.0, max_new_tokens=10)
    )
    chunks = nats_generate(stack.nats.url, request, timeout=60)
    reference = httpx.post(
        f"{stack.gateways[0].url}/generate",
        json={"text": "The sky is", "sampling_params": {"temperature": 0, "max_new_tokens": 10}}, timeout=60,
    ).json()
    assert chunks[-1].error is None
    assert "".join(c.text for c in chunks) == reference["text"]
    assert chunks[-1].completion_tokens == len(reference["output_ids"])


def test_a_gateway_with_a_local_tokenizer_answers_alike_without_the_tokenizer_service(
    stack: Stack, engine: Engine
) -> None:
    local = openai.OpenAI(base_url=f"{stack.gateways[1].url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": QUESTION}]
    reply = local.chat.completions.create(model=stack.model, messages=messages, temperature=0, max_tokens=8)
    expected = engine.generate(engine.apply_chat_template(messages), {"temperature": 0, "max_new_tokens": 8})
    assert reply.choices[0].message.content == expected["text"]
    assert reply.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    # A text prompt longer than the context: 400 naming the field from either gateway, but only g0's
    # went through the tokenizer service (which logs every refusal with the request id).
    tokenizer = stack.tokenizer
    too_long = "word " * 9000  # 9,000 tokens; the context is 8,192
    for gateway, rid in ((stack.gateways[1], "local-bad"), (stack.gateways[0], "remote-bad")):
        response = httpx.post(f"{gateway.url}/generate", json={"text": too_long, "rid": rid}, timeout=30)
        assert response.status_code == 400, response.text
        assert "`text` too long" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "text"
    _wait_for_line(tokenizer, "remote-bad")
    assert "local-bad" not in tokenizer.log()
    # Token ids have nothing to tokenize: g0 sends them straight to a worker, which refuses ids outside
    # the vocabulary with the same 400 (and logs it); g1 checks them against its own copy of the model's
    # vocabulary. The tokenizer service sees neither.
    vocab = engine.model_config.vocab_size
    for gateway, rid in ((stack.gateways[1], "local-ids-bad"), (stack.gateways[0], "remote-ids-bad")):
        response = httpx.post(f"{gateway.url}/generate", json={"input_ids": [5, vocab + 7], "rid": rid}, timeout=30)
        assert response.status_code == 400, response.text
        assert "`input_ids` holds a token id outside" in response.json()["error"]["message"]
    workers = list(stack.workers.values())
    _wait_for_line(workers, "remote-ids-bad")
    assert not any("local-ids-bad" in w.log() for w in workers)
    assert "ids-bad" not in tokenizer.log()


def _tokenizer_ok_count(tokenizer: ServiceProcess) -> float:
    """rs_tokenizer_requests_total{model_name=...,status="ok"}: requests the tokenizer service forwarded to a worker."""
    url = re.search(r"metrics at http://[\d.]+:(\d+)/metrics", tokenizer.log())
    assert url, "the tokenizer logged no metrics port"
    text = httpx.get(f"http://127.0.0.1:{url.group(1)}/metrics", timeout=10).text
    match = re.search(r'^rs_tokenizer_requests_total\{model_name="[^"]+",status="ok"\} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_gateway_tokenizes_short_prompts_and_leaves_long_ones_to_the_tokenizer_service(
    stack: Stack, engine: Engine
) -> None:
    g3 = stack.gateways[2]
    assert f"up to {LOCAL_MAX_CHARS} characters" in g3.process.log()
    client = openai.OpenAI(base_url=f"{g3.url}/v1", api_key="unused", max_retries=0, timeout=60)
    forwarded = _tokenizer_ok_count(stack.tokenizer)
    # A short chat: tokenized in g3, never seen by the tokenizer service, the Engine's greedy answer.
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model=stack.model, messages=messages, temperature=0, max_tokens=8)
    expected = engine.generate(engine.apply_chat_template(messages), {"temperature": 0, "max_new_tokens": 8})
    assert reply.choices[0].message.content == expected["text"]
    assert _tokenizer_ok_count(stack.tokenizer) == forwarded
    # Past the limit (text, then a chat whose messages together pass it): through the tokenizer service,
    # with the same answer as the Engine's.
    long_text = "The sky over the quiet harbour was a pale and even blue. " * 12
    assert LOCAL_MAX_CHARS < len(long_text) < 2 * LOCAL_MAX_CHARS
    reply = client.completions.create(model=stack.model, prompt=long_text, temperature=0, max_tokens=6)
    expected = engine.generate(long_text, {"temperature": 0, "max_new_tokens": 6})
    assert reply.choices[0].text == expected["text"]
    assert reply.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    assert _tokenizer_ok_count(stack.tokenizer) == forwarded + 1
    messages = [{"role": "user", "content": long_text[:400]}, {"role": "assistant", "content": "Go on."},
                {"role": "user", "content": long_text[:300]}]
    reply = client.chat.completions.create(model=stack.model, messages=messages, temperature=0, max_tokens=4)
    expected = engine.generate(engine.apply_chat_template(messages), {"temperature": 0, "max_new_tokens": 4})
    assert reply.choices[0].message.content == expected["text"]
    assert _tokenizer_ok_count(stack.tokenizer) == forwarded + 2
    # A long prompt the model cannot take is refused by the tokenizer service (which logs it), still a 400.
    response = httpx.post(f"{g3.url}/generate", json={"text": "word " * 9000, "rid": "g3-too-long"}, timeout=30)
    assert response.status_code == 400, response.text
    assert "`text` too long" in response.json()["error"]["message"]
    _wait_for_line(stack.tokenizer, "g3-too-long")


def _wait_for_line(processes: ServiceProcess | list[ServiceProcess], text: str, timeout: float = 10.0) -> None:
    """Until one of the processes has logged `text`."""
    processes = processes if isinstance(processes, list) else [processes]
    deadline = time.monotonic() + timeout
    while not any(text in p.log() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(text in p.log() for p in processes), f"{text!r} is in no log of {[str(p.log_path) for p in processes]}"



def _worker_info(url: str, worker_id: str) -> dict[str, Any]:
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    return next(w["info"] for w in info["workers"] if w["worker_id"] == worker_id)


def _wait_for_idle_load_reports(url: str, timeout: float = 10.0) -> None:
    """Until every worker's latest WorkerLoad (what routing sees) shows nothing running or waiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = [w["load"] for w in httpx.get(f"{url}/get_server_info", timeout=30).json()["workers"]]
        if all(load["num_running"] == load["num_waiting"] == 0 for load in loads):
            return
        time.sleep(0.2)
    raise AssertionError("the workers did not report idle")


def test_client_disconnect_aborts_and_frees_the_kv(stack: Stack) -> None:
    url = stack.gateways[0].url
    body = {"text": "Count to ten thousand:", "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/generate", json=body) as response:
        worker = response.headers["x-radixserve-worker"]
        lines = response.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        busy = _worker_info(url, worker)
    assert busy["num_running"] == 1 and busy["kv_in_use"] > 0
    deadline = time.monotonic() + 10
    while (info := _worker_info(url, worker))["num_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (info["num_running"], info["kv_in_use"]) == (0, 0)


def test_two_gateways_and_two_workers_serve_concurrent_requests(stack: Stack, engine: Engine) -> None:
    # Prompts no earlier test sent (and sharing no prefix), so cache-aware routing has no worker's cache to
    # follow and spreads by load.
    prompts = ["List three fruits:", "Name two rivers:", "Describe a sunny sky:", "Write a haiku about snow:"]
    sampling = {"temperature": 0, "max_new_tokens": 12}
    expected = [out["text"] for out in engine.generate(prompts, sampling)]

    def ask(url_and_prompt: tuple[str, str]) -> tuple[str, str]:
        url, prompt = url_and_prompt
        response = httpx.post(f"{url}/generate", json={"text": prompt, "sampling_params": sampling}, timeout=60)
        return response.json()["text"], response.headers["x-radixserve-worker"]

    for gateway in stack.gateways:
        _wait_for_idle_load_reports(gateway.url)  # then each gateway sends its two to different workers
    jobs = list(zip([g.url for g in stack.gateways for _ in range(2)], prompts))
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    assert [text for text, _ in answers] == expected, answers
    assert {worker for _, worker in answers} == set(WORKERS), answers


def test_a_killed_workers_stream_moves_to_the_other_within_5_s_and_spares_the_others_stream(stack: Stack) -> None:
    url = stack.gateways[0].url
    _wait_for_idle_load_reports(url)  # then two requests in a row go to different workers
    body = {"model": stack.model, "prompt": "Count to ten thousand:", "stream": True, "max_tokens": 2000, "ignore_eos": True}
    spared_body = body | {"prompt": "Say hello:", "max_tokens": 40}  # no shared prefix to route by
    with httpx.Client(timeout=10) as a, httpx.Client(timeout=60) as b, contextlib.ExitStack() as streams:
        doomed = streams.enter_context(a.stream("POST", f"{url}/v1/completions", json=body))
        victim = doomed.headers["x-radixserve-worker"]
        # Routing is the router tests' subject, not this one's: a load report that lands between the
        # two requests can send the second to the same worker, so ask again (each one left behind is
        # aborted when its stream closes) until one goes to the other worker.
        for attempt in range(5):
            spared = streams.enter_context(b.stream("POST", f"{url}/v1/completions", json=spared_body))
            survivor = spared.headers["x-radixserve-worker"]
            if survivor != victim:
                break
            spared.close()
            spared_body = spared_body | {"prompt": f"Say hello {attempt}:"}
        assert victim != survivor
        doomed_lines = doomed.iter_lines()
        next(line for line in doomed_lines if line.startswith("data: "))
        stack.workers[victim].kill()
        killed_at = time.monotonic()
        # The stream goes on from the other worker: text again within 5 s, and no error event.
        while True:
            event = json.loads(next(line for line in doomed_lines if line.startswith("data: "))[6:])
            assert "error" not in event, event
            if event["choices"][0]["text"] and time.monotonic() - killed_at > 0.5:
                break
        assert time.monotonic() - killed_at < 5.0
        rest = [json.loads(line[6:]) for line in spared.iter_lines() if line.startswith("data: {")]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health", timeout=5).json()["workers"] != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    after = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert after.status_code == 200 and after.headers["x-radixserve-worker"] == survivor
    migrations = f'rs_gateway_migrations_total{{model_name="{stack.model}"}} 1.0'
    assert migrations in httpx.get(f"{url}/metrics", timeout=5).text


def test_sigterm_lets_a_running_stream_finish_and_the_gateway_exits_0(stack: Stack) -> None:
    gateway = stack.gateways[1]
    body = {"text": "Count to ten:", "stream": True, "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{gateway.url}/generate", json=body) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        gateway.process.proc.send_signal(signal.SIGTERM)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "length"
    assert gateway.process.terminate() == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{gateway.url}/health", timeout=5)
