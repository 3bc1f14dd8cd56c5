"""OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Each of the n choices (and each prompt of a batch) is its own request, routed on its own; their
outputs are merged into one response or one SSE stream (`data: {...}` chunks, `data: [DONE]` last).
`usage` counts each prompt once, with `prompt_tokens_details.cached_tokens` from the prefix cache.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.gateway.completion import Completion, token_texts, top_logprob_texts
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import NOT_FOUND, GatewayError
from services.gateway.http_streaming import routing_headers, sse, start_stream, unless_disconnected
from services.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.openapi import GENERATION, GUARDED, responses
from services.gateway.reasoning import ReasoningSplitter
from services.gateway.router import model_matches
from services.gateway.streams import RequestStream
from services.gateway.tool_calls import ToolCallStreamer
from shared.protocol import Finish, PromptLogprobs, StreamOut, TopLogprob

router = APIRouter(tags=["OpenAI-compatible"])


def dispatcher_of(request: Request) -> Dispatcher:
    return request.app.state.dispatcher  # type: ignore[no-any-return]


# ---- /v1/models ---------------------------------------------------------------------------------


def _model_card(dispatcher: Dispatcher, model: str, created: int) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "radixserve",
        "max_model_len": dispatcher.context_len(model),
    }


@router.get("/v1/models", responses=responses(*GUARDED))
async def list_models(request: Request) -> dict[str, Any]:
    """The models live workers serve."""
    dispatcher = dispatcher_of(request)
    created = request.app.state.started
    return {"object": "list", "data": [_model_card(dispatcher, m, created) for m in dispatcher.registry.models()]}


@router.get("/v1/models/{model:path}", responses=responses(*GUARDED, 404))
async def get_model(model: str, request: Request) -> dict[str, Any]:
    dispatcher = dispatcher_of(request)
    for served in dispatcher.registry.models():
        if model_matches(model, served):
            return _model_card(dispatcher, served, request.app.state.started)
    raise GatewayError(NOT_FOUND, f"model {model!r} is not served here", "model")


# ---- response pieces ----------------------------------------------------------------------------


def finish_reason(finish: Finish | None) -> str | None:
    return None if finish is None else finish.type


def usage(completions: list[Completion], n: int) -> dict[str, Any]:
    """Token counts: each prompt once (the first of its n choices), every choice's output."""
    firsts = completions[::n]
    prompt = sum(c.usage.prompt_tokens for c in firsts)
    generated = sum(c.usage.completion_tokens for c in completions)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": sum(c.usage.cached_tokens for c in firsts)},
    }


def _token_entry(text: str, logprob: float) -> dict[str, Any]:
    # A fallback name ("token_id:N") has no bytes of its own.
    raw = None if text.startswith("token_id:") else list(text.encode("utf-8"))
    return {"token": text, "logprob": logprob, "bytes": raw}


def chat_logprobs(
    texts: list[str], logprobs: list[float], tops: list[list[TopLogprob]], top_texts: list[list[str]]
) -> dict[str, Any]:
    content = []
    for i, (text, logprob) in enumerate(zip(texts, logprobs)):
        entry = _token_entry(text, logprob)
        step = tops[i] if i < len(tops) else []
        names = top_texts[i] if i < len(top_texts) else []
        entry["top_logprobs"] = [_token_entry(name, c.logprob) for name, c in zip(names, step)]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    texts: list[str],
    logprobs: list[float],
    tops: list[list[TopLogprob]],
    top_texts: list[list[str]],
    offset: int,
) -> dict[str, Any]:
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top = [{name: c.logprob for name, c in zip(names, step)} for names, step in zip(top_texts, tops)]
    return {"tokens": texts, "token_logprobs": logprobs[: len(texts)], "top_logprobs": top or None, "text_offset": offsets}


def echo_logprobs(prompt: PromptLogprobs | None, top_n: int) -> dict[str, Any]:
    """The prompt's part of an echoed completion's logprobs (OpenAI's and vLLM's shape): its tokens from
    offset 0, the first with a null log-prob and null top_logprobs."""
    if prompt is None:  # a worker that sent none (it cannot compute them)
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [] if top_n else None, "text_offset": []}
    texts = prompt.texts if prompt.texts is not None else [f"token_id:{t}" for t in prompt.token_ids]
    part = completion_logprobs(texts, [], [], [], 0)
    part["token_logprobs"] = list(prompt.values)
    if top_n:
        names = prompt.top_texts or [None] * len(texts)
        part["top_logprobs"] = [
            None if step is None else {name: c.logprob for name, c in zip(step_names or [], step)}
            for step, step_names in zip(prompt.top or [None] * len(texts), names)
        ]
    return part


def echo_text(echo: str | None, prompt: PromptLogprobs | None) -> str:
    """A choice's echo: the text prompt, or a token-id prompt's text as the detokenizer decoded it."""
    if echo is not None:
        return echo
    return prompt.text or "" if prompt is not None else ""


def join_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two completion logprobs objects as one (the prompt's, then the answer's)."""
    tops = None if first["top_logprobs"] is None and then["top_logprobs"] is None else [
        *(first["top_logprobs"] or []), *(then["top_logprobs"] or [])]
    return {"tokens": first["tokens"] + then["tokens"], "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
            "top_logprobs": tops, "text_offset": first["text_offset"] + then["text_offset"]}


def _stream_logprobs(out: StreamOut) -> tuple[list[str], list[float], list[list[TopLogprob]], list[list[str]]]:
    values, tops = (out.logprobs.values, out.logprobs.top or []) if out.logprobs is not None else ([], [])
    return token_texts(out), list(values), list(tops), top_logprob_texts(out)


def _matched(finish: Finish | None) -> int | str | None:
    """The stop token id or string that ended a choice (SGLang's `matched_stop`); None otherwise."""
    return finish.matched if finish is not None and finish.type == "stop" else None


async def _submit(
    request: Request, body: ChatCompletionRequest | CompletionRequest, id_prefix: str
) -> tuple[list[RequestStream], dict[str, Any]]:
    """The body's generations submitted: their streams, and the fields the response (or each of its
    chunks) opens with: the id (`id_prefix`-rid of the first), the creation time and the model."""
    dispatcher = dispatcher_of(request)
    if isinstance(body, ChatCompletionRequest):
        if not dispatcher.registry.live():
            # The default length is the worker's context: wait (as routing would) to learn it.
            await dispatcher.registry.wait_for_worker(dispatcher.config.wait_for_worker)
        specs = body.specs(dispatcher.context_len(body.model), dispatcher.config.tool_call_parser)
    else:
        specs = body.specs(dispatcher.config.max_batch_size)
    for spec in specs:
        spec.stream = body.stream
    streams = await dispatcher.submit_all(specs)
    model = body.model or dispatcher.served_model(streams[0])
    return streams, {"id": f"{id_prefix}-{streams[0].rid}", "created": int(time.time()), "model": model}


async def _collect(request: Request, streams: list[RequestStream]) -> list[Completion]:
    dispatcher = dispatcher_of(request)

    def give_up() -> None:
        for stream in streams:
            dispatcher.release(stream)

    return await unless_disconnected(request, dispatcher.collect_all(streams), give_up)


# ---- /v1/chat/completions -----------------------------------------------------------------------


@router.post("/v1/chat/completions", response_model=None, responses=responses(*GENERATION, stream=True))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    """Chat: the messages go through the model's chat template (in the tokenizer service)."""
    dispatcher = dispatcher_of(request)
    streams, header = await _submit(request, body, "chatcmpl")
    reasoning = dispatcher.config.reasoning_parser if body.separate_reasoning else None
    tools = body.uses_tools()
    if body.stream:
        return await start_stream(
            request, dispatcher, streams, lambda outs: _chat_chunks(body, header, outs, reasoning, tools)
        )
    completions = await _collect(request, streams)
    choices = []
    for i, c in enumerate(completions):
        answer = AnswerReader(reasoning, tools)
        delta = answer.read(c.text, last=True)
        message: dict[str, Any] = {"role": "assistant", "content": delta.get("content", "")}
        if reasoning is not None:
            message["reasoning_content"] = delta.get("reasoning_content", "")
        if answer.calls:
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in delta["tool_calls"]]
            message["content"] = message["content"] if message["content"].strip() else None
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "logprobs": None,
            "finish_reason": answer.finish_reason(c.finish),
            "matched_stop": _matched(c.finish),
        }
        if body.logprobs:
            choice["logprobs"] = chat_logprobs(c.token_texts, c.logprobs, c.top_logprobs, c.top_logprob_texts)
        choices.append(choice)
    return JSONResponse(
        {**header, "object": "chat.completion", "choices": choices, "usage": usage(completions, body.n)},
        headers=routing_headers(streams),
    )


class AnswerReader:
    """One choice's answer as the client sees it: with a reasoning parser, the reasoning apart; with
    tools, the <tool_call> blocks as tool calls. Streamed text goes in delta by delta (text that may be
    half a tag waits for the next delta); a whole answer goes in once, as the last."""

    def __init__(self, reasoning_parser: str | None, tools: bool) -> None:
        self.reasoning = ReasoningSplitter.for_parser(reasoning_parser) if reasoning_parser else None
        self.tools = ToolCallStreamer() if tools else None

    @property
    def calls(self) -> int:
        return self.tools.calls if self.tools is not None else 0

    def read(self, text: str, last: bool) -> dict[str, Any]:
        """The delta for `text`: content, reasoning_content and tool_calls, the empty ones left out."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if last:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            first = self.tools.calls
            content, calls = self.tools.feed(content)
            calls = [{"index": first + k, **call} for k, call in enumerate(calls)]
            if last:
                content += self.tools.finish()
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, finish: Finish | None) -> str | None:
        """"tool_calls" when the model stopped after calling tools (OpenAI's reason), else the finish's."""
        reason = finish_reason(finish)
        return "tool_calls" if reason == "stop" and self.calls else reason


async def _chat_chunks(
    body: ChatCompletionRequest, header: dict[str, Any], outs: AsyncIterator[tuple[int, StreamOut]],
    reasoning: str | None = None, tools: bool = False,
) -> AsyncIterator[bytes]:
    extra: dict[str, Any] = {"usage": None} if body.include_usage else {}

    def chunk(index: int, delta: dict[str, Any], **fields: Any) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, **fields}
        return sse({**header, "object": "chat.completion.chunk", "choices": [choice], **extra})

    totals = [Completion(rid="") for _ in range(body.n)]
    answers = [AnswerReader(reasoning, tools) for _ in range(body.n)]
    for i in range(body.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for i, out in outs:
        totals[i].add(out)
        logprobs = chat_logprobs(*_stream_logprobs(out)) if body.logprobs and out.token_ids else None
        delta = answers[i].read(out.text, last=out.finish is not None)
        if delta or logprobs:
            yield chunk(i, delta, logprobs=logprobs)
        if out.finish is not None:
            yield chunk(i, {}, finish_reason=answers[i].finish_reason(out.finish), matched_stop=_matched(out.finish))
    if body.include_usage:
        yield sse({**header, "object": "chat.completion.chunk", "choices": [], "usage": usage(totals, body.n)})


# ---- /v1/completions ----------------------------------------------------------------------------


@router.post("/v1/completions", response_model=None, responses=responses(*GENERATION, stream=True))
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    """Text completion of a prompt (or a batch of prompts; token-id prompts too)."""
    dispatcher = dispatcher_of(request)
    streams, header = await _submit(request, body, "cmpl")
    prompts = body.prompts(dispatcher.config.max_batch_size)
    # None: a token-id prompt's echo, its text decoded by the detokenizer (it comes with its log-probs).
    echoes = [(p if isinstance(p, str) else None) if body.echo else "" for p in prompts for _ in range(body.n)]
    if body.stream:
        return await start_stream(
            request, dispatcher, streams, lambda outs: _completion_chunks(body, header, echoes, outs)
        )
    results = await _collect(request, streams)
    choices = []
    for i, c in enumerate(results):
        echo = echo_text(echoes[i], c.prompt_logprobs)
        choice: dict[str, Any] = {
            "index": i,
            "text": echo + c.text,
            "logprobs": None,
            "finish_reason": finish_reason(c.finish),
            "matched_stop": _matched(c.finish),
        }
        if body.logprobs is not None:
            choice["logprobs"] = completion_logprobs(
                c.token_texts, c.logprobs, c.top_logprobs, c.top_logprob_texts, len(echo)
            )
            if body.echo:
                choice["logprobs"] = join_logprobs(echo_logprobs(c.prompt_logprobs, body.logprobs), choice["logprobs"])
        choices.append(choice)
    return JSONResponse(
        {**header, "object": "text_completion", "choices": choices, "usage": usage(results, body.n)},
        headers=routing_headers(streams),
    )


async def _completion_chunks(
    body: CompletionRequest, header: dict[str, Any], echoes: list[str | None], outs: AsyncIterator[tuple[int, StreamOut]]
) -> AsyncIterator[bytes]:
    extra: dict[str, Any] = {"usage": None} if body.include_usage else {}

    def chunk(index: int, text: str, **fields: Any) -> bytes:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None, **fields}
        return sse({**header, "object": "text_completion", "choices": [choice], **extra})

    totals = [Completion(rid="") for _ in echoes]
    # An echo with logprobs (or of a token-id prompt) waits for the prompt's log-probs (and text), which
    # come with the first output.
    echo_waits = body.logprobs is not None
    sent: list[str | None] = [None] * len(echoes)  # each choice's echo, once sent
    for i, echo in enumerate(echoes):
        if echo is not None and not (echo and echo_waits):
            sent[i] = echo
            if echo:
                yield chunk(i, echo)
    async for i, out in outs:
        if sent[i] is None:
            prompt = out.logprobs.prompt if out.logprobs is not None else None
            sent[i] = echo = echo_text(echoes[i], prompt)
            logprobs = echo_logprobs(prompt, body.logprobs) if body.logprobs is not None else None
            yield chunk(i, echo, logprobs=logprobs)
        offset = len(sent[i] or "") + len(totals[i].text)
        totals[i].add(out)
        logprobs = None
        if body.logprobs is not None and out.token_ids:
            logprobs = completion_logprobs(*_stream_logprobs(out), offset)
        if out.text or logprobs:
            yield chunk(i, out.text, logprobs=logprobs)
        if out.finish is not None:
            yield chunk(i, "", finish_reason=finish_reason(out.finish), matched_stop=_matched(out.finish))
    if body.include_usage:
        yield sse({**header, "object": "text_completion", "choices": [], "usage": usage(totals, body.n)})
