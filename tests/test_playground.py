"""The browser playground (services/gateway/playground/): the gateway serves the page and its script
without a key, and the script's network code — model list, streamed chat with SSE parsing, errors —
run by Node against a live gateway over the scripted pipeline gives what the API gives."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.natsd import start_nats_server
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, GatewayThread, serving_gateway

SCRIPT = Path(__file__).resolve().parents[1] / "services" / "gateway" / "playground" / "playground.js"


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayThread]:
    with (
        start_nats_server() as nats,
        FakePipeline(nats.url, prefix="play"),
        serving_gateway(nats.url, subject_prefix="play", api_key="secret", reasoning_parser="qwen3") as gw,
    ):
        yield gw


def test_the_page_and_script_are_served_without_a_key(gateway: GatewayThread) -> None:
    page = httpx.get(f"{gateway.url}/playground", timeout=5)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/playground/playground.js">' in page.text
    script = httpx.get(f"{gateway.url}/playground/playground.js", timeout=5)
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert script.text == SCRIPT.read_text()


def run_node(gateway: GatewayThread, program: str) -> dict:
    """Run an ES module that imports the playground script as `pg` and prints one JSON line."""
    source = f"import * as pg from {json.dumps(SCRIPT.as_uri())};\nconst base = {json.dumps(gateway.url)};\n{program}"
    done = subprocess.run(["node", "--input-type=module", "-e", source], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the playground's script")
def test_the_scripts_streamed_chat_equals_the_apis_answer(gateway: GatewayThread) -> None:
    request = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "alpha beta gamma"}], "max_tokens": 8}
    out = run_node(gateway, f"""
const deltas = [];
const models = await pg.listModels(base, "secret");
const reply = await pg.streamChat(base, "secret", {json.dumps(request)}, (d) => deltas.push(d));
console.log(JSON.stringify({{models, reply, deltas}}));
""")
    expected = httpx.post(
        f"{gateway.url}/v1/chat/completions", json=request, headers={"Authorization": "Bearer secret"}, timeout=10
    ).json()
    assert out["models"] == [FAKE_MODEL]
    assert out["reply"]["text"] == expected["choices"][0]["message"]["content"] == "alpha beta gamma "
    assert out["deltas"] == ["alpha ", "beta ", "gamma "]  # one SSE event per step
    assert out["reply"]["finishReason"] == expected["choices"][0]["finish_reason"]
    assert out["reply"]["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the playground's script")
def test_the_script_keeps_reasoning_apart_from_the_answer(gateway: GatewayThread) -> None:
    """The gateway runs --reasoning-parser qwen3; the fake pipeline echoes the think tags back."""
    request = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "<think> hmm yes </think> done"}]}
    out = run_node(gateway, f"""
const deltas = [];
const reply = await pg.streamChat(base, "secret", {json.dumps(request)}, (d, kind) => deltas.push([kind, d]));
console.log(JSON.stringify({{reply, deltas}}));
""")
    assert (out["reply"]["reasoning"], out["reply"]["text"]) == ("hmm yes", "done ")
    assert out["deltas"] == [["reasoning", "hmm"], ["reasoning", " yes"], ["content", "done "]]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the playground's script")
def test_the_script_reports_the_servers_errors(gateway: GatewayThread) -> None:
    out = run_node(gateway, f"""
const errors = [];
for (const [key, model] of [["wrong", {json.dumps(FAKE_MODEL)}], ["secret", "no-such-model"]]) {{
  try {{
    await pg.streamChat(base, key, {{model, messages: [{{role: "user", content: "hi"}}]}});
    errors.push(null);
  }} catch (err) {{ errors.push(err.message); }}
}}
console.log(JSON.stringify({{errors}}));
""")
    assert out["errors"][0] == "HTTP 401: invalid API key"
    assert out["errors"][1].startswith("HTTP 404: model 'no-such-model' is not served here")
