"""CORS as a browser enforces it: headless Chromium (Playwright with the system's browser) loads a page
from another origin (a second local HTTP server: another port is another origin) whose script calls
the gateway with `fetch`, an API key and a JSON body, so the browser sends a real preflight first.
From the allowed origin the page reads a JSON answer, a streamed one chunk by chunk, and an error body;
from any other origin the browser refuses to hand the page anything. The gateway runs over the
scripted pipeline (tests/gateway_helpers.FakePipeline) on a real nats-server."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from shared.natsd import NatsServer
from tests.gateway_helpers import FakePipeline, GatewayThread, wait_for_workers

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("RS_REQUIRE_BROWSER") == "1"  # CI: a missing browser fails instead of skipping
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not REQUIRED,
    reason="no chromium on PATH (make setup installs it with apt-get where it can)",
)

KEY = "sk-browser"
CHAT = {"messages": [{"role": "user", "content": "one two three"}], "max_tokens": 8}

# fetch() the gateway as a page's script would, with a key (not a "simple" request: it is preflighted).
CALL = """async ([url, key, body]) => {
  try {
    const response = await fetch(url + "/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body),
      headers: {"Content-Type": "application/json", "Authorization": "Bearer " + key}});
    const worker = response.headers.get("x-radixserve-worker");
    if (!body.stream) return {status: response.status, body: await response.json(), worker};
    const reader = response.body.getReader(), decoder = new TextDecoder();
    const reads = [];
    for (let read = await reader.read(); !read.done; read = await reader.read()) {
      reads.push(decoder.decode(read.value));
    }
    return {status: response.status, reads, worker};
  } catch (error) {
    return {refused: String(error)};
  }
}"""


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        page = b"<!doctype html><title>another origin</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def origins() -> Iterator[tuple[str, str]]:
    """Two page servers: the first origin is allowed, the second is not."""
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Page) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield tuple(f"http://127.0.0.1:{s.server_address[1]}" for s in servers)  # type: ignore[misc]
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def gateway(nats: NatsServer, origins: tuple[str, str]) -> Iterator[GatewayThread]:
    pipeline = FakePipeline(nats.url)
    gw = GatewayThread(nats.url, allowed_origins=origins[0], api_key=KEY)
    try:
        wait_for_workers(gw.url, 1)
        yield gw
    finally:
        gw.close()
        pipeline.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert CHROMIUM, "RS_REQUIRE_BROWSER=1 but there is no chromium on PATH (make setup installs it with apt-get)"
    with sync_playwright() as pw:
        # --no-sandbox: CI and test containers run as root, where Chromium's sandbox refuses to start.
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


def page_at(browser: Browser, origin: str) -> Page:
    page = browser.new_page()
    page.set_default_timeout(30_000)
    page.goto(f"{origin}/")
    return page


def test_a_page_on_an_allowed_origin_reads_json_streamed_and_error_answers(
    browser: Browser, gateway: GatewayThread, origins: tuple[str, str]
) -> None:
    page = page_at(browser, origins[0])
    try:
        answer = page.evaluate(CALL, [gateway.url, KEY, CHAT])
        assert answer["status"] == 200 and answer["worker"] == "w1"  # an exposed header
        assert answer["body"]["choices"][0]["message"]["content"] == "one two three "
        streamed = page.evaluate(CALL, [gateway.url, KEY, {**CHAT, "stream": True}])
        text = "".join(streamed["reads"])
        assert streamed["status"] == 200 and text.rstrip().endswith("data: [DONE]")
        assert text.count("data: ") >= 4  # a role chunk, one per word, the final one and [DONE]
        error = page.evaluate(CALL, [gateway.url, KEY, {**CHAT, "model": "gpt-9"}])
        assert error["status"] == 404 and error["body"]["error"]["param"] == "model"
        unkeyed = page.evaluate(CALL, [gateway.url, "sk-wrong", CHAT])
        assert unkeyed["status"] == 401 and unkeyed["body"]["error"]["type"] == "authentication_error"
    finally:
        page.close()


def test_a_page_on_another_origin_is_refused_by_the_browser(
    browser: Browser, gateway: GatewayThread, origins: tuple[str, str]
) -> None:
    page = page_at(browser, origins[1])
    try:
        answer = page.evaluate(CALL, [gateway.url, KEY, CHAT])
        assert answer == {"refused": "TypeError: Failed to fetch"}
    finally:
        page.close()
