"""A generation as every front door (HTTP, gRPC, NATS) asks for it, and the checks it passes before
anything is routed: exactly one prompt form, integers a worker can carry, sampling values any worker
accepts (the worker checks the rest: its vocabulary, context and pool). Each failure is a 400
(GatewayError) naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.errors import bad_request
from services.tokenizer.prompt_tokenizer import check_chat_template_kwargs
from shared.protocol import ChatMessage, Sampling
from shared.sampling_params import SamplingParams

# Bounds every front door checks before anything is routed or encoded (the HTTP models state the same
# ones in the OpenAPI document). Integers travel as msgpack (64 bits at most) and token ids as C ints
# (prefix_index) and int32 (gRPC), so an integer beyond these is a 400, never an OverflowError.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The gateway does not know the vocabulary: any id in [0, MAX_TOKEN_ID] passes here and the worker
# refuses ids its model does not have (a 400 from the pipeline).
MAX_TOKEN_ID = INT32_MAX
# Top log-probs per token: OpenAI's own cap (and vLLM's default --max-logprobs); every door.
MAX_TOP_LOGPROBS = 20
# Choices per request (n); each is its own generation.
MAX_N = 128
_INT32_SAMPLING = ("max_new_tokens", "min_new_tokens", "top_k")


@dataclass
class GenerateSpec:
    """One generation as a front door asks for it: exactly one of text, messages or input_ids."""

    sampling: Sampling
    text: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    model: str | None = None
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat template variables (messages only)
    tools: list[dict[str, Any]] | None = None  # tool definitions for the chat template (messages only)
    # False when the client reads the whole answer only: the worker then sends the first token and the
    # final, not every step (services/worker/frontend/output_batcher.py).
    stream: bool = True
    timeout: float | None = None  # seconds the whole request may take before it is aborted (504)

    def validate(self) -> None:
        """GatewayError 400, naming the field, for anything no worker could run."""
        given = [n for n in ("text", "messages", "input_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise bad_request(f"give exactly one of text, messages or input_ids (got {given or 'none'})", "text")
        if self.text is not None and not self.text:
            raise bad_request("the prompt is empty", "text")
        if self.input_ids is not None and not self.input_ids:
            raise bad_request("the prompt is empty (input_ids has no tokens)", "input_ids")
        if self.messages is not None and not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.timeout is not None and not 0 < self.timeout <= 86_400:
            raise bad_request(f"timeout must be in (0, 86400] seconds, got {self.timeout}", "timeout")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}",
                              "top_logprobs_num")
        if self.input_ids is not None:
            check_token_ids(self.input_ids, "input_ids")
        check_sampling_ints(self.sampling)
        validate_template_kwargs(self.chat_template_kwargs, has_messages=self.messages is not None)
        try:
            SamplingParams.from_dict(self.sampling.to_dict()).verify(MAX_TOKEN_ID + 1)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), field_of(str(exc))) from None


def check_token_ids(ids: list[int], param: str) -> None:
    """GatewayError 400 naming `param` unless every id is in [0, MAX_TOKEN_ID] (min/max run in C:
    cheap on a long prompt)."""
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        i, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t <= MAX_TOKEN_ID)
        raise bad_request(f"{param}: entry {i} ({bad}) is not a token id in [0, {MAX_TOKEN_ID}]", param)


def check_sampling_ints(sampling: Sampling) -> None:
    """GatewayError 400 naming the field for an integer no worker could carry: counts and top_k beyond
    int32, a seed beyond int64 (vLLM's bound; seed + i of n choices still fits msgpack's 64 bits)."""
    for name in _INT32_SAMPLING:
        value = getattr(sampling, name)
        if value is not None and value > INT32_MAX:
            raise bad_request(f"{name} must be <= {INT32_MAX}, got {value}", name)
    if sampling.seed is not None and not INT64_MIN <= sampling.seed <= INT64_MAX:
        raise bad_request(f"seed must be in [{INT64_MIN}, {INT64_MAX}], got {sampling.seed}", "seed")


def validate_template_kwargs(kwargs: dict[str, Any] | None, has_messages: bool) -> None:
    """GatewayError 400 naming chat_template_kwargs unless they may go to a chat template."""
    if kwargs:
        try:
            check_chat_template_kwargs(kwargs, has_messages)
        except ValueError as exc:
            raise bad_request(str(exc), "chat_template_kwargs") from None


def field_of(message: str) -> str | None:
    """The sampling field a SamplingParams message starts with (its messages name the field first)."""
    first = message.split(" ", 1)[0].strip("`'")
    return first if first in Sampling.__struct_fields__ else None
