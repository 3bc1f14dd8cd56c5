"""What every HTTP request body shares: strict pydantic models (StrictModel; RequestBody for a whole
body), and the value types whose ranges the OpenAPI document states.

A type's range is checked by pydantic where its message is clear, else by the code that has its own
message (SamplingParams.verify, a request's own methods); `documented` then only states it in the
document, so /openapi.json says what the checks enforce.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, model_validator

from services.gateway.errors import bad_request
from shared.request_contract import RESERVED_TEMPLATE_KWARGS
from shared.sampling_params import INT32_MAX, MAX_TOKEN_ID

# JSON's safe integers: beyond 2**53 most JSON libraries (and JSON Schema validators) lose precision, so
# a bound there could not be stated exactly. NATS and gRPC clients may use all of int64.
JSON_SAFE_INT = 2**53 - 1
# logit_bias keys are token ids written in decimal; 9 digits hold every real vocabulary.
_BIAS_KEY = re.compile(r"[0-9]{1,9}")


def documented(**extra: Any) -> Any:
    """What the OpenAPI document adds to a value's schema, where the check itself is done elsewhere
    (SamplingParams.verify, the request's own methods) with a message of its own."""
    return Field(json_schema_extra=extra)


# Value types, as documented; the ranges are SamplingParams.verify's (which checks them for every door).
TokenId = Annotated[int, documented(minimum=0, maximum=MAX_TOKEN_ID)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=-JSON_SAFE_INT, le=JSON_SAFE_INT)]
Temperature = Annotated[float, documented(minimum=0)]
TopP = Annotated[float, documented(exclusiveMinimum=0, maximum=1)]
TopK = Annotated[int, WithJsonSchema({"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": INT32_MAX}],
                                      "description": "-1: off"})]
MinP = Annotated[float, documented(minimum=0, maximum=1)]
Penalty = Annotated[float, documented(minimum=-2, maximum=2)]
RepetitionPenalty = Annotated[float, documented(exclusiveMinimum=0)]
StopStrings = Annotated[str | list[str], WithJsonSchema(
    {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}}]})]
LogitBias = Annotated[dict[str, float], WithJsonSchema({
    "type": "object", "propertyNames": {"pattern": "^[0-9]{1,9}$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    "description": "token id (decimal, at most 9 digits) -> bias in [-100, 100] added to its logit before sampling",
})]
TemplateKwargs = Annotated[dict[str, Any], WithJsonSchema({
    "type": "object", "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}},
    "description": "extra chat template variables (chat messages only), e.g. {\"enable_thinking\": false} for Qwen3",
})]


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (JSON keys are strings: {"1234": -100}) keyed by token id; 400 naming
    logit_bias for a key that is not one. Ranges are checked with the rest of the sampling values."""
    if not bias:
        return None
    for key in bias:
        if not _BIAS_KEY.fullmatch(key):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r} (decimal, at most 9 digits)",
                              "logit_bias")
    return {int(key): value for key, value in bias.items()}


def not_null(value: object) -> object:
    """A field that may be left out but not sent as null (exactly-one-of fields: null is ambiguous)."""
    if value is None:
        raise ValueError("must not be null (leave it out instead)")
    return value


TOKEN_ID: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
# A prompt as text or as token ids, one or a batch ("x-batch": openapi.document() states the gateway's
# --max-batch-size there).
TEXT_PROMPTS: list[dict[str, Any]] = [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "x-batch": True}]
ID_PROMPTS: list[dict[str, Any]] = [
    {"type": "array", "items": TOKEN_ID, "minItems": 1},
    {"type": "array", "items": {"type": "array", "items": TOKEN_ID, "minItems": 1}, "minItems": 1, "x-batch": True}]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class SamplingValues(StrictModel):
    """The sampling fields both HTTP forms (native sampling_params, OpenAI bodies) take under
    shared.protocol.Sampling's own names and meanings; each form adds the ones it names its own way
    (tests/test_request_contract.py holds both to Sampling's fields)."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    seed: Seed | None = None
    logit_bias: LogitBias | None = None
    regex: str | None = Field(None, description="SGLang's extension: the output must match this regular expression")
    ebnf: str | None = Field(None, description="SGLang's extension: the output must match this grammar (GBNF or Lark)")


REQUEST_TIMEOUT = (
    "seconds the whole request may take (queue included); past it, it is aborted on its worker and ends "
    "with a 504 (an error event once streaming has begun)"
)


class RequestBody(StrictModel):
    """A whole request body.

    - An integer written as a whole float (`2.0`) is an integer in JSON Schema, so the document's
      `integer` fields take it too; the strict models do not, so a body they refuse is validated once
      more with every whole float as an int (only then: a body that validates pays nothing).
    - What JSON can say and msgpack cannot carry, in any field the body keeps (free-form ones too:
      tools, chat_template_kwargs), is made encodable or refused (`encodable`): a lone surrogate
      (JSON's `\\ud800` escape) is a 400 naming the field (GatewayError, which pydantic lets through)."""

    @model_validator(mode="wrap")
    @classmethod
    def _whole_numbers(cls, data: Any, handler: Any) -> Any:
        try:
            body = handler(data)
        except ValidationError:
            whole = _whole_floats(data)
            if whole == data and _same_types(whole, data):
                raise
            body = handler(whole)
        for name in type(body).model_fields:
            old = getattr(body, name)
            new = encodable(old, name)
            if new is not old:
                setattr(body, name, new)
        return body


_INT_LOW, _INT_HIGH = -(2**63), 2**64 - 1  # msgpack's integers


def encodable(value: Any, path: str) -> Any:
    """`value` as msgpack can carry it: a string with a lone surrogate is a GatewayError 400 naming it;
    an integer beyond 64 bits in free-form JSON becomes the nearest float (JSON has one number type,
    and most JSON parsers read such a number so), a 400 only past a float's range. Typed integer
    fields have bounds of their own (checked before this). Returns `value` itself when nothing changed;
    a list of ints (token ids) is looked at by min/max, in C."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError as exc:
                raise bad_request(f"{path}: invalid Unicode (a lone surrogate at character {exc.start})", path) from None
        return value
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        if _INT_LOW <= value <= _INT_HIGH:
            return value
        try:
            return float(value)
        except OverflowError:
            raise bad_request(f"{path}: the number {value} is beyond what a float holds", path) from None
    if isinstance(value, list):
        if value and type(value[0]) is int:
            try:
                if _INT_LOW <= min(value) and max(value) <= _INT_HIGH:
                    return value
            except TypeError:  # not all ints: look at each
                pass
        items = [encodable(item, f"{path}.{i}") for i, item in enumerate(value)]
        return value if all(a is b for a, b in zip(items, value)) else items
    if isinstance(value, dict):
        pairs = [(encodable(k, path), encodable(v, f"{path}.{k}")) for k, v in value.items()]
        return value if all(v is value[k] for k, v in pairs) else dict(pairs)
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            old = getattr(value, name)
            new = encodable(old, f"{path}.{name}")
            if new is not old:
                setattr(value, name, new)
    return value


def _whole_floats(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_floats(v) for v in value]
    return value


def _same_types(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return all(_same_types(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return all(_same_types(x, y) for x, y in zip(a, b))
    return True
