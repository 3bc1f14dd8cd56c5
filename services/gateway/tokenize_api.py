"""The tokenizer's routes: `/tokenize` (a prompt, or chat messages through the model's chat template,
to the ids the model gets) and `/detokenize` (ids back to text), in vLLM's shapes; answered by the
tokenizer service on `{p}.tokenize.text`, or in the gateway with `--local-tokenizer`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import ConfigDict, WithJsonSchema, field_validator

from services.gateway.errors import bad_request
from services.gateway.generate_spec import check_token_ids, validate_template_kwargs
from services.gateway.native_api import dispatcher_of
from services.gateway.openai_protocol import ChatMessageIn
from services.gateway.openapi import WITH_BODY, responses
from services.gateway.request_body import RequestBody, TemplateKwargs, TokenId, not_null
from shared.protocol import PROTOCOL_VERSION, TextTokenize

router = APIRouter(tags=["native"])


class TokenizeBody(RequestBody):
    """POST /tokenize (vLLM's shape): a `prompt` or chat `messages`."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
        "if": {"properties": {"chat_template_kwargs": {"type": "object", "minProperties": 1}},
               "required": ["chat_template_kwargs"]},
        "then": {"required": ["messages"]}})

    model: str | None = None
    prompt: Annotated[str | None, WithJsonSchema({"type": "string"})] = None
    messages: Annotated[list[ChatMessageIn] | None, WithJsonSchema(
        {"type": "array", "items": {"$ref": "#/components/schemas/ChatMessageIn"}, "minItems": 1})] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs | None = None
    tools: list[dict[str, Any]] | None = None

    _present = field_validator("prompt", "messages", mode="before")(not_null)


class DetokenizeBody(RequestBody):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]


@router.post("/tokenize", responses=responses(*WITH_BODY, 404))
async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
    """The ids the model gets for a prompt, or for chat messages through its chat template."""
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.messages is not None and not body.messages:
        raise bad_request("messages must not be empty", "messages")
    validate_template_kwargs(body.chat_template_kwargs, has_messages=body.messages is not None)
    messages = [m.message(i) for i, m in enumerate(body.messages)] if body.messages is not None else None
    msg = TextTokenize(
        v=PROTOCOL_VERSION, text=body.prompt, messages=messages, add_special_tokens=body.add_special_tokens,
        add_generation_prompt=body.add_generation_prompt, chat_template_kwargs=body.chat_template_kwargs or None,
        tools=body.tools or None,
    )
    answer = await dispatcher_of(request).tokenize_text(body.model, msg)
    ids = answer.input_ids or []
    return {"count": len(ids), "max_model_len": answer.context_len, "tokens": ids}


@router.post("/detokenize", responses=responses(*WITH_BODY, 404))
async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
    """The text of token ids (special tokens included)."""
    check_token_ids(body.tokens, "tokens")
    answer = await dispatcher_of(request).tokenize_text(body.model, TextTokenize(v=PROTOCOL_VERSION, input_ids=body.tokens))
    return {"prompt": answer.text or ""}
