"""A generation as every front door (HTTP, gRPC, NATS) asks for it, and the checks it passes before
anything is routed: exactly one prompt form, integers a worker can carry, sampling values any worker
accepts (the worker checks the rest: its vocabulary, context and pool). Each failure is a 400
(GatewayError) naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.errors import bad_request
from shared.input_ids import check_logprob_start_len
from shared.protocol import ChatMessage, Sampling
from shared.request_contract import check_chat_template_kwargs, prompt_field
from shared.sampling_params import MAX_TOKEN_ID

# Top log-probs per token: OpenAI's own cap (and vLLM's default --max-logprobs); every door.
MAX_TOP_LOGPROBS = 20
# Choices per request (n); each is its own generation.
MAX_N = 128


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
    # With return_logprob: the prompt's log-probs from this position on (SGLang's; None or -1: none).
    logprob_start_len: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat template variables (messages only)
    tools: list[dict[str, Any]] | None = None  # tool definitions for the chat template (messages only)
    # False when the client reads the whole answer only: the worker then sends the first token and the
    # final, not every step (services/worker/frontend/output_batcher.py).
    stream: bool = True
    timeout: float | None = None  # seconds the whole request may take before it is aborted (504)
    # The field the client sent the prompt in, when not text, messages or input_ids (OpenAI's `prompt`).
    prompt_param: str | None = None

    def prompt_field(self) -> str:
        """The field the client sent the prompt in: what an error about the prompt names."""
        if self.prompt_param is not None:
            return self.prompt_param
        return "text" if self.text is not None else "messages" if self.messages is not None else "input_ids"

    def validate(self) -> None:
        """GatewayError 400, naming the field, for anything no worker could run."""
        try:
            prompt_field(self.text, self.messages, self.input_ids)
        except ValueError as exc:
            raise bad_request(str(exc), "text") from None
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
        try:  # (against the prompt's length: by the worker, which has it tokenized)
            self.logprob_start_len = check_logprob_start_len(self.logprob_start_len)
        except ValueError as exc:
            raise bad_request(str(exc), "logprob_start_len") from None
        if self.input_ids is not None:
            check_token_ids(self.input_ids, "input_ids")
        validate_template_kwargs(self.chat_template_kwargs, has_messages=self.messages is not None)
        try:
            self.sampling.validate()
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), field_of(str(exc))) from None


def check_token_ids(ids: list[int], param: str) -> None:
    """GatewayError 400 naming `param` unless every id is in [0, MAX_TOKEN_ID] (min/max run in C:
    cheap on a long prompt)."""
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        i, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t <= MAX_TOKEN_ID)
        raise bad_request(f"{param}: entry {i} ({bad}) is not a token id in [0, {MAX_TOKEN_ID}]", param)


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
