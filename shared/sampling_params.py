"""SamplingParams: one request's sampling settings, with SGLang's names and meanings.

The wire form is shared.protocol.Sampling (every field unset by default); this is the worker's form,
with the defaults filled in. Its fields are Sampling's plus `n` (tests/test_request_contract.py).

Lifecycle: `from_dict` (the request's sampling, plus the model's generation_config defaults) ->
`verify(vocab_size)` (every bad value is a ValueError naming its field) -> `normalize()` (stop as a
list, greedy spelled as top_k=1). Log-prob settings (`return_logprob`, `top_logprobs_num`) belong to
the request, not here, as in SGLang.

Where it is checked: once at the edge (the gateway: `check_request`, with the widest vocabulary any
worker could have) and once in the worker (`verify` with the model's vocabulary, which also guards the
offline Engine and any other publisher on the worker's subject). The tokenizer does not check it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from shared.grammar_spec import check_grammar

# Below this temperature a request is greedy: dividing by it would only overflow.
SAMPLING_EPS = 1e-5

# The fields that the model's generation_config.json may supply when the request leaves them unset.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# What a request's integers must fit to travel: counts and top_k as int32 (gRPC), a seed as int64
# (vLLM's bound; seed + i of n choices still fits msgpack's 64 bits), token ids as C ints / int32.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The edge does not know the vocabulary: any id in [0, MAX_TOKEN_ID] passes there and the worker
# refuses ids its model does not have.
MAX_TOKEN_ID = INT32_MAX
_INT32_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k")


def generation_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The per-request defaults a checkpoint's generation_config.json sets (GENERATION_DEFAULT_KEYS)."""
    return {k: generation_config[k] for k in GENERATION_DEFAULT_KEYS if generation_config.get(k) is not None}


def check_request(sampling: dict[str, Any]) -> None:
    """The edge's one check of a request's sampling (only the fields that were set): ValueError, its
    message starting with the field's name, for any value no worker could carry or honour. Needs
    neither a tokenizer nor torch; the worker's own check adds its vocabulary (`verify`)."""
    for name in _INT32_FIELDS:
        value = sampling.get(name)
        if isinstance(value, int) and value > INT32_MAX:
            raise ValueError(f"{name} must be <= {INT32_MAX}, got {value}")
    seed = sampling.get("seed")
    if isinstance(seed, int) and not INT64_MIN <= seed <= INT64_MAX:
        raise ValueError(f"seed must be in [{INT64_MIN}, {INT64_MAX}], got {seed}")
    SamplingParams.from_dict(sampling).verify(MAX_TOKEN_ID + 1)


@dataclass
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    top_k = -1 and min_p = 0 turn those filters off; temperature 0 means greedy (argmax).
    Requests without a seed get one from the scheduler, so every sampled token is reproducible.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0  # EOS and stop_token_ids are masked out until this many tokens exist
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0  # OpenAI-style, on output tokens: logit -= f * count
    presence_penalty: float = 0.0  # OpenAI-style, on output tokens: logit -= p * (count > 0)
    repetition_penalty: float = 1.0  # HF-style, on prompt and output tokens
    stop: str | list[str] | None = None  # stop strings, matched by the detokenizer
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    # OpenAI's logit_bias: token id -> a number in [-100, 100] added to that token's logit before
    # sampling (after the penalties; a banned token stays banned). -100 all but bans a token.
    logit_bias: dict[int, float] | None = None
    # Constrained decoding (grammar.py), at most one: a JSON schema (text, or an object), a regular
    # expression, or an EBNF grammar (llama.cpp's GBNF or Lark) that the output must match.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Build from a request's sampling object; a key set to None counts as unset.

        `defaults` is the model's generation_config (other keys in it are ignored); it fills
        temperature/top_p/top_k/min_p/repetition_penalty where the request leaves them unset.
        HF's top_k=0 ("no top-k") becomes our -1.
        """
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"unknown sampling parameter {key!r}; expected one of {sorted(known)}")
        values = {k: v for k, v in d.items() if v is not None}
        if isinstance(values.get("logit_bias"), dict):
            # JSON object keys are strings ("1234": -100, as OpenAI sends them): the ids they spell.
            values["logit_bias"] = {token_key(k): v for k, v in values["logit_bias"].items()}
        for key in GENERATION_DEFAULT_KEYS:
            default = (defaults or {}).get(key)
            if key not in values and default is not None:
                values[key] = -1 if key == "top_k" and default == 0 else default
        return cls(**values)

    @property
    def is_constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1 or self.temperature < SAMPLING_EPS

    def stop_strings(self) -> list[str]:
        """`stop` as a list (None -> [], a string -> [it])."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError, naming the field, for any value the sampler cannot honour."""
        _require_int("max_new_tokens", self.max_new_tokens, low=0)
        _require_int("min_new_tokens", self.min_new_tokens, low=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})"
            )
        _require_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _require_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _require_int("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (off) or >= 1, got 0")
        _require_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _require_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _require_int("n", self.n, low=1)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.stop is not None:
            entries = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(entries, (list, tuple)) or not all(isinstance(s, str) and s for s in entries):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            for tid in self.stop_token_ids:
                if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < vocab_size:
                    raise ValueError(f"stop_token_ids entry {tid!r} is not a token id in [0, {vocab_size})")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for tid, bias in self.logit_bias.items():
                if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < vocab_size:
                    raise ValueError(f"logit_bias key {tid!r} is not a token id in [0, {vocab_size})")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias for token {tid} must be a number in [-100, 100], got {bias!r}")
        if self.is_constrained:
            check_grammar(self)

    def normalize(self) -> SamplingParams:
        """Canonical form, in place (call after verify): stop as a list, greedy as temperature 1 with
        top_k 1 (what SGLang does, so the sampler needs one greedy test and never divides by ~0)."""
        self.stop = self.stop_strings()
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.temperature < SAMPLING_EPS:
            self.temperature = 1.0
            self.top_k = 1
        return self


def token_key(key: object) -> object:
    """A logit_bias key as a token id: "42" -> 42; anything else is left for verify to refuse."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    return key


def _require_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _require_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
