"""JsonFastPath (services/gateway/app.py): POST /generate with a body FastAPI would accept is served
without FastAPI's routing, and answers exactly as FastAPI's route does; anything else reaches FastAPI
with its body untouched.

The middleware alone with stub apps, then a real gateway (a scripted pipeline on a real nats-server):
the same body sent as `application/json` (the fast path) and as `application/json; charset=utf-8`
(which the fast path leaves to FastAPI) gets the same status, headers and JSON.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from services.gateway.app import JsonFastPath
from services.gateway.native_api import GenerateBody
from tests.gateway_helpers import FAKE_MODEL as MODEL
from tests.gateway_helpers import GatewayThread

FAST = {"content-type": "application/json"}
VIA_FASTAPI = {"content-type": "application/json; charset=utf-8"}


# ---- the middleware alone ---------------------------------------------------------------------------


class Recorder:
    """The inner (FastAPI) app and the route function, each noting what reached it."""

    def __init__(self) -> None:
        self.inner_bodies: list[bytes] = []
        self.endpoint_bodies: list[GenerateBody] = []

    async def inner(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.inner_bodies.append((await receive())["body"])
        await Response("inner")(scope, receive, send)

    async def endpoint(self, body: GenerateBody, request: Request) -> Response:
        self.endpoint_bodies.append(body)
        return JSONResponse({"served": "fast"})


def call(app: JsonFastPath, method: str, path: str, body: bytes, content_type: bytes) -> list[Message]:
    scope = {"type": "http", "method": method, "path": path, "headers": [(b"content-type", content_type)], "state": {}}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_a_valid_body_is_served_by_the_route_function() -> None:
    recorder = Recorder()
    app = JsonFastPath(recorder.inner, routes={"/generate": (GenerateBody, recorder.endpoint)})
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}, "stream": True}
    sent = call(app, "POST", "/generate", json.dumps(body).encode(), b"application/json")
    assert recorder.inner_bodies == []
    (validated,) = recorder.endpoint_bodies
    assert (validated.input_ids, validated.sampling_params.max_new_tokens, validated.stream) == ([1, 2, 3], 0, True)
    assert json.loads(sent[-1]["body"]) == {"served": "fast"}


@pytest.mark.parametrize(
    ("method", "path", "body", "content_type"),
    [
        ("POST", "/generate", b'{"text": "hi", "sampling_params": {"top_k": 1.5}}', b"application/json"),
        ("POST", "/generate", b'{"text": "hi", "sampling_params": {"structural_tag": "x"}}', b"application/json"),
        ("POST", "/generate", b'{"text": "hi",', b"application/json"),
        ("POST", "/generate", b'["hi"]', b"application/json"),
        ("POST", "/generate", b"\xff\xfe", b"application/json"),
        # JSON that json.loads (FastAPI's parser) reads and msgspec (the fast path's) refuses: FastAPI's to answer
        ("POST", "/generate", b'\xef\xbb\xbf{"text": "hi"}', b"application/json"),
        ("POST", "/generate", b'{"text": "\\ud800"}', b"application/json"),
        ("POST", "/generate", b'{"text": "hi", "sampling_params": {"temperature": 1e400}}', b"application/json"),
        ("POST", "/generate", b'{"text": "hi"}', b"application/json; charset=utf-8"),
        ("POST", "/generate", b'{"text": "hi"}', b"text/plain"),
        ("PUT", "/generate", b'{"text": "hi"}', b"application/json"),
        ("POST", "/v1/completions", b'{"prompt": "hi"}', b"application/json"),
    ],
)
def test_anything_else_reaches_fastapi_with_its_body(method: str, path: str, body: bytes, content_type: bytes) -> None:
    recorder = Recorder()
    app = JsonFastPath(recorder.inner, routes={"/generate": (GenerateBody, recorder.endpoint)})
    sent = call(app, method, path, body, content_type)
    assert recorder.endpoint_bodies == []
    assert recorder.inner_bodies == [body]
    assert sent[-1]["body"] == b"inner"


# ---- a real gateway: the fast path against FastAPI's route -----------------------------------------------


@pytest.fixture(scope="module")
def http(gateway: GatewayThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=15) as client:
        yield client


def answer(
    http: httpx.Client, body: bytes, headers: dict[str, str], path: str = "/generate"
) -> tuple[int, dict[str, str], Any]:
    """Status, the headers a client relies on, and the JSON (a list of events for SSE) with the
    values that differ between any two requests (request ids, latencies, creation times) blanked."""
    response = http.post(path, content=body, headers=headers)
    kept = {k: response.headers.get(k, "") for k in ("content-type", "x-radixserve-worker", "cache-control")}
    kept["x-radixserve-gateway"] = str(bool(response.headers.get("x-radixserve-gateway")))
    if kept["content-type"].startswith("text/event-stream"):
        events = [e[len("data: ") :] for e in response.text.split("\n\n") if e.startswith("data: ")]
        payload: Any = [e if e == "[DONE]" else json.loads(e) for e in events]
    else:
        payload = response.json()
    return response.status_code, kept, blank(payload)


def blank(value: Any) -> Any:
    if isinstance(value, list):
        return [blank(v) for v in value]
    if isinstance(value, dict):
        return {k: "-" if k in ("id", "e2e_latency", "created") else blank(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize(
    "body",
    [
        {"text": "one two", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        {"text": "one two three", "stream": True},
        {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 2, "stream": True},
        {"text": ["a", "b c"], "sampling_params": {"n": 2}},
        {"text": ["d e", "f"], "stream": True},
        {"text": "stop here now", "sampling_params": {"stop": "here"}},
        {"input_ids": [9], "sampling_params": {"max_new_tokens": 0}, "stream": True},
        {"text": "ERROR refused", "stream": True},
        {"text": "hi", "input_ids": [1]},
        {"text": ""},
        {"text": "hi", "model": "gpt-9"},
        {"text": "hi", "rid": ["a", "b"]},
        {"text": "hi", "sampling_params": {"top_k": 1.5}},
        {"text": "hi", "sampling_params": {"temperature": -1}},
        {"text": "hi", "sampling_params": {"structural_tag": "x"}},
        {"text": "hi", "sampling_params": {"regex": "("}},
        {"input_ids": [[1], 2]},
    ],
)
def test_the_fast_path_answers_as_fastapi_does(http: httpx.Client, body: dict[str, Any]) -> None:
    wire = json.dumps(body).encode()
    answer(http, wire, FAST)  # both below then see the prompt as cached alike
    assert answer(http, wire, FAST) == answer(http, wire, VIA_FASTAPI)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "one two", "max_tokens": 6, "temperature": 0}),
        ("/v1/completions", {"model": MODEL, "prompt": ["a b", "c"], "n": 2, "logprobs": 2, "stream": True,
                             "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"model": MODEL, "prompt": "stop here now", "stop": ["here"]}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}),
        ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "one two"}]}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}],
                                  "stream": True, "logprobs": True, "top_logprobs": 1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    ],
)
def test_the_openai_routes_fast_path_answers_as_fastapi_does(
    http: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    wire = json.dumps(body).encode()
    answer(http, wire, FAST, path)
    assert answer(http, wire, FAST, path) == answer(http, wire, VIA_FASTAPI, path)


def test_malformed_json_gets_fastapis_400(http: httpx.Client) -> None:
    fast, slow = (answer(http, b'{"text": "hi",', headers) for headers in (FAST, VIA_FASTAPI))
    assert fast == slow
    assert (fast[0], fast[2]["error"]["param"]) == (400, "body")


def test_the_fast_path_is_counted_under_its_route(http: httpx.Client) -> None:
    def served() -> float:
        sample = f'rs_gateway_requests_total{{endpoint="/generate",model_name="{MODEL}",status="200"}} '
        found = re.search(re.escape(sample) + r"(\S+)", http.get("/metrics").text)
        return float(found.group(1)) if found else 0.0

    before = served()
    assert http.post("/generate", json={"text": "count me", "stream": True}).status_code == 200
    assert served() == before + 1
