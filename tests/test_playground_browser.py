"""/playground in headless Chromium (Playwright driving the system's browser) against a real stack:
nats-server, one worker (detokenizing in-process) serving the embedded default model, and a gateway
that tokenizes itself and reads reasoning (--reasoning-parser qwen3). What a user sees is checked
against what the API answers for the same request: greedy answers, usage, error messages, and the
worker's own metrics for a stopped stream.

Screenshots of a finished chat (desktop and phone width) go to $RS_ARTIFACTS, else the test's tmp_path.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, Playwright, Route, expect, sync_playwright

from shared.natsd import start_nats_server
from tests.gateway_helpers import wait_for_workers
from tests.services_helpers import ServiceProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# CI sets RS_REQUIRE_BROWSER=1 (.ci/run): there a missing browser fails the tests instead of skipping them.
REQUIRED = os.environ.get("RS_REQUIRE_BROWSER") == "1"
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not REQUIRED,
    reason="no chromium on PATH (make setup installs it with apt-get where it can)",
)

QUESTION = "What is the capital of France?"
# The reasoning test forces a <think> block with SGLang's `regex`, which the page does not send.
THINKING = r"<think>[a-z ]{8,40}</think>[A-Z][a-z ]{4,40}\."
# Small, so that a prompt past it (the error test) is quick to send.
CONTEXT_LENGTH = 1024


@dataclass
class Stack:
    url: str
    model: str
    worker: ServiceProcess


@pytest.fixture(scope="module")
def stack(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("playground_logs")
    with start_nats_server() as nats:
        common = ["--nats-url", nats.url, "--metrics-port", "0"]
        model = str(default_model_path)
        worker = ServiceProcess.start(
            "worker", [*common, "--model-path", model, "--worker-id", "w1", "--with-detokenizer",
             "--context-length", str(CONTEXT_LENGTH)], log_dir
        )
        gateway = ServiceProcess.start("gateway", [
            *common, "--port", "0", "--grpc-port", "0", "--local-tokenizer", model, "--reasoning-parser", "qwen3",
        ], log_dir)
        try:
            worker.wait_ready()
            gateway.wait_ready()
            match = re.search(r"HTTP on (http://[\d.]+:\d+)", gateway.log())
            assert match, f"the gateway logged no address:\n{gateway.log()[-2000:]}"
            wait_for_workers(match.group(1), 1, timeout=30)
            yield Stack(match.group(1), default_model_path.name, worker)
        finally:
            gateway.kill()
            worker.kill()


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    assert CHROMIUM, "RS_REQUIRE_BROWSER=1 but there is no chromium on PATH (make setup installs it with apt-get)"
    # --no-sandbox: CI and test containers run as root, where Chromium's sandbox refuses to start.
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
    yield browser
    browser.close()


@pytest.fixture
def page(browser: Browser, stack: Stack) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(f"{stack.url}/playground")
    yield page
    context.close()


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    path = Path(os.environ.get("RS_ARTIFACTS") or tmp_path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def settings(page: Page, model: str, temperature: str = "0", top_p: str = "1", max_tokens: str = "24",
             system: str = "") -> None:
    expect(page.locator("#model option")).to_have_count(1)
    page.select_option("#model", model)
    page.fill("#temperature", temperature)
    page.fill("#top-p", top_p)
    page.fill("#max-tokens", max_tokens)
    page.fill("#system", system)


def ask(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_answer(page: Page) -> str:
    return page.locator(".msg.assistant .answer").last.inner_text()


def wait_finished(page: Page) -> str:
    """The last assistant bubble's state once it is no longer streaming."""
    bubble = page.locator(".msg.assistant").last
    expect(bubble).not_to_have_attribute("data-state", "streaming", timeout=60_000)
    return bubble.get_attribute("data-state") or ""


# Records the answer's text at every change the page makes to it while it streams.
WATCH_ANSWERS = """() => {
  window.answerSnapshots = [];
  new MutationObserver(() => {
    const answer = document.querySelector(".msg.assistant:last-child .answer");
    if (answer && answer.textContent !== window.answerSnapshots.at(-1)) window.answerSnapshots.push(answer.textContent);
  }).observe(document.getElementById("log"), { childList: true, characterData: true, subtree: true });
}"""


def api_chat(stack: Stack, messages: list[dict], **fields: object) -> dict:
    body = {"model": stack.model, "messages": messages, **fields}
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60).json()


def test_models_are_listed_and_the_answer_streams_in_token_by_token(page: Page, stack: Stack, artifacts: Path) -> None:
    models = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"]
    expect(page.locator("#model option")).to_have_text([m["id"] for m in models])
    settings(page, stack.model, max_tokens="24")
    page.evaluate(WATCH_ANSWERS)
    ask(page, QUESTION)
    expect(page.locator(".msg.user")).to_have_text([QUESTION])
    bubble = page.locator(".msg.assistant").last
    assert wait_finished(page) == "done"
    snapshots = [s for s in page.evaluate("window.answerSnapshots") if s]
    final = last_answer(page)
    expected = api_chat(stack, [{"role": "user", "content": QUESTION}], temperature=0, top_p=1, max_tokens=24)
    assert final == expected["choices"][0]["message"]["content"]
    assert "Paris" in final
    # Seen growing: several distinct partial answers, each a prefix of the next and of the final one.
    assert len(snapshots) >= 3, snapshots
    assert all(later.startswith(earlier) for earlier, later in zip(snapshots, snapshots[1:]))
    assert all(final.startswith(s) for s in snapshots) and snapshots[0] != final
    stats = bubble.locator(".stats").inner_text()
    match = re.fullmatch(r"(\d+) tokens · ([\d.]+) tok/s · first token ([\d.]+) s · (\w+)( · .* cached)?", stats)
    assert match, stats
    assert int(match.group(1)) == expected["usage"]["completion_tokens"]
    assert float(match.group(2)) > 0 and match.group(4) == expected["choices"][0]["finish_reason"]
    page.screenshot(path=artifacts / "playground.png")


def test_a_conversation_carries_its_history_and_settings_and_new_chat_starts_over(page: Page, stack: Stack) -> None:
    system = "You are a terse geography tutor."
    settings(page, stack.model, temperature="0", top_p="0.9", max_tokens="8", system=system)
    with page.expect_request("**/v1/chat/completions") as first:
        ask(page, QUESTION)
    assert wait_finished(page) == "done"
    answer = last_answer(page)
    assert first.value.post_data_json["messages"] == [
        {"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    with page.expect_request("**/v1/chat/completions") as second:
        ask(page, "And of Italy?")
    assert wait_finished(page) == "done"
    sent = second.value.post_data_json
    assert sent["messages"] == [
        {"role": "system", "content": system}, {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
    assert (sent["model"], sent["temperature"], sent["top_p"], sent["max_tokens"]) == (stack.model, 0, 0.9, 8)
    assert sent["stream"] is True
    # The second answer is the API's answer to the same conversation.
    assert last_answer(page) == api_chat(stack, sent["messages"], temperature=0, top_p=0.9, max_tokens=8)[
        "choices"][0]["message"]["content"]
    expect(page.locator(".msg")).to_have_count(4)
    # The second turn's prompt starts with the first's, which the worker's prefix cache holds.
    stats = page.locator(".msg.assistant .stats").last.inner_text()
    cached = re.search(r" · (\d+)/(\d+) prompt tokens cached$", stats)
    assert cached and 0 < int(cached.group(1)) < int(cached.group(2)), stats

    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    with page.expect_request("**/v1/chat/completions") as third:
        ask(page, "Name a colour.")
    assert wait_finished(page) == "done"
    assert third.value.post_data_json["messages"] == [
        {"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]


def test_the_copy_button_copies_the_answer(browser: Browser, stack: Stack) -> None:
    context = browser.new_context(permissions=["clipboard-read", "clipboard-write"])
    try:
        page = context.new_page()
        page.goto(f"{stack.url}/playground")
        settings(page, stack.model, max_tokens="8")
        ask(page, QUESTION)
        assert wait_finished(page) == "done"
        bubble = page.locator(".msg.assistant").last
        bubble.locator("button.copy").click()
        expect(bubble.locator("button.copy")).to_have_text("Copied")
        assert page.evaluate("navigator.clipboard.readText()") == last_answer(page) != ""
    finally:
        context.close()


def worker_aborts(stack: Stack) -> float:
    """rs_worker_requests_total{status="abort"} (0 before the first), whatever other labels it has."""
    for line in stack.worker.scrape().splitlines():
        if line.startswith("rs_worker_requests_total{") and 'status="abort"' in line:
            return float(line.split()[-1])
    return 0.0


def worker_running(stack: Stack) -> float:
    for line in stack.worker.scrape().splitlines():
        if line.startswith("rs_worker_running_requests"):
            return float(line.split()[-1])
    raise AssertionError("the worker exports no rs_worker_running_requests")


def test_stop_ends_the_stream_and_the_worker_aborts_the_request(page: Page, stack: Stack) -> None:
    aborted_before = worker_aborts(stack)
    settings(page, stack.model, temperature="0", max_tokens="2000")
    ask(page, "Write a long story about a dragon who learns to bake bread.")
    answer = page.locator(".msg.assistant .answer").last
    expect(answer).not_to_have_text("")
    expect(page.locator("#stop")).to_be_visible()
    page.click("#stop")
    assert wait_finished(page) == "stopped"
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_hidden()
    stopped_at = last_answer(page)
    assert stopped_at and "stopped after" in page.locator(".msg.assistant .stats").last.inner_text()
    deadline = time.monotonic() + 10
    while (worker_aborts(stack), worker_running(stack)) != (aborted_before + 1, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (worker_aborts(stack), worker_running(stack)) == (aborted_before + 1, 0)
    assert last_answer(page) == stopped_at  # nothing more arrives after Stop


def test_reasoning_is_folded_away_from_the_answer(page: Page, stack: Stack) -> None:
    def force_thinking(route: Route) -> None:
        route.continue_(post_data={**route.request.post_data_json, "regex": THINKING})

    page.route("**/v1/chat/completions", force_thinking)
    settings(page, stack.model, max_tokens="64")
    ask(page, "Think first, then say hello.")
    assert wait_finished(page) == "done"
    expected = api_chat(stack, [{"role": "user", "content": "Think first, then say hello."}],
                        temperature=0, top_p=1, max_tokens=64, regex=THINKING)["choices"][0]["message"]
    assert expected["reasoning_content"] and expected["content"]
    bubble = page.locator(".msg.assistant").last
    folded = bubble.locator("details.reasoning")
    expect(folded).to_be_visible()
    expect(folded).not_to_have_attribute("open", "")
    expect(folded.locator(".reasoning-text")).to_be_hidden()
    assert last_answer(page) == expected["content"] and "<think>" not in last_answer(page)
    folded.locator("summary").click()
    expect(folded.locator(".reasoning-text")).to_be_visible()
    expect(folded.locator(".reasoning-text")).to_have_text(expected["reasoning_content"])


def test_a_server_error_is_shown(page: Page, stack: Stack) -> None:
    too_long = " ".join(["tell me more"] * CONTEXT_LENGTH)  # past the worker's --context-length
    settings(page, stack.model)
    ask(page, too_long)
    assert wait_finished(page) == "error"
    error = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30, json={
        "model": stack.model, "messages": [{"role": "user", "content": too_long}], "stream": True})
    assert error.status_code == 400, error.text
    message = f"HTTP 400: {error.json()['error']['message']}"
    expect(page.locator(".msg.assistant .answer").last).to_have_text(message)
    expect(page.locator("#status")).to_have_text(message)
    expect(page.locator("#send")).to_be_enabled()
    # The failed turn is not part of the conversation: the next request does not carry it.
    with page.expect_request("**/v1/chat/completions") as retry:
        ask(page, QUESTION)
    assert retry.value.post_data_json["messages"] == [{"role": "user", "content": QUESTION}]
    assert wait_finished(page) == "done"


NO_SIDEWAYS_SCROLL = "document.documentElement.scrollWidth <= document.documentElement.clientWidth"


def test_the_page_fits_a_phone_screen(browser: Browser, stack: Stack, artifacts: Path) -> None:
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    try:
        page = context.new_page()
        page.goto(f"{stack.url}/playground")
        expect(page.locator("#settings")).to_be_hidden()  # folded behind a button on a narrow screen
        page.click("#settings-toggle")
        expect(page.locator("#temperature")).to_be_visible()
        settings(page, stack.model, max_tokens="24")
        assert page.evaluate(NO_SIDEWAYS_SCROLL)
        page.click("#settings-toggle")
        ask(page, QUESTION)
        assert wait_finished(page) == "done"
        assert page.evaluate(NO_SIDEWAYS_SCROLL)
        assert page.evaluate("document.documentElement.clientWidth") == 390
        expect(page.locator("#prompt")).to_be_in_viewport(ratio=1)
        expect(page.locator("#send")).to_be_in_viewport(ratio=1)
        for selector in ("#prompt", "#send", "#model", "#new-chat", ".msg.assistant .copy"):
            box = page.locator(selector).last.bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390, (selector, box)
            assert box["y"] >= 0 and box["y"] + box["height"] <= 844, (selector, box)
        page.screenshot(path=artifacts / "playground-phone.png")
    finally:
        context.close()
