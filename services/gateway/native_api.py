"""SGLang-style native routes: `/generate`, `/health`, `/ready`, `/health_generate`, `/get_model_info`,
`/get_server_info`, `/flush_cache`, `/abort_request`, `/metrics` (other names for some of them, as vLLM
and newer SGLang spell them: alias_routes.py).

`/generate` answers in SGLang's shape, `{"text", "output_ids", "meta_info"}` (a list for a batch or
n > 1). Streamed, like SGLang's HTTP server, each SSE chunk carries the text and ids so far, not a
delta; `meta_info.finish_reason` is null until the last chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ConfigDict, Field, WithJsonSchema, field_validator

from services.gateway.auth import current_key, require_admin
from services.gateway.completion import Completion
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import SERVICE_UNAVAILABLE, GatewayError, bad_request
from services.gateway.generate_spec import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    GenerateSpec,
    check_token_ids,
)
from services.gateway.http_streaming import routing_headers, sse, start_stream, unless_disconnected
from services.gateway.metrics import CONTENT_TYPE
from services.gateway.openapi import GENERATION, GUARDED, WITH_BODY, plain_text, probe, responses
from services.gateway.request_body import (
    ID_PROMPTS,
    REQUEST_TIMEOUT,
    TEXT_PROMPTS,
    Count,
    RequestBody,
    SamplingValues,
    logit_bias_ids,
    not_null,
)
from services.gateway.streams import RequestStream
from shared.protocol import PROTOCOL_VERSION, Sampling, StreamOut
from shared.sampling_params import INT32_MAX

router = APIRouter(tags=["native"])

HEALTH_GENERATE_TIMEOUT_S = 30.0


def _package_version() -> str:
    """The installed radixserve's version (/version, /get_server_info, /openapi.json)."""
    try:
        return version("radixserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


VERSION = _package_version()


def dispatcher_of(request: Request) -> Dispatcher:
    return request.app.state.dispatcher  # type: ignore[no-any-return]


class NativeSampling(SamplingValues):
    """SGLang's sampling_params (names and meanings of SamplingParams). An unknown key is a 400, not
    ignored: a constraint the server silently dropped would change the answer unseen."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_new_tokens: Count | None = None
    min_new_tokens: Count | None = Field(None, description="at most max_new_tokens")
    # Constrained decoding (one of json_schema, regex, ebnf): a JSON schema as JSON text (as SGLang takes
    # it) or an object.
    json_schema: str | dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=MAX_N)

    def sampling(self, choice: int) -> Sampling:
        values = self.model_dump(exclude={"n", "stop", "seed", "logit_bias", "json_schema"})
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        seed = None if self.seed is None else self.seed + choice
        schema = json.dumps(self.json_schema) if isinstance(self.json_schema, dict) else self.json_schema
        return Sampling(**values, stop=stop, seed=seed, logit_bias=logit_bias_ids(self.logit_bias),
                        json_schema=schema)


class GenerateBody(RequestBody):
    """POST /generate: `text` or `input_ids` (one prompt, or a list of them: a batch)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={
        "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]})

    text: Annotated[str | list[str] | None, WithJsonSchema({"anyOf": TEXT_PROMPTS})] = None
    input_ids: Annotated[list[int] | list[list[int]] | None, WithJsonSchema({"anyOf": ID_PROMPTS})] = None
    sampling_params: NativeSampling = Field(default_factory=NativeSampling)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: int = Field(-1, ge=-1, le=INT32_MAX, description="with return_logprob: meta_info.input_token_logprobs "
                                   "lists the prompt's tokens from this position on (-1: none)")
    rid: str | list[str] | None = Field(None, description="one per prompt of a batch")
    model: str | None = None
    timeout: float | None = Field(None, gt=0, le=86_400, description=REQUEST_TIMEOUT)

    _present = field_validator("text", "input_ids", mode="before")(not_null)

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """The prompts and whether the body held a single one."""
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("give exactly one of text or input_ids", "text")
        if isinstance(self.text, str):
            return [self.text], True
        if self.text is not None:
            return list(self.text), False
        ids = self.input_ids or []
        # Validated as list[int] | list[list[int]]: the first item tells which.
        if ids and isinstance(ids[0], int):
            return [list(ids)], True  # type: ignore[arg-type]
        return list(ids), False  # type: ignore[arg-type]

    def specs(self, max_batch: int | None = None) -> tuple[list[GenerateSpec], bool]:
        prompts, single = self.prompts()
        field = "text" if self.text is not None else "input_ids"
        if not prompts:
            raise bad_request("the batch is empty", field)
        if max_batch is not None and len(prompts) > max_batch:
            raise bad_request(f"{field}: a batch of {len(prompts)} prompts; the limit is {max_batch}", field)
        for prompt in prompts:
            if isinstance(prompt, list):
                check_token_ids(prompt, "input_ids")
        n = self.sampling_params.n
        rids = [self.rid] if isinstance(self.rid, str) else self.rid
        if rids is not None and len(rids) != len(prompts):
            raise bad_request(f"rid has {len(rids)} entries for {len(prompts)} prompts", "rid")
        specs = []
        for p, prompt in enumerate(prompts):
            for i in range(n):
                rid = None if rids is None else (rids[p] if n == 1 else f"{rids[p]}-{i}")
                specs.append(
                    GenerateSpec(
                        sampling=self.sampling_params.sampling(i),
                        text=prompt if isinstance(prompt, str) else None,
                        input_ids=prompt if isinstance(prompt, list) else None,
                        model=self.model,
                        rid=rid,
                        return_logprob=self.return_logprob,
                        top_logprobs_num=self.top_logprobs_num,
                        logprob_start_len=self.logprob_start_len,
                        timeout=self.timeout,
                    )
                )
        return specs, single and n == 1


def meta_info(c: Completion, started: float, finished: bool, return_logprob: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": c.rid,
        "finish_reason": msgspec.to_builtins(c.finish) if finished and c.finish else None,
        "prompt_tokens": c.usage.prompt_tokens,
        "completion_tokens": c.usage.completion_tokens if finished else len(c.token_ids),
        "cached_tokens": c.usage.cached_tokens,
        "e2e_latency": time.monotonic() - started,
    }
    if finished and c.usage.spec_accept_length is not None:
        # Like SGLang: present only for a request that ran speculative decoding.
        meta["spec_accept_length"] = c.usage.spec_accept_length
        meta["spec_accept_rate"] = c.usage.spec_accept_rate
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(c.logprobs, c.token_ids)]
        meta["output_top_logprobs"] = [[[t.logprob, t.token_id, None] for t in step] for step in c.top_logprobs]
        prompt = c.prompt_logprobs
        if prompt is not None:  # SGLang's shape: prompt tokens from logprob_start_len, the first without a log-prob
            meta["input_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(prompt.values, prompt.token_ids)]
            if prompt.top is not None:
                meta["input_top_logprobs"] = [
                    None if step is None else [[t.logprob, t.token_id, None] for t in step] for step in prompt.top
                ]
    return meta


@router.post("/generate", response_model=None, responses=responses(*GENERATION, stream=True))
async def generate(body: GenerateBody, request: Request) -> JSONResponse | StreamingResponse:
    """Generate from text or token ids, SGLang's way."""
    dispatcher = dispatcher_of(request)
    specs, single = body.specs(dispatcher.config.max_batch_size)
    for spec in specs:
        spec.stream = body.stream
    streams = await dispatcher.submit_all(specs)
    want_lp = body.return_logprob or body.top_logprobs_num > 0
    if body.stream:
        return await start_stream(request, dispatcher, streams, lambda outs: _chunks(streams, single, want_lp, outs))

    def give_up() -> None:
        for stream in streams:
            dispatcher.release(stream)

    results = await unless_disconnected(request, dispatcher.collect_all(streams), give_up)
    items = [
        {"text": c.text, "output_ids": c.token_ids, "meta_info": meta_info(c, s.started, True, want_lp)}
        for c, s in zip(results, streams)
    ]
    return JSONResponse(items[0] if single else items, headers=routing_headers(streams))


async def _chunks(streams: list[RequestStream], single: bool, want_lp: bool, outs: Any) -> Any:
    totals = [Completion(rid=s.rid) for s in streams]
    index: int
    out: StreamOut
    async for index, out in outs:
        totals[index].add(out)
        c, finished = totals[index], out.finish is not None
        item = {"text": c.text, "output_ids": c.token_ids, "meta_info": meta_info(c, streams[index].started, finished, want_lp)}
        if not single:
            item["index"] = index
        yield sse(item)


HEALTH_RESPONSES = probe("Connected to NATS", "NATS is disconnected")


@router.get("/health", responses=HEALTH_RESPONSES)
async def health(request: Request) -> JSONResponse:
    """200 while this gateway is connected to NATS (whether or not a worker is up)."""
    dispatcher = dispatcher_of(request)
    workers = len(dispatcher.registry.live())
    if not dispatcher.bus.nc.is_connected:
        return JSONResponse({"status": "nats disconnected", "workers": workers}, status_code=SERVICE_UNAVAILABLE)
    return JSONResponse({"status": "ok", "workers": workers})


@router.get("/ready", responses=probe("A live worker serves `model` (any model when not given)",
                                      "NATS is disconnected, or no live worker serves `model` yet"))
async def ready(request: Request, model: str | None = None) -> JSONResponse:
    """200 while this gateway is connected to NATS and a live worker (not draining) serves `model`
    (any model when not given): the readiness probe, where /health is liveness only."""
    dispatcher = dispatcher_of(request)
    workers = len(dispatcher.registry.live(model))
    if not dispatcher.bus.nc.is_connected:
        return JSONResponse({"status": "nats disconnected", "workers": workers}, status_code=SERVICE_UNAVAILABLE)
    if workers == 0:
        wanted = f"serving {model!r} " if model else ""
        return JSONResponse({"status": f"no live worker {wanted}yet", "workers": 0}, status_code=SERVICE_UNAVAILABLE)
    return JSONResponse({"status": "ok", "workers": workers, "models": dispatcher.registry.models()})


@router.get("/health_generate", responses=responses(*GUARDED, 504))
async def health_generate(request: Request) -> JSONResponse:
    """200 once a one-token generation went through the whole pipeline; 503 otherwise."""
    dispatcher = dispatcher_of(request)
    spec = GenerateSpec(sampling=Sampling(max_new_tokens=1, temperature=0.0), text="Hello")
    stream = await dispatcher.submit(spec)
    try:
        (done,) = await asyncio.wait_for(dispatcher.collect_all([stream]), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        dispatcher.release(stream)
        raise GatewayError(SERVICE_UNAVAILABLE, f"no answer within {HEALTH_GENERATE_TIMEOUT_S:g} s") from None
    return JSONResponse({"status": "ok", "worker_id": stream.worker_id, "output_ids": done.token_ids})


@router.get("/get_model_info", responses=responses(*GUARDED))
async def get_model_info(request: Request) -> dict[str, Any]:
    """The served model (the first, if workers serve several) and all models with their workers."""
    dispatcher = dispatcher_of(request)
    models = dispatcher.registry.models()
    if not models:
        raise GatewayError(SERVICE_UNAVAILABLE, "no live worker")
    cards = []
    for model in models:
        workers = dispatcher.registry.live(model)
        cards.append(
            {
                "model_path": model,
                "context_len": max(w.load.context_len for w in workers),
                "max_total_tokens": max(w.load.max_total_tokens for w in workers),
                "workers": sorted(w.load.worker_id for w in workers),
            }
        )
    return {
        "model_path": models[0],
        "tokenizer_path": models[0],
        "is_generation": True,
        "context_len": cards[0]["context_len"],
        "models": cards,
    }


@router.get("/get_server_info", responses=responses(*GUARDED))
async def get_server_info(request: Request) -> dict[str, Any]:
    """This gateway, and each live worker's load, KV usage and cache stats (its get_info reply)."""
    dispatcher = dispatcher_of(request)
    replies = await dispatcher.control_all("get_info")
    workers = []
    for worker_id, reply in sorted(replies.items()):
        entry = dispatcher.registry.get(worker_id)
        item: dict[str, Any] = {"worker_id": worker_id, "ok": reply.ok}
        if entry is not None:
            item["load"] = msgspec.to_builtins(entry.load)
        if reply.info is not None:
            item["info"] = msgspec.to_builtins(reply.info)
        if reply.message:
            item["message"] = reply.message
        workers.append(item)
    return {
        "version": VERSION,
        "gateway_id": dispatcher.gateway_id,
        "protocol_version": PROTOCOL_VERSION,
        "in_flight": len(dispatcher.hub),
        "config": {
            name: getattr(dispatcher.config, name)
            for name in ("subject_prefix", "worker_ttl", "worker_dead_after", "wait_for_worker", "first_output_timeout")
        },
        "workers": workers,
    }


_FLUSH_RESPONSES = {**responses(*GUARDED), 400: {"description": "A worker refused: success false, each's answer"}}


@router.post("/flush_cache", responses=_FLUSH_RESPONSES)
async def flush_cache(request: Request) -> JSONResponse:
    """Empty every live worker's prefix cache (admin keys only); 400 if a worker refuses (it has
    requests in flight)."""
    dispatcher = dispatcher_of(request)
    require_admin(dispatcher.keys, current_key.get(), "flush_cache")
    replies = await dispatcher.control_all("flush_cache")
    results = {wid: {"ok": r.ok, "message": r.message} for wid, r in replies.items()}
    ok = all(r.ok for r in replies.values())
    return JSONResponse({"success": ok, "workers": results}, status_code=200 if ok else 400)


# SGLang takes GET too.
router.add_api_route("/flush_cache", flush_cache, methods=["GET"], responses=_FLUSH_RESPONSES)


class AbortBody(RequestBody):
    """A request id, or abort_all: true."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"anyOf": [
        {"properties": {"rid": {"type": "string", "minLength": 1}}, "required": ["rid"]},
        {"properties": {"abort_all": {"const": True}}, "required": ["abort_all"]}]})
    rid: str | None = None
    abort_all: bool = False


@router.post("/abort_request", responses=responses(*WITH_BODY))
async def abort_request(body: AbortBody, request: Request) -> dict[str, Any]:
    """Abort a request by id (this gateway's or another's; a user key only its own: 403 otherwise), or
    every request of this gateway (admin keys only)."""
    dispatcher = dispatcher_of(request)
    key = current_key.get()
    if body.abort_all:
        require_admin(dispatcher.keys, key, "abort_all")
        rids = [s.rid for s in dispatcher.hub.in_flight()]
    elif body.rid:
        rids = [body.rid]
    else:
        raise bad_request("give rid or abort_all: true", "rid")
    found = await asyncio.gather(*(dispatcher.aborts.abort(rid, key) for rid in rids))
    return {"success": True, "aborted": rids, "in_flight_here": sum(found)}


@router.get("/metrics", response_class=Response, responses=plain_text(CONTENT_TYPE, "Prometheus text format"))
async def metrics(request: Request) -> Response:
    """Prometheus metrics of this gateway."""
    return Response(dispatcher_of(request).metrics.render(), media_type=CONTENT_TYPE)
