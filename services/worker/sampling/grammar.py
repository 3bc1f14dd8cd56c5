"""Constrained decoding: a request's output held to a JSON schema, a regular expression or an EBNF
grammar (SGLang's `json_schema`, `regex` and `ebnf` sampling parameters; OpenAI's `response_format`).

The grammar engine is llguidance (a Rust library that vLLM and SGLang also offer as a backend): from the
grammar and the tokenizer's vocabulary it computes, before each step, the set of tokens that keep the
output a prefix of some sentence of the grammar. Here:

  spec_of(params)           the request's one grammar as (field, llguidance grammar text), or None
  check_grammar(params)     ValueError naming the field for a grammar that cannot compile (no tokenizer
                            needed: the gateway and the Engine refuse bad ones before they queue)
  GrammarBackend            per scheduler: the tokenizer as llguidance reads it (built at the first
                            constrained request, ~0.3 s for a 49k vocabulary) and a matcher per request
  allowed_tokens(...)       the next-token masks of the constrained rows, as a bool [rows, vocab] tensor
                            (ModelRunner.sample_async; the sampler sets the rest to -inf after the
                            penalties and logit_bias)

A matcher advances with each token the request gains (Scheduler._add_tokens). When the grammar can go
no further the request finishes with reason 'stop' (no EOS step is spent); a token the grammar refuses,
which the mask makes impossible unless min_new_tokens bans the grammar's only way out, ends the request
as 'abort' with the matcher's reason.

JSON schemas compile with fixed separators (", " and ": ") and no free whitespace, the form `json.dumps`
writes: a small model given free whitespace can spend its whole budget on newlines. A schema may change
that with llguidance's own `"x-guidance"` key, e.g. {"x-guidance": {"whitespace_flexible": true}}.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from services.worker.sampling.penalties import to_device_async

if TYPE_CHECKING:
    from services.worker.sampling.sampling_params import SamplingParams

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Grammar errors can quote the whole grammar; a client gets the start of the first lines.
MAX_ERROR_CHARS = 400


def _llguidance() -> Any:
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
    LLMatcher = _llguidance().LLMatcher
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
        return field, _llguidance().grammar_from("ebnf", value)
    except ValueError as exc:  # the GBNF -> Lark converter's message
        raise ValueError(f"ebnf is not a grammar llguidance can read: {_short(str(exc))}") from None


def check_grammar(params: SamplingParams) -> None:
    """ValueError naming the field unless the request's grammar (if any) compiles."""
    spec = spec_of(params)
    if spec is None:
        return
    field, grammar = spec
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{field} cannot be compiled: {_short(error)}")


def _short(message: str) -> str:
    """llguidance's message on one line, without its echo of the grammar, and bounded."""
    message = " ".join(message.split("\n   1 | ", 1)[0].split())
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."


class GrammarBackend:
    """llguidance's view of one model's vocabulary, and the matchers of its constrained requests.

    `tokenizer` is the checkpoint's transformers tokenizer (a fast one); `vocab_size` the model's
    logits width (it may exceed the tokenizer's: padding rows are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: Any = None

    def _lltokenizer(self) -> Any:
        if self._tokenizer is None:
            if self._hf_tokenizer is None:
                raise ValueError("constrained decoding needs a tokenizer; this checkpoint has none")
            from llguidance.hf import from_tokenizer

            self._tokenizer = from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        return self._tokenizer

    def matcher(self, params: SamplingParams) -> Any | None:
        """A fresh matcher for the request's grammar (None without one); ValueError if it cannot be
        compiled against this vocabulary."""
        spec = spec_of(params)
        if spec is None:
            return None
        field, grammar = spec
        matcher = _llguidance().LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{field} cannot be compiled: {_short(matcher.get_error())}")
        return matcher



def allowed_tokens(matchers: list[Any], vocab_size: int, device: torch.device) -> torch.Tensor:
    """bool [len(matchers), vocab_size] on `device`: True where the row's grammar allows the token
    next. The masks are computed on the host (llguidance) while the device runs the forward."""
    words = (vocab_size + 31) // 32
    bitmask = torch.empty((len(matchers), words), dtype=torch.int32)
    for i, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
    return unpack_bitmask(to_device_async(bitmask, device), vocab_size)


_BITS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] (bit j of word w is token 32*w + j) -> bool [rows, vocab_size]."""
    shifts = _BITS.get(bitmask.device)
    if shifts is None:
        shifts = _BITS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
