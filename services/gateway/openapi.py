"""What /openapi.json says about errors and content types, beyond what FastAPI derives from the routes.

Every error the gateway answers has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`
(ErrorBody); each route lists the statuses it can answer with (`responses(...)`). FastAPI's own 422
(its validation error) never happens here, since the app turns it into a 400, so `document()` removes
it from every operation, and states the batch limit of this gateway's config.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    message: str = Field(description="what is wrong, for a person")
    type: str = Field(description="invalid_request_error, not_found_error, authentication_error, "
                                  "rate_limit_error, service_unavailable, timeout or internal_error")
    param: str | None = Field(description="the offending field's path (`messages.0.content`), if one is")
    code: int = Field(description="the HTTP status")


class ErrorBody(BaseModel):
    """Every error response, on every route (and the `error` event that ends a failed stream)."""

    error: ErrorDetail


class ProbeBody(BaseModel):
    """/health, /ping and /ready answer with this whether up (200) or not (503): a probe reads the status."""

    status: str = Field(description="ok, or why not: nats disconnected, no live worker (serving `model`) yet")
    workers: int = Field(description="live workers (those serving `model`, for /ready with one)")
    models: list[str] | None = Field(None, description="/ready when ok: the models live workers serve")


_WHY = {
    400: "Bad request: invalid JSON, a field of the wrong type or out of range (`param` names it)",
    401: "Missing, unknown or revoked API key (when the gateway requires keys)",
    404: "Unknown route, or a model no live worker serves",
    405: "Method not allowed on this route",
    413: "Body larger than the gateway accepts (--max-request-bytes, default NATS max_payload)",
    429: "The API key's rate limit is reached (Retry-After says when to retry)",
    500: "An unexpected failure inside the gateway (logged with its traceback)",
    503: "No live worker or tokenizer, or the key store is unreachable",
    504: "No output within --first-output-timeout",
}

# Every route but the exempt ones (/health, /metrics, the docs) can meet the API-key check (401, 429,
# and 503 when Redis is down) and the last-resort handler (500).
GUARDED = (401, 429, 500, 503)
WITH_BODY = (400, 413, *GUARDED)
GENERATION = (*WITH_BODY, 404, 504)

SSE = "text/event-stream"


def responses(*statuses: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for these error statuses; `stream`: 200 may also be an SSE stream."""
    out: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorBody, "description": _WHY[status]} for status in sorted(set(statuses))
    }
    if stream:
        out[200] = {
            "description": "The answer, or with `stream: true` an SSE stream of chunks ending in `data: [DONE]`",
            # Each SSE event's `data` is one JSON chunk, or `[DONE]` last.
            "content": {"application/json": {"schema": {}},
                        SSE: {"schema": {"type": "object", "properties": {"data": {"type": "string"}}}}},
        }
    return out


def probe(up: str, down: str) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for a probe: 200 (`up`) and 503 (`down`) both with ProbeBody; 500 as everywhere."""
    return {200: {"model": ProbeBody, "description": up}, 503: {"model": ProbeBody, "description": down},
            **responses(500)}


def plain_text(content_type: str, description: str) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for a route whose 200 is text in `content_type` (and the last-resort 500)."""
    return {200: {"description": description, "content": {content_type: {"schema": {"type": "string"}}}},
            **responses(500)}


def document(schema: dict[str, Any], max_batch_size: int) -> dict[str, Any]:
    """The generated document, corrected: no 422 anywhere; prompt lists state `max_batch_size`."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for model, fields in (("CompletionRequest", ("prompt",)), ("GenerateBody", ("text", "input_ids"))):
        properties = components.get(model, {}).get("properties", {})
        for field in fields:
            for option in properties.get(field, {}).get("anyOf", []):
                if option.get("type") == "array" and option.get("x-batch"):
                    option["maxItems"] = max_batch_size
                    option.pop("x-batch")
    return schema
