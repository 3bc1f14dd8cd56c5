"""Where SGLang, vLLM and browser users meet the HTTP API: errors on unknown routes and methods in
OpenAI's shape (raw HTTP and the official `openai` client), CORS with `--allowed-origins` (preflights,
and the header on JSON, streamed and error answers, fast path or not), and the other names of our
routes (/v1/tokenize, /v1/detokenize, /ping, /version, /model_info, /server_info). Against a scripted
pipeline (tests/gateway_helpers.FakePipeline) whose {p}.tokenize.text is answered by the tokenizer
service's own PromptTokenizer over a tiny checkpoint, on a real nats-server."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from nats.aio.msg import Msg
from transformers import AutoTokenizer

from services.cli import build_parser
from services.gateway.config import GatewayConfig
from shared import flags
from shared.natsd import NatsServer
from shared.prompt_tokenizer import PromptTokenizer
from shared.protocol import TextTokenize
from tests.gateway_helpers import FakePipeline, GatewayThread, openai_client, wait_for_workers

ROOT = Path(__file__).resolve().parent.parent
APP = "https://app.example.com"
OTHER = "https://evil.example.net"
KEY = "sk-edges"
CHAT = {"messages": [{"role": "user", "content": "one two three"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def pipeline(nats: NatsServer, qwen3_path: Path) -> Iterator[FakePipeline]:
    fake = FakePipeline(nats.url)
    prompts = PromptTokenizer.load(str(qwen3_path))

    async def tokenize_text(msg: TextTokenize, raw: Msg) -> None:
        await fake.bus.respond(raw, prompts.answer(msg))

    fake.thread.run(fake.bus.subscribe(fake.bus.subjects.tokenize_text, (TextTokenize,), tokenize_text))
    yield fake
    fake.close()


def _gateway(nats: NatsServer, **overrides: object) -> Iterator[GatewayThread]:
    gw = GatewayThread(nats.url, **overrides)
    try:
        wait_for_workers(gw.url, 1)
        yield gw
    finally:
        gw.close()


@pytest.fixture(scope="module")
def plain(nats: NatsServer, pipeline: FakePipeline) -> Iterator[GatewayThread]:
    """The default: no --allowed-origins."""
    yield from _gateway(nats)


@pytest.fixture(scope="module")
def cors(nats: NatsServer, pipeline: FakePipeline) -> Iterator[GatewayThread]:
    yield from _gateway(nats, allowed_origins=f"{APP}, http://localhost:3000")


@pytest.fixture(scope="module")
def keyed(nats: NatsServer, pipeline: FakePipeline) -> Iterator[GatewayThread]:
    """Any origin, and API keys required."""
    yield from _gateway(nats, allowed_origins="*", api_key=KEY)


def cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("access-control-")}


def preflight(gateway: GatewayThread, origin: str, method: str = "POST", path: str = "/v1/chat/completions",
              headers: str = "authorization, content-type") -> httpx.Response:
    return httpx.options(f"{gateway.url}{path}", headers={
        "Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers,
    })


# ---- errors in OpenAI's shape -------------------------------------------------------------------


def test_an_unknown_path_is_a_404_in_openai_shape(plain: GatewayThread) -> None:
    response = httpx.get(f"{plain.url}/nope")
    assert response.status_code == 404
    assert response.json() == {
        "error": {"message": "GET /nope: Not Found", "type": "not_found_error", "param": None, "code": 404}
    }


def test_a_wrong_method_is_a_405_in_openai_shape_with_allow(plain: GatewayThread) -> None:
    response = httpx.get(f"{plain.url}/v1/chat/completions")
    assert (response.status_code, response.headers["allow"]) == (405, "POST")
    assert response.json()["error"] == {
        "message": "GET /v1/chat/completions: Method Not Allowed", "type": "invalid_request_error", "param": None,
        "code": 405,
    }


def test_the_openai_client_raises_not_found_and_bad_request_with_the_message(plain: GatewayThread) -> None:
    client = openai_client(plain)
    with pytest.raises(openai.NotFoundError) as missing:
        client.get("/nope", cast_to=object)
    assert (missing.value.status_code, missing.value.type) == (404, "not_found_error")
    assert missing.value.body == {"message": "GET /v1/nope: Not Found", "type": "not_found_error", "param": None,
                                  "code": 404}
    with pytest.raises(openai.NotFoundError) as unknown_model:
        client.models.retrieve("gpt-9")
    assert "gpt-9" in unknown_model.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="fake-model", messages=CHAT["messages"], top_p=7)
    assert (bad.value.param, bad.value.type) == ("top_p", "invalid_request_error")


# ---- CORS ---------------------------------------------------------------------------------------


def test_a_preflight_from_an_allowed_origin_is_answered(cors: GatewayThread) -> None:
    response = preflight(cors, APP)
    assert response.status_code == 200
    headers = cors_headers(response)
    assert headers["access-control-allow-origin"] == APP
    assert "POST" in headers["access-control-allow-methods"].split(", ")
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert headers["access-control-max-age"] == "600"
    assert "access-control-allow-credentials" not in headers
    # The second listed origin too (the list is comma-separated, spaces allowed).
    assert cors_headers(preflight(cors, "http://localhost:3000"))["access-control-allow-origin"] == "http://localhost:3000"


def test_a_preflight_from_another_origin_gets_no_cors_headers(cors: GatewayThread, plain: GatewayThread) -> None:
    for gateway, origin in ((cors, OTHER), (cors, APP + ":8443"), (plain, APP)):
        response = preflight(gateway, origin)
        assert (response.status_code, cors_headers(response)) == (405, {}), (gateway.config.allowed_origins, origin)
        assert response.json()["error"]["code"] == 405


def test_a_preflight_for_a_method_no_route_takes_is_a_400_in_openai_shape(cors: GatewayThread) -> None:
    response = preflight(cors, APP, method="TRACE")
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "CORS preflight refused: Disallowed CORS method"
    assert response.headers["access-control-allow-origin"] == APP  # the page may read why


def test_json_answers_carry_the_origin_fast_path_or_not(cors: GatewayThread) -> None:
    # application/json and a valid body: JsonFastPath serves it, past FastAPI's middleware.
    chat = httpx.post(f"{cors.url}/v1/chat/completions", json=CHAT, headers={"Origin": APP})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "one two three "
    # The same body as text/plain (what a browser's "simple" request sends) goes through FastAPI.
    routed = httpx.post(f"{cors.url}/v1/chat/completions", content=json.dumps(CHAT),
                        headers={"Origin": APP, "Content-Type": "text/plain"})
    models = httpx.get(f"{cors.url}/v1/models", headers={"Origin": APP})
    for response in (chat, routed, models):
        assert response.headers["access-control-allow-origin"] == APP
        assert "origin" in response.headers["vary"].lower()
        exposed = response.headers["access-control-expose-headers"].lower().split(", ")
        assert {"x-radixserve-worker", "x-radixserve-gateway", "retry-after"} <= set(exposed)


def test_a_streamed_answer_carries_the_origin(cors: GatewayThread) -> None:
    body = {**CHAT, "stream": True}
    with httpx.stream("POST", f"{cors.url}/v1/chat/completions", json=body, headers={"Origin": APP}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["access-control-allow-origin"] == APP
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    native = httpx.post(f"{cors.url}/generate", json={"text": "a b", "stream": True}, headers={"Origin": APP})
    assert native.headers["access-control-allow-origin"] == APP and native.text.endswith("data: [DONE]\n\n")


def test_error_answers_carry_the_origin(cors: GatewayThread) -> None:
    unknown_model = httpx.post(f"{cors.url}/v1/chat/completions", json={**CHAT, "model": "gpt-9"},
                               headers={"Origin": APP})
    bad_field = httpx.post(f"{cors.url}/v1/chat/completions", json={**CHAT, "top_p": 7}, headers={"Origin": APP})
    no_route = httpx.get(f"{cors.url}/nope", headers={"Origin": APP})
    statuses = [r.status_code for r in (unknown_model, bad_field, no_route)]
    assert statuses == [404, 400, 404]
    for response in (unknown_model, bad_field, no_route):
        assert response.headers["access-control-allow-origin"] == APP
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_answers_to_other_origins_and_to_no_origin_carry_no_cors_headers(cors: GatewayThread) -> None:
    for headers in ({"Origin": OTHER}, {}):
        response = httpx.post(f"{cors.url}/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 200 and cors_headers(response) == {}


def test_any_origin_preflights_without_a_key_and_sees_the_401(keyed: GatewayThread) -> None:
    answered = preflight(keyed, OTHER)
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "*"
    refused = httpx.post(f"{keyed.url}/v1/chat/completions", json=CHAT, headers={"Origin": OTHER})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    assert refused.json()["error"]["type"] == "authentication_error"
    served = httpx.post(f"{keyed.url}/v1/chat/completions", json=CHAT,
                        headers={"Origin": OTHER, "Authorization": f"Bearer {KEY}"})
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == "*"


def test_preflights_are_counted_under_their_own_endpoint(cors: GatewayThread) -> None:
    preflight(cors, APP)
    metrics = httpx.get(f"{cors.url}/metrics").text
    # A preflight is about no model: its model_name is empty.
    assert 'rs_gateway_requests_total{endpoint="cors_preflight",model_name="",status="200"}' in metrics


@pytest.mark.parametrize(("value", "message"), [
    (f"{APP}/", "'https://app.example.com/' is not an origin"),
    ("app.example.com", "'app.example.com' is not an origin"),
    (f"*, {APP}", "cannot be listed with others"),
])
def test_a_bad_allowed_origin_is_refused_at_start(value: str, message: str) -> None:
    with pytest.raises(ValueError, match="allowed_origins") as refused:
        GatewayConfig(allowed_origins=value)
    assert message in str(refused.value)


def test_allowed_origins_come_from_the_flag_or_rs_allowed_origins() -> None:
    parser = build_parser()
    by_flag = flags.build(GatewayConfig, parser.parse_args(["gateway", "--allowed-origins", APP]), env={})
    assert by_flag.origins() == (APP,)
    by_env = flags.build(GatewayConfig, parser.parse_args(["gateway"]), env={"RS_ALLOWED_ORIGINS": "*"})
    assert by_env.origins() == ("*",)
    assert parser.parse_args(["up", "--allowed-origins", APP]).allowed_origins == APP


def test_allowed_origins_are_read_as_browsers_send_them() -> None:
    assert GatewayConfig().origins() == ()
    config = GatewayConfig(allowed_origins=" HTTPS://App.Example.com ,http://127.0.0.1:5173,")
    assert config.origins() == (APP, "http://127.0.0.1:5173")


# ---- other names of our routes ------------------------------------------------------------------


def test_v1_tokenize_and_detokenize_answer_as_the_unprefixed_routes(plain: GatewayThread, qwen3_path: Path) -> None:
    expected = AutoTokenizer.from_pretrained(qwen3_path).encode("The capital of France")
    for body in ({"prompt": "The capital of France"}, {"messages": [{"role": "user", "content": "hi"}]}):
        ours = httpx.post(f"{plain.url}/tokenize", json=body).json()
        assert httpx.post(f"{plain.url}/v1/tokenize", json=body).json() == ours
    assert httpx.post(f"{plain.url}/v1/tokenize", json={"prompt": "The capital of France"}).json()["tokens"] == expected
    back = httpx.post(f"{plain.url}/v1/detokenize", json={"tokens": expected}).json()
    assert back == httpx.post(f"{plain.url}/detokenize", json={"tokens": expected}).json()
    assert back["prompt"] == "The capital of France"
    bad = httpx.post(f"{plain.url}/v1/detokenize", json={"tokens": [-1]})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tokens")


def test_version_is_the_package_version_everywhere(plain: GatewayThread) -> None:
    declared = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared is not None
    version = declared.group(1)
    assert httpx.get(f"{plain.url}/version").json() == {"version": version}
    assert httpx.get(f"{plain.url}/get_server_info").json()["version"] == version
    assert httpx.get(f"{plain.url}/openapi.json").json()["info"]["version"] == version


def test_ping_answers_as_health_on_get_and_post(plain: GatewayThread) -> None:
    health = httpx.get(f"{plain.url}/health")
    for response in (httpx.get(f"{plain.url}/ping"), httpx.post(f"{plain.url}/ping")):
        assert (response.status_code, response.json()) == (200, health.json())


def test_ping_and_version_need_no_key_and_the_aliases_do(keyed: GatewayThread) -> None:
    assert httpx.get(f"{keyed.url}/ping").status_code == 200
    assert httpx.get(f"{keyed.url}/version").status_code == 200
    for path in ("/server_info", "/model_info"):
        assert httpx.get(f"{keyed.url}{path}").status_code == 401
        assert httpx.get(f"{keyed.url}{path}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_model_info_and_server_info_are_the_sglang_routes(plain: GatewayThread) -> None:
    assert httpx.get(f"{plain.url}/model_info").json() == httpx.get(f"{plain.url}/get_model_info").json()
    new, old = (httpx.get(f"{plain.url}{p}").json() for p in ("/server_info", "/get_server_info"))
    assert new["gateway_id"] == old["gateway_id"] == plain.config.gateway_id
    assert new["version"] == old["version"]
    assert [w["worker_id"] for w in new["workers"]] == [w["worker_id"] for w in old["workers"]] == ["w1"]


def test_the_openapi_document_lists_the_aliases(plain: GatewayThread) -> None:
    paths = httpx.get(f"{plain.url}/openapi.json").json()["paths"]
    for path, methods in {"/v1/tokenize": {"post"}, "/v1/detokenize": {"post"}, "/ping": {"get", "post"},
                          "/version": {"get"}, "/model_info": {"get"}, "/server_info": {"get"}}.items():
        assert set(paths[path]) == methods, path
    assert paths["/v1/tokenize"]["post"]["requestBody"] == paths["/tokenize"]["post"]["requestBody"]
