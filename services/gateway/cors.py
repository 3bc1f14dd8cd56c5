"""CORS for the gateway's HTTP API (`--allowed-origins`): a browser page on another origin may call it.

Starlette's CORSMiddleware does the work, with two changes so that every answer keeps the gateway's
rules (docs/API.md, "CORS"):
- a request from an origin that is not allowed is handed on untouched, as if CORS were off: it gets no
  CORS header at all, and a preflight of it the route's own answer (a 405 in OpenAI's error shape,
  with Allow), which the browser reads as a refusal;
- a preflight of an allowed origin that still fails (a method no route could take) is a 400 in
  OpenAI's error shape, not Starlette's plain text.
Any method and any request header are allowed (the API key travels in Authorization), and the
gateway's own response headers are exposed to the page. The layer sits outside the API-key check
(a preflight carries no key) and outside every other layer, so each response of an allowed origin,
JSON, streamed or an error, carries Access-Control-Allow-Origin.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import bad_request
from services.gateway.http_streaming import GATEWAY_HEADER, WORKER_HEADER

# Response headers a page may read beyond the safelisted ones (a 429's Retry-After among them).
EXPOSED_HEADERS = (WORKER_HEADER, GATEWAY_HEADER, "Retry-After")
PREFLIGHT_MAX_AGE_S = 600


class Cors(CORSMiddleware):
    """CORS for `origins` (`("*",)`: any origin); see the module docstring."""

    def __init__(self, app: ASGIApp, origins: tuple[str, ...]) -> None:
        super().__init__(
            app, allow_origins=origins, allow_methods=["*"], allow_headers=["*"], expose_headers=EXPOSED_HEADERS,
            # The operator named these origins: a page there may also reach a gateway on a private address.
            allow_private_network=True, max_age=PREFLIGHT_MAX_AGE_S,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None or not self.is_allowed_origin(origin):
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            scope.setdefault("state", {})["endpoint"] = "cors_preflight"  # its label in /metrics
        await super().__call__(scope, receive, send)

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        # Starlette's "Disallowed CORS method" (or headers): the origin is allowed, so it may read why.
        error = bad_request(f"CORS preflight refused: {bytes(response.body).decode()}")
        origin = {"Access-Control-Allow-Origin": request_headers["origin"], "Vary": "Origin"}
        return JSONResponse(error.body(), status_code=error.status, headers=origin)
