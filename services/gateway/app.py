"""The FastAPI application: OpenAI-compatible and native routes over one Dispatcher, with the error
mapping every route shares.

- a body that is not JSON, or has a field of the wrong type or out of range: 400 naming the field
  (FastAPI's 422 is turned into 400, in OpenAI's error shape);
- GatewayError: its status (404 unknown model, 413 too large, 503 no worker, ...);
- a body over the size limit: 413 before it is read in full (the limit defaults to NATS max_payload,
  since a larger request could never be published);
- a string that is not valid Unicode (a lone surrogate, which JSON's `\\ud800` escapes can spell) or
  an integer beyond 64 bits, anywhere in a body's fields (free-form ones too): 400 naming the field
  (openai_protocol.RequestBody), since nothing downstream could encode it;
- an unknown route or method: 404 / 405, and anything unexpected: 500 (logged with its traceback),
  all in the same OpenAI error shape (LastResort, and FastAPI's handlers).
Every answered request is counted in /metrics by route and final status (an SSE stream that ends in an
error event counts with that error's status).

POST /generate, /v1/completions and /v1/chat/completions with a JSON body that validates are served by
JsonFastPath, which calls the route's own function without FastAPI's per-request routing and dependency
machinery; every other request, and any body that would be an error, goes through FastAPI as before.
What that saves, measured: docs/ARCHITECTURE.md, "The gateway's own ASGI layers".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway import alias_routes, native_api, openai_api, tokenize_api
from services.gateway.auth import ApiKeyAuth
from services.gateway.cors import Cors
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import BAD_REQUEST, INTERNAL_ERROR, PAYLOAD_TOO_LARGE, GatewayError, bad_request
from services.gateway.http_streaming import GATEWAY_HEADER
from services.gateway.metrics import begin_request
from services.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.openapi import document
from services.gateway.playground_routes import router as playground_router
from shared import trace

logger = logging.getLogger(__name__)

# Loc entries pydantic adds for the member of a union it tried; not part of the field's path.
_UNION_TAGS = {"str", "int", "float", "bool", "none"}
_UNION_TAG_PREFIXES = ("list[", "dict[", "function-", "literal[")


def field_path(loc: tuple[Any, ...]) -> str | None:
    """`messages.0.content` from pydantic's ("body", "messages", 0, "content")."""
    parts = [str(p) for p in loc if p != "body"]
    kept: list[str] = []
    for part in parts:
        if part in _UNION_TAGS or part.startswith(_UNION_TAG_PREFIXES) or part[:1].isupper():
            break
        kept.append(part)
    return ".".join(kept) or None


def validation_error(exc: RequestValidationError) -> GatewayError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", "body")
    field = field_path(tuple(first.get("loc", ())))
    if field is None:
        return bad_request(f"body: {first['msg']}", "body")
    return bad_request(f"{field}: {first['msg']}", field)


class BodyLimit:
    """413 for a body larger than `limit()` bytes: by Content-Length at once, else while it is read
    (the body is read here in full, at most `limit` bytes, and handed on in one piece)."""

    def __init__(self, app: ASGIApp, limit: Callable[[], int]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(limit, int(declared))(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await _too_large(limit, size)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)


def _replay(first: list[Message], receive: Receive) -> Receive:
    """A receive that returns `first` messages, then those of `receive` (a later disconnect)."""
    pending = list(first)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def error_response(exc: GatewayError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


_JSON = msgspec.json.Decoder()

# A JSON-body route's function, as FastAPI calls it: the validated body and the request.
JsonEndpoint = Callable[[Any, Request], Awaitable[Response]]


class JsonFastPath:
    """POST routes whose body is one pydantic model, served without FastAPI's per-request machinery
    (matching every included router's routes, its exit-stack and exception middlewares, dependency
    solving; the measured gain is in docs/ARCHITECTURE.md). Only a body FastAPI would accept is served
    here, by the same function and the same validation (the JSON parsed, then the model); anything else
    (another route or method, a content type other than application/json, invalid JSON, a body that does
    not validate) is handed on to FastAPI untouched, so every 4xx keeps its status and message. The JSON
    is parsed by msgspec (half the time of json.loads on a 512-id prompt); what it refuses and json.loads
    would take (a byte-order mark, a lone surrogate escape, a number past float range) goes to FastAPI
    too, which reads it as before. Sits inside BodyLimit, which hands on the whole body in one message,
    and wraps the FastAPI app itself (create_app)."""

    def __init__(self, app: ASGIApp, routes: dict[str, tuple[type[BaseModel], JsonEndpoint]]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or (b"content-type", b"application/json") not in scope["headers"]:
            await self.app(scope, receive, send)
            return
        message = await receive()
        try:
            body = route[0].model_validate(_JSON.decode(message["body"]))
        except Exception:  # noqa: BLE001 - whatever fails here, FastAPI answers as it always has
            await self.app(scope, _replay([message], receive), send)
            return
        if trace.TRACE_DIR is not None and isinstance(getattr(body, "rid", None), str):
            trace.mark(body.rid, "gateway.http")
        scope.setdefault("state", {})["endpoint"] = scope["path"]
        scope.setdefault("app", self.app)  # what Starlette sets: the route reads request.app.state
        try:
            response = await route[1](body, Request(scope, receive))
        except GatewayError as exc:
            response = error_response(exc)
        await response(scope, receive, send)


def internal_error() -> JSONResponse:
    error = GatewayError(INTERNAL_ERROR, "internal error in the gateway (its log has the traceback)")
    return error_response(error)


class LastResort:
    """Any exception no route handled: logged with its traceback and answered with a 500 in the
    OpenAI error shape (if the response has not started; else the connection ends). FastAPI answers
    its own routes' exceptions (on_unexpected) and raises them on, to be logged here."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception:
            logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                await internal_error()(scope, receive, send)


def _too_large(limit: int, size: int) -> JSONResponse:
    error = GatewayError(PAYLOAD_TOO_LARGE, f"the body has {size} bytes or more; the limit is {limit} bytes", "body")
    return JSONResponse(error.body(), status_code=error.status)


class CountRequests:
    """Count each request by route and final status in the gateway's metrics, and name the gateway
    in a response header (several gateway processes may share one port)."""

    def __init__(self, app: ASGIApp, dispatcher: Dispatcher) -> None:
        self.app = app
        self.dispatcher = dispatcher
        self.header = (GATEWAY_HEADER.encode(), dispatcher.gateway_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        self.dispatcher.bus.poller.touch()
        begin_request()

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or scope.get("state", {}).get("endpoint") or "unmatched"
            final = scope.get("state", {}).get("stream_status", status)
            self.dispatcher.metrics.count(endpoint, final)


def create_app(dispatcher: Dispatcher, max_body_bytes: int = 0) -> ASGIApp:
    """The gateway's HTTP app over a started Dispatcher. `max_body_bytes` 0: NATS max_payload.

    The gateway's own layers (counting, API keys, the body limit, JsonFastPath) wrap the FastAPI app
    rather than sit in its middleware stack, so a request JsonFastPath serves never passes through
    FastAPI's and Starlette's own layers (its error, telemetry and body-limit middlewares, the app and
    router calls). Every other request reaches FastAPI through the same layers as before, in the same
    order."""
    api = fastapi_app(dispatcher)
    app: ASGIApp = JsonFastPath(api, routes={
        "/generate": (native_api.GenerateBody, native_api.generate),
        "/v1/completions": (CompletionRequest, openai_api.completions),
        "/v1/chat/completions": (ChatCompletionRequest, openai_api.chat_completions),
    })
    app = BodyLimit(app, limit=lambda: max_body_bytes or dispatcher.bus.max_payload)
    if dispatcher.keys.enabled:
        app = ApiKeyAuth(app, store=dispatcher.keys)  # inside CountRequests: 401/429 are counted
    app = LastResort(app)
    origins = dispatcher.config.origins()
    if origins:
        app = Cors(app, origins)  # outside the key check (a preflight has no key) and around every answer
    return CountRequests(app, dispatcher=dispatcher)


def fastapi_app(dispatcher: Dispatcher) -> FastAPI:
    """The routes and their error mapping (create_app wraps this in the gateway's own layers)."""
    app = FastAPI(
        title="radixserve gateway",
        description="OpenAI-compatible and SGLang-style APIs over radixserve's NATS pipeline.",
        version=native_api.VERSION,
    )
    app.state.dispatcher = dispatcher
    app.state.started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc)
        return JSONResponse(error.body(), status_code=BAD_REQUEST)

    @app.exception_handler(GatewayError)
    async def on_gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own: an unknown route (404), a method the route does not take (405, with Allow).
        error = GatewayError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        headers = exc.headers
        if exc.status_code == 405:
            # Starlette names the first matching route's methods; a path may have several routes.
            allowed = {m for r in routes if r.path_regex.match(request.url.path) for m in r.methods or ()}
            headers = {"Allow": ", ".join(sorted(allowed))}
        return JSONResponse(error.body(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return internal_error()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(FastAPI.openapi(app), dispatcher.config.max_batch_size)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    routers = (openai_api.router, native_api.router, tokenize_api.router, alias_routes.router, playground_router)
    for router in routers:
        app.include_router(router)
    routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]
    return app
