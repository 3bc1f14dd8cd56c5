"""A request's grammar (constrained decoding: SGLang's `json_schema`, `regex` and `ebnf` sampling
parameters) as llguidance reads it, and the check that it compiles: torch-free, so the gateway, the
tokenizer and the worker refuse a bad grammar alike before anything queues. The masking itself is the
worker's (services/worker/runtime/sampling/grammar.py).

JSON schemas compile with fixed separators (", " and ": ") and no free whitespace, the form `json.dumps`
writes: a small model given free whitespace can spend its whole budget on newlines. A schema may change
that with llguidance's own `"x-guidance"` key, e.g. {"x-guidance": {"whitespace_flexible": true}}.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.sampling_params import SamplingParams

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Grammar errors can quote the whole grammar; a client gets the start of the first lines.
MAX_ERROR_CHARS = 400


def llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a project dependency
        raise ValueError("constrained decoding needs the llguidance package (pip install llguidance)") from exc
    return llguidance


def spec_of(params: SamplingParams) -> tuple[str, str] | None:
    """(field, llguidance grammar) for the request's grammar, None without one; ValueError naming the
    field when more than one is set or the value is not text (a JSON schema may be an object)."""
    given = [name for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"{given[0]} and {given[1]} cannot be combined: give one of {', '.join(GRAMMAR_FIELDS)}")
    field = given[0]
    value = getattr(params, field)
    LLMatcher = llguidance().LLMatcher
    if field == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON schema (an object), got {type(value).__name__}")
        if value is True or value == {}:
            value = {"type": "object"}  # "any JSON", which OpenAI's json_object means by an object
        return field, LLMatcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string, got {value!r}")
    if field == "regex":
        return field, LLMatcher.grammar_from_regex(value)
    try:
        return field, llguidance().grammar_from("ebnf", value)
    except ValueError as exc:  # the GBNF -> Lark converter's message
        raise ValueError(f"ebnf is not a grammar llguidance can read: {short_error(str(exc))}") from None


def check_grammar(params: SamplingParams) -> None:
    """ValueError naming the field unless the request's grammar (if any) compiles."""
    spec = spec_of(params)
    if spec is None:
        return
    field, grammar = spec
    error = _grammar_error(grammar)
    if error:
        raise ValueError(f"{field} cannot be compiled: {short_error(error)}")


@functools.lru_cache(maxsize=256)
def _grammar_error(grammar: str) -> str:
    """llguidance's verdict on a grammar ('' when it compiles). One request's grammar is checked at
    each door it passes (the gateway's OpenAI layer, then each of its n choices, the tokenizer, the
    worker), and clients repeat schemas: each process compiles a given grammar once."""
    return llguidance().LLMatcher.validate_grammar(grammar)


def short_error(message: str) -> str:
    """llguidance's message on one line, without its echo of the grammar, and bounded."""
    message = " ".join(message.split("\n   1 | ", 1)[0].split())
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."
