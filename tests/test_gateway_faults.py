"""Bad input and faults at the gateway, each with its status: malformed JSON or wrong types -> 400
naming the field; unknown model -> 404; too large -> 413; no worker or no tokenizer -> 503 within 5 s;
a worker that dies mid-stream -> an error event and a closed stream within 10 s, other workers'
requests untouched; a client that goes away -> its request is aborted on the worker.
Against a scripted pipeline (tests/gateway_helpers.FakePipeline) on a real nats-server."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from shared.natsd import NatsServer, start_nats_server
from shared.protocol import PROTOCOL_VERSION, BatchStreamOut, Finish, StreamOut, Usage
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, GatewayThread, serving_gateway, wait_for_workers

MB = 1024 * 1024


@pytest.fixture(scope="module")
def nats() -> Iterator[NatsServer]:
    with start_nats_server(max_payload=MB) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(nats: NatsServer, pipeline: FakePipeline) -> Iterator[GatewayThread]:
    with serving_gateway(nats.url, first_output_timeout=1.0) as gw:
        yield gw


def error_of(response: httpx.Response) -> tuple[int, str | None, str]:
    error = response.json()["error"]
    return response.status_code, error["param"], error["message"]


def chat(content: object, **fields: object) -> dict[str, object]:
    return {"model": FAKE_MODEL, "messages": [{"role": "user", "content": content}], **fields}


def test_malformed_json_is_400(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    status, param, message = error_of(response)
    assert (status, param) == (400, "body")
    assert "not valid JSON" in message


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", chat(5), "messages.0.content"),
        ("/v1/chat/completions", chat("hi", temperature="hot"), "temperature"),
        ("/v1/chat/completions", chat("hi", stream="yes"), "stream"),
        ("/v1/chat/completions", {"model": FAKE_MODEL}, "messages"),
        ("/v1/completions", {"model": FAKE_MODEL, "prompt": "hi", "max_tokens": "7"}, "max_tokens"),
        ("/generate", {"text": "hi", "sampling_params": {"top_k": 1.5}}, "sampling_params.top_k"),
        ("/generate", {"text": "hi", "sampling_params": {"structural_tag": "x"}}, "sampling_params.structural_tag"),
    ],
)
def test_wrong_types_are_400_naming_the_field(http: httpx.Client, path: str, body: dict[str, object], field: str) -> None:
    status, param, message = error_of(http.post(path, json=body))
    assert (status, param) == (400, field)
    assert message.startswith(field)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (chat("hi", top_p=2.0), "top_p"),
        (chat("hi", temperature=-1), "temperature"),
        (chat("hi", top_k=0), "top_k"),
        (chat("hi", max_tokens=-1), "max_tokens"),
        (chat("hi", n=0), "n"),
        (chat("hi", top_logprobs=2), "top_logprobs"),
        (chat("hi", stop=[""]), "stop"),
        (chat([{"type": "image_url", "image_url": {"url": "x"}}]), "messages.0.content.0.type"),
    ],
)
def test_out_of_range_values_are_400_naming_the_field(http: httpx.Client, body: dict[str, object], field: str) -> None:
    status, param, _ = error_of(http.post("/v1/chat/completions", json=body))
    assert (status, param) == (400, field)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


@pytest.mark.parametrize(
    ("path", "body", "field", "message"),
    [
        ("/v1/chat/completions", chat("hi", tools=[TOOL]), "tools", "tools need a gateway started with --tool-call-parser"),
        ("/v1/chat/completions", chat("hi", tool_choice="required"), "tool_choice", "tool_choice 'required' needs tools"),
        ("/v1/chat/completions", chat("hi", tools=[TOOL], tool_choice="any"), "tools",
         "tools need a gateway started with --tool-call-parser"),
        ("/v1/chat/completions", chat("hi", functions=[TOOL["function"]]), "functions", "functions are not supported"),
        ("/v1/chat/completions", chat("hi", function_call="auto"), "function_call", "function_call is not supported"),
        ("/v1/chat/completions", chat("hi", modalities=["text", "audio"]), "modalities", "only text output"),
        ("/v1/chat/completions", chat("hi", audio={"voice": "x", "format": "wav"}), "audio", "only text output"),
        ("/v1/chat/completions", chat("hi", response_format={"type": "xml"}), "response_format",
         "response_format type must be text, json_object or json_schema, got 'xml'"),
        ("/v1/chat/completions", chat("hi", response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format", 'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}'),
        ("/v1/chat/completions",
         chat("hi", response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}),
         "response_format", "json_schema cannot be compiled: Invalid type: nonsense"),
        ("/v1/completions", {"model": FAKE_MODEL, "prompt": "a", "regex": "[a-"}, "regex",
         "regex cannot be compiled: at 1(8): invalid regex"),
        ("/v1/completions", {"model": FAKE_MODEL, "prompt": "a", "ebnf": "root ::= foo"}, "ebnf",
         "ebnf is not a grammar llguidance can read: Failed to convert the grammar from GBNF to Lark: Rule 'foo' not found"),
        ("/v1/chat/completions", chat("hi", response_format={"type": "json_object"}, regex="a+"), "regex",
         "response_format and regex cannot be combined: one constraint per request"),
        ("/v1/completions", {"model": FAKE_MODEL, "prompt": "a", "suffix": "z"}, "suffix", "suffix is not supported"),
        ("/v1/completions", {"model": FAKE_MODEL, "prompt": "a", "best_of": 3}, "best_of",
         "best_of is not supported (ask for n choices instead), got best_of 3 with n 1"),
    ],
)
def test_what_the_gateway_cannot_honour_is_400_naming_it(
    http: httpx.Client, path: str, body: dict[str, object], field: str, message: str
) -> None:
    """Parameters that would change the answer but have no implementation here are refused, not
    ignored; their harmless forms pass (below)."""
    status, param, text = error_of(http.post(path, json=body))
    assert (status, param) == (400, field)
    assert message in text


def test_the_harmless_forms_of_unsupported_parameters_pass(http: httpx.Client) -> None:
    for body in (chat("a b", function_call="none", modalities=["text"], response_format={"type": "text"}, tools=[]),
                 chat("a b", tools=[TOOL], tool_choice="none")):
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    for best_of in (1, 2):
        body = {"model": FAKE_MODEL, "prompt": "a", "n": 2, "best_of": best_of, "max_tokens": 2}
        assert len(http.post("/v1/completions", json=body).json()["choices"]) == 2


def test_tokenize_without_a_tokenizer_is_503_and_bad_bodies_are_400(http: httpx.Client) -> None:
    """The fake pipeline serves no {p}.tokenize.text, and this gateway has no tokenizer of its own."""
    status, _, message = error_of(http.post("/tokenize", json={"prompt": "hello"}))
    assert status == 503 and "no tokenizer answered on rs.tokenize.text" in message
    assert error_of(http.post("/tokenize", json={}))[:2] == (400, "prompt")
    assert error_of(http.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}))[:2] == (400, "prompt")
    assert error_of(http.post("/detokenize", json={"tokens": ["x"]}))[0] == 400
    kwargs_alone = error_of(http.post("/tokenize", json={"prompt": "a", "chat_template_kwargs": {"x": 1}}))
    assert kwargs_alone == (400, "chat_template_kwargs", "chat_template_kwargs apply to chat messages only")


def test_unknown_model_is_404(http: httpx.Client) -> None:
    status, param, message = error_of(http.post("/v1/chat/completions", json=chat("hi") | {"model": "gpt-9"}))
    assert (status, param) == (404, "model")
    assert FAKE_MODEL in message
    assert http.get("/v1/models/gpt-9").status_code == 404


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    response = http.post("/generate", json={"text": "x" * (2 * MB)})
    assert response.status_code == 413
    assert "limit" in response.json()["error"]["message"]


def test_request_over_nats_max_payload_is_413(nats: NatsServer, pipeline: FakePipeline) -> None:
    gw = GatewayThread(nats.url, max_request_bytes=4 * MB)
    try:
        response = httpx.post(f"{gw.url}/generate", json={"text": "x" * (2 * MB)}, timeout=10)
    finally:
        gw.close()
    assert response.status_code == 413
    assert "max_payload" in response.json()["error"]["message"]


def test_prompt_refused_by_the_pipeline_is_400_with_its_message(http: httpx.Client) -> None:
    status, _, message = error_of(http.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "ERROR long"}))
    assert status == 400
    assert "too long" in message
    # The services name the prompt `text` (or `messages`, `input_ids`); the client sent `prompt`.
    reply = http.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "ERROR long"})
    assert (reply.json()["error"]["param"], reply.json()["error"]["message"]) == (
        "prompt", "the prompt has 9999 tokens; the model's context is 64 (`prompt` too long)")
    chat = http.post("/v1/chat/completions", json={"model": FAKE_MODEL, "messages": [{"role": "user", "content": "ERROR"}]})
    assert (chat.status_code, chat.json()["error"]["param"]) == (400, "messages")
    assert "(`messages` too long)" in chat.json()["error"]["message"]
    native = http.post("/generate", json={"text": "ERROR long"})
    assert (native.status_code, native.json()["error"]["param"]) == (400, "text")
    # Streaming too: the response starts only once the first output is known.
    streamed = http.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "ERROR long", "stream": True})
    assert streamed.status_code == 400


def test_a_workers_5xx_error_final_is_that_status_on_every_form_and_a_bad_status_is_400(
    http: httpx.Client, pipeline: FakePipeline,
) -> None:
    """An error final marked 503 by a worker (shutting down) is the server's doing: 503, not 400."""
    status, _, message = error_of(http.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "DOWN now"}))
    assert (status, message) == (503, "worker w1 is shutting down")
    streamed = http.post("/v1/chat/completions", json={"model": FAKE_MODEL, "stream": True,
                                                       "messages": [{"role": "user", "content": "DOWN now"}]})
    assert streamed.status_code == 503
    assert http.post("/generate", json={"text": "DOWN now"}).status_code == 503
    # Only an HTTP error status is taken from the pipeline: anything else is the default 400.
    for bogus in (200, 99, 700):
        pipeline.down_status = bogus
        assert http.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "DOWN now"}).status_code == 400
    pipeline.down_status = 503


def test_no_worker_is_503_within_5_s(nats: NatsServer) -> None:
    gw = GatewayThread(nats.url, subject_prefix="empty")
    try:
        response = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hi"}, timeout=5)
    finally:
        gw.close()
    assert response.status_code == 503
    assert "no live worker" in response.json()["error"]["message"]


def test_no_tokenizer_is_503_at_once(nats: NatsServer) -> None:
    """A text prompt with no tokenizer service: 503 at once. A prompt of token ids needs none: it goes
    from the gateway straight to its worker and is answered."""
    fake = FakePipeline(nats.url, workers=("lonely",), prefix="notok", with_tokenizer=False)
    gw = GatewayThread(nats.url, subject_prefix="notok")
    try:
        wait_for_workers(gw.url, 1)
        response = httpx.post(f"{gw.url}/generate", json={"text": "hi"}, timeout=5)
        ids = httpx.post(f"{gw.url}/generate", json={"input_ids": [7, 8, 9]}, timeout=5)
    finally:
        gw.close()
        fake.close()
    assert response.status_code == 503
    assert "no tokenizer" in response.json()["error"]["message"]
    assert ids.status_code == 200, ids.text
    assert ids.json()["text"] == "t7 t8 t9 " and ids.json()["meta_info"]["finish_reason"]["type"] == "stop"


def test_a_request_without_any_output_ends_with_504(http: httpx.Client) -> None:
    status, _, message = error_of(http.post("/generate", json={"text": "SILENT please"}))
    assert status == 504
    assert "no output" in message


def test_worker_killed_mid_stream_ends_its_streams_only(nats: NatsServer) -> None:
    """With migration off (--max-migrations 0), a killed worker's streams end with a 503 within ~2 s of
    its death (its subscriptions are gone: NATS has no responders for the gateway's probe)."""
    fake = FakePipeline(nats.url, workers=("k1", "k2"), prefix="kill")
    gw = GatewayThread(nats.url, subject_prefix="kill", max_migrations=0)
    try:
        wait_for_workers(gw.url, 2)
        with httpx.Client(base_url=gw.url, timeout=10) as a, httpx.Client(base_url=gw.url, timeout=10) as b:
            body = {"model": FAKE_MODEL, "stream": True, "max_tokens": 5}
            with a.stream("POST", "/v1/completions", json=body | {"prompt": "HANG a"}) as doomed, b.stream(
                "POST", "/v1/completions", json=body | {"prompt": "HANG b"}
            ) as spared:
                doomed_lines, spared_lines = doomed.iter_lines(), spared.iter_lines()
                assert json.loads(next(doomed_lines)[6:])["choices"][0]["text"] == "HANG "
                assert json.loads(next(spared_lines)[6:])["choices"][0]["text"] == "HANG "
                (victim,) = {r.worker_id for r in fake.requests if r.text == "HANG a"}
                fake.kill_worker(victim)
                # The read timeout (10 s) bounds how long the error may take.
                events = [line[6:] for line in doomed_lines if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert f"worker {victim} is gone" in json.loads(events[-2])["error"]["message"]
                (spared_rid,) = [r.rid for r in fake.requests if r.text == "HANG b"]
                assert spared_rid in fake.in_flight("k2" if victim == "k1" else "k1")
                httpx.post(f"{gw.url}/abort_request", json={"rid": spared_rid}, timeout=5)
                rest = [json.loads(line[6:]) for line in spared_lines if line.startswith("data: {")]
                assert rest[-1]["choices"][0]["finish_reason"] == "abort"
        metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
        assert f'rs_gateway_requests_total{{endpoint="/v1/completions",model_name="{FAKE_MODEL}",status="503"}} 1.0' in metrics
    finally:
        gw.close()
        fake.close()


def test_sse_disconnect_aborts_the_request_on_its_worker(gateway: GatewayThread, pipeline: FakePipeline) -> None:
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        with client.stream("POST", "/generate", json={"text": "HANG up", "rid": "gone-sse", "stream": True}) as response:
            assert json.loads(next(response.iter_lines())[6:])["text"] == "HANG "
    pipeline.wait_until(lambda: ("w1", "gone-sse") in pipeline.aborts)
    pipeline.wait_until(lambda: "gone-sse" not in pipeline.in_flight("w1"))


def test_non_streaming_disconnect_aborts_the_request(gateway: GatewayThread, pipeline: FakePipeline) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/generate", json={"text": "HANG still", "rid": "gone-plain"}, timeout=0.5)
    pipeline.wait_until(lambda: ("w1", "gone-plain") in pipeline.aborts)
    counted = f'endpoint="/generate",model_name="{FAKE_MODEL}",status="499"'
    pipeline.wait_until(lambda: counted in httpx.get(f"{gateway.url}/metrics").text)


@pytest.mark.parametrize("service", ["gateway", "tokenizer", "detokenizer"])
def test_a_service_without_nats_exits_1_naming_the_url(service: str, request: pytest.FixtureRequest) -> None:
    import subprocess
    import sys

    args = ["--nats-url", "nats://127.0.0.1:1", "--nats-connect-timeout", "1"]
    if service == "gateway":
        args += ["--port", "0", "--grpc-port", "0"]
    else:
        # The tokenizer and detokenizer load their tokenizer first: on a machine where the default model
        # was never fetched they would exit for that instead, so they get it (fetched here if missing).
        args += ["--model-path", str(request.getfixturevalue("default_model_path"))]
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", service, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "NATS at nats://127.0.0.1:1 is unreachable" in done.stdout + done.stderr


def test_a_final_with_negative_counts_ends_its_request_and_spares_the_rest_of_its_batch(
    gateway: GatewayThread, pipeline: FakePipeline
) -> None:
    """A malformed stream message (a final with negative token counts) beside a good item: both
    requests end as their items say; nothing in the gateway raises."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        odd = pool.submit(httpx.post, f"{gateway.url}/generate", json={"text": "HANG odd", "rid": "neg-1"}, timeout=10)
        fine = pool.submit(httpx.post, f"{gateway.url}/generate", json={"text": "HANG fine", "rid": "neg-2"}, timeout=10)
        pipeline.wait_until(lambda: {"neg-1", "neg-2"} <= set(pipeline.in_flight("w1")))
        forged = BatchStreamOut(v=PROTOCOL_VERSION, items=[
            StreamOut(rid="neg-1", text="", token_ids=[], finish=Finish(type="stop"),
                      usage=Usage(prompt_tokens=-5, completion_tokens=-7, cached_tokens=-1)),
            StreamOut(rid="neg-2", text="", token_ids=[], finish=Finish(type="stop"),
                      usage=Usage(prompt_tokens=2, completion_tokens=1)),
        ])
        pipeline.thread.run(pipeline.bus.publish(pipeline.bus.subjects.gateway_stream(gateway.config.gateway_id), forged))
        answers = [odd.result(), fine.result()]
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.json()["meta_info"]["finish_reason"]["type"] for a in answers] == ["stop", "stop"]
    for rid in ("neg-1", "neg-2"):
        httpx.post(f"{gateway.url}/abort_request", json={"rid": rid}, timeout=5)


def test_a_gateway_that_fails_to_start_leaves_no_thread_behind(nats: NatsServer) -> None:
    """Its event loop's thread, with what the service had started (its NATS connection), would run on
    past the test and log into whatever the test run has closed by then."""
    before = set(threading.enumerate())
    with pytest.raises(ConnectionError, match="unreachable"):
        GatewayThread(nats.url, subject_prefix="nostart", redis_url="redis://127.0.0.1:1")
    assert not [t.name for t in threading.enumerate() if t not in before and t.name.startswith("gateway-")]
