"""The requests bench/soak.py sends, and how each one's outcome is judged.

Every request is one kind (KINDS) and ends in exactly one outcome:
- ok: a whole, well-formed answer (finish_reason stop or length; a constrained answer that stopped parses
  as its schema's object);
- clean_error: an HTTP 4xx/5xx whose body is OpenAI's error shape, or an SSE error event followed by
  `data: [DONE]`; a bad request must get exactly its expected 4xx, and a 5xx counts as clean only when a
  worker was killed or restarted while the request was in flight (or up to RESTART_GRACE_S before it
  started), and only as 502/503;
- aborted: ended as the client asked (a stream it closed, or an abort by rid it sent; that stream must
  end within ABORT_WITHIN_S of the abort's answer);
- failed: anything else: no answer within the client timeout, a connection dropped without a final, a
  malformed body, an unexplained 5xx, an abort nobody asked for.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai

OK, CLEAN_ERROR, ABORTED, FAILED = "ok", "clean_error", "aborted", "failed"
OUTCOMES = (OK, CLEAN_ERROR, ABORTED, FAILED)
RESTART_GRACE_S = 15.0  # how long after a kill a gateway may still route to the dead worker and 503
ABORT_WITHIN_S = 10.0  # a stream aborted by rid ends this soon after the abort's answer (kills included)
FINISHED = ("stop", "length")
ERROR_KEYS = {"message", "type", "param", "code"}
TOPICS = ("the tides", "a lighthouse keeper", "prime numbers", "the Roman roads", "bread baking", "owls",
          "glaciers", "the printing press", "chess openings", "honeybees", "volcanoes", "paper airplanes")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
          "additionalProperties": False}


@dataclass
class Outcome:
    kind: str
    outcome: str
    started: float
    ended: float
    detail: str = ""
    status: int | None = None


class Verdict(Exception):
    """Raised inside a kind to end it with an outcome."""

    def __init__(self, outcome: str, detail: str = "", status: int | None = None) -> None:
        super().__init__(detail)
        self.outcome, self.detail, self.status = outcome, detail, status


@dataclass
class Client:
    """One traffic thread's clients of one gateway."""

    url: str
    model: str
    timeout: float
    rng: random.Random

    def __post_init__(self) -> None:
        self.openai = openai.OpenAI(base_url=f"{self.url}/v1", api_key="soak", max_retries=0, timeout=self.timeout)
        self.http = httpx.Client(base_url=self.url, timeout=self.timeout)

    def messages(self) -> list[dict[str, str]]:
        topic = self.rng.choice(TOPICS)
        return [{"role": "user", "content": f"Tell me one fact about {topic} (note {self.rng.randrange(10**6)})."}]

    def max_tokens(self) -> int:
        return self.rng.randrange(8, 48)

    def close(self) -> None:
        self.openai.close()
        self.http.close()


def error_verdict(status: int, body: Any, expected: int | None = None) -> Verdict:
    """An HTTP error answer: clean when it has OpenAI's shape (and, for a bad request, its expected status)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not ERROR_KEYS <= error.keys():
        return Verdict(FAILED, f"HTTP {status} without OpenAI's error shape: {str(body)[:200]}", status)
    if expected is not None and status != expected:
        return Verdict(FAILED, f"expected HTTP {expected}, got {status}: {error['message']}", status)
    if expected is None and status < 500:
        return Verdict(FAILED, f"a valid request got HTTP {status}: {error['message']}", status)
    return Verdict(CLEAN_ERROR, f"HTTP {status}: {error['message']}", status)


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _finished(reason: str | None, what: str) -> None:
    if reason == "abort":
        raise Verdict(FAILED, f"{what} aborted though the client did not ask")
    if reason not in FINISHED:
        raise Verdict(FAILED, f"{what} ended with finish_reason {reason!r}")


# ---- the kinds ----------------------------------------------------------------------------------


def chat(c: Client) -> Verdict:
    reply = c.openai.chat.completions.create(model=c.model, messages=c.messages(), max_tokens=c.max_tokens(),
                                             temperature=c.rng.choice((0.0, 0.7)))
    choice = reply.choices[0]
    if not isinstance(choice.message.content, str) or reply.usage is None or reply.usage.completion_tokens < 1:
        raise Verdict(FAILED, f"malformed chat answer: {reply}")
    _finished(choice.finish_reason, "chat")
    return Verdict(OK)


def chat_n2(c: Client) -> Verdict:
    reply = c.openai.chat.completions.create(model=c.model, messages=c.messages(), max_tokens=c.max_tokens(),
                                             temperature=0.8, n=2)
    if sorted(ch.index for ch in reply.choices) != [0, 1]:
        raise Verdict(FAILED, f"n=2 answered {len(reply.choices)} choice(s)")
    for choice in reply.choices:
        _finished(choice.finish_reason, "n=2 choice")
    return Verdict(OK)


def constrained(c: Client) -> Verdict:
    messages = [{"role": "user", "content": f"Name a city near {c.rng.choice(TOPICS)}. Answer in JSON."}]
    reply = c.openai.chat.completions.create(
        model=c.model, messages=messages, max_tokens=40, temperature=c.rng.choice((0.0, 0.7)),
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    choice = reply.choices[0]
    _finished(choice.finish_reason, "constrained chat")
    if choice.finish_reason == "stop":
        try:
            value = json.loads(choice.message.content or "")
        except ValueError:
            raise Verdict(FAILED, f"constrained answer is not JSON: {choice.message.content!r}") from None
        if not isinstance(value, dict) or set(value) != {"city"}:
            raise Verdict(FAILED, f"constrained answer breaks its schema: {value!r}")
    return Verdict(OK)


def completion(c: Client) -> Verdict:
    reply = c.openai.completions.create(model=c.model, prompt=f"A short note on {c.rng.choice(TOPICS)}:",
                                        max_tokens=c.max_tokens(), temperature=c.rng.choice((0.0, 0.7)))
    if not isinstance(reply.choices[0].text, str):
        raise Verdict(FAILED, f"malformed completion: {reply}")
    _finished(reply.choices[0].finish_reason, "completion")
    return Verdict(OK)


def completion_stream(c: Client) -> Verdict:
    stream = c.openai.completions.create(model=c.model, prompt=f"Once upon a time, {c.rng.choice(TOPICS)}",
                                         max_tokens=c.max_tokens(), stream=True)
    reason = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
    if reason is None:
        raise Verdict(FAILED, "completion stream ended without a finish_reason")
    _finished(reason, "completion stream")
    return Verdict(OK)


def stream_abort(c: Client) -> Verdict:
    """A chat stream the client closes after three chunks (the gateway must abort it on its worker)."""
    stream = c.openai.chat.completions.create(model=c.model, messages=c.messages(), max_tokens=200, stream=True,
                                              extra_body={"ignore_eos": True})
    chunks = 0
    for chunk in stream:
        chunks += 1
        if chunks == 3:
            stream.close()
            return Verdict(ABORTED, "closed after 3 chunks")
        if chunk.choices and chunk.choices[0].finish_reason:
            _finished(chunk.choices[0].finish_reason, "stream")
            return Verdict(OK)
    raise Verdict(FAILED, "chat stream ended before its third chunk without a finish_reason")


def sse_events(response: httpx.Response, on_event: Callable[[dict[str, Any]], None]) -> None:
    """Read an SSE body to its end: each JSON event to `on_event`; judged by how the body ends."""
    error: dict[str, Any] | None = None
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            if error is not None:
                raise Verdict(CLEAN_ERROR, f"error event: {error['message']}", int(error["code"]))
            return
        if error is not None:
            raise Verdict(FAILED, "data after an error event")
        try:
            event = json.loads(line[6:])
        except ValueError:
            raise Verdict(FAILED, f"malformed SSE event: {line[:200]}") from None
        if "error" in event:
            error = event["error"]
            if not isinstance(error, dict) or not ERROR_KEYS <= error.keys():
                raise Verdict(FAILED, f"error event without OpenAI's error shape: {line[:200]}")
            continue
        on_event(event)
    raise Verdict(FAILED, "the stream ended without data: [DONE]" + (" after an error event" if error else ""))


def chat_stream(c: Client) -> Verdict:
    """A chat stream read as raw SSE, so the end of an error event's stream is checked too."""
    body = {"model": c.model, "messages": c.messages(), "max_tokens": c.max_tokens(), "stream": True}
    reasons: list[str] = []

    def on_event(event: dict[str, Any]) -> None:
        reasons.extend(ch["finish_reason"] for ch in event["choices"] if ch.get("finish_reason"))

    with c.http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise error_verdict(response.status_code, _json(response))
        sse_events(response, on_event)
    if len(reasons) != 1:
        raise Verdict(FAILED, f"chat stream gave finish_reasons {reasons}")
    _finished(reasons[0], "chat stream")
    return Verdict(OK)


def native_abort(c: Client) -> Verdict:
    """A native /generate stream with a rid, aborted by POST /abort_request after its first chunk: it
    must end within ABORT_WITHIN_S of the abort's answer, even when its worker is lost meanwhile."""
    rid = f"soak-{uuid.uuid4().hex}"
    body = {"text": f"Write about {c.rng.choice(TOPICS)}.", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    finals: list[dict[str, Any]] = []
    asked: list[float] = []

    def on_event(event: dict[str, Any]) -> None:
        if not asked:
            answer = c.http.post("/abort_request", json={"rid": rid})
            if answer.status_code != 200 or answer.json().get("success") is not True:
                raise Verdict(FAILED, f"/abort_request answered {answer.status_code}: {answer.text[:200]}")
            asked.append(time.monotonic())
        if event["meta_info"]["finish_reason"] is not None:
            finals.append(event["meta_info"]["finish_reason"])

    try:
        with c.http.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise error_verdict(response.status_code, _json(response))
            sse_events(response, on_event)
    except Verdict as verdict:
        _aborted_in_time(asked, verdict.detail)
        raise
    _aborted_in_time(asked, f"finish {finals}")
    if len(finals) != 1:
        raise Verdict(FAILED, f"native stream gave {len(finals)} finals")
    if finals[0]["type"] == "abort":
        return Verdict(ABORTED, "aborted by rid")
    _finished(finals[0]["type"], "native stream")  # it finished before the abort reached its worker
    return Verdict(OK)


def _aborted_in_time(asked: list[float], how: str) -> None:
    if asked and (late := time.monotonic() - asked[0]) > ABORT_WITHIN_S:
        raise Verdict(FAILED, f"aborted by rid, yet the stream went on {late:.1f} s ({how})")


def _bad(path: str, body: dict[str, Any], expected: int) -> Callable[[Client], Verdict]:
    def kind(c: Client) -> Verdict:
        answer = c.http.post(path, json={"model": c.model, **body})
        if answer.status_code == 200:
            return Verdict(FAILED, f"a bad request was answered 200: {body}")
        return error_verdict(answer.status_code, _json(answer), expected)
    return kind


HELLO = [{"role": "user", "content": "hello"}]
KINDS: dict[str, tuple[Callable[[Client], Verdict], int]] = {  # kind: (function, weight)
    "chat": (chat, 3),
    "chat_stream": (chat_stream, 3),
    "completion": (completion, 2),
    "completion_stream": (completion_stream, 2),
    "chat_n2": (chat_n2, 1),
    "constrained": (constrained, 1),
    "stream_abort": (stream_abort, 1),
    "native_abort": (native_abort, 1),
    "bad_model": (_bad("/v1/chat/completions", {"model": "no-such-model", "messages": HELLO}, 404), 1),
    "bad_temperature": (_bad("/v1/chat/completions", {"messages": HELLO, "temperature": -1}, 400), 1),
    "empty_messages": (_bad("/v1/chat/completions", {"messages": []}, 400), 1),
}


def run_one(kind: str, c: Client, disruptions: Callable[[], list[float]]) -> Outcome:
    """Send one request of `kind` and judge it. `disruptions`: monotonic times of worker kills and
    restarts so far (a 5xx is clean only near one of them)."""
    started = time.monotonic()
    try:
        verdict = KINDS[kind][0](c)
    except Verdict as v:
        verdict = v
    except openai.APITimeoutError:
        verdict = Verdict(FAILED, f"no answer within the {c.timeout:.0f} s client timeout")
    except openai.APIConnectionError as exc:
        verdict = Verdict(FAILED, f"connection dropped: {exc.__cause__ or exc}")
    except openai.APIStatusError as exc:
        verdict = error_verdict(exc.status_code, _json(exc.response))
    except openai.APIError as exc:  # an SSE error event, read by the openai client
        body = exc.body if isinstance(exc.body, dict) else {}
        verdict = error_verdict(int(body.get("code", 0) or 0), {"error": body})
    except httpx.TimeoutException:
        verdict = Verdict(FAILED, f"no answer within the {c.timeout:.0f} s client timeout")
    except httpx.TransportError as exc:
        verdict = Verdict(FAILED, f"connection dropped: {type(exc).__name__}: {exc}")
    ended = time.monotonic()
    if ended - started > c.timeout:
        verdict = Verdict(FAILED, f"took {ended - started:.0f} s, past the {c.timeout:.0f} s client timeout")
    if verdict.outcome == CLEAN_ERROR and verdict.status is not None and verdict.status >= 500:
        near = any(started - RESTART_GRACE_S <= t <= ended for t in disruptions())
        if verdict.status not in (502, 503) or not near:
            verdict = Verdict(FAILED, f"unexplained by a restart: {verdict.detail}", verdict.status)
    return Outcome(kind, verdict.outcome, started, ended, verdict.detail, verdict.status)
