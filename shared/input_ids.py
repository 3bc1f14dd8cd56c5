"""The check every door makes of a prompt given as token ids, with the model's figures: torch-free, so the
tokenizer service and the worker make the same one."""

from __future__ import annotations

from typing import Any

# The request fields a prompt comes in (shared.protocol.TokenizeRequest's); a gateway's client may have
# named it otherwise (OpenAI's completions: `prompt`), and the gateway renames them in what it answers.
PROMPT_FIELDS = frozenset({"text", "messages", "input_ids"})


class PromptError(ValueError):
    """A prompt the model cannot take; `param` is the request field it came in (one of PROMPT_FIELDS)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def validate_input_ids(ids: Any, vocab_size: int, context_len: int, pool_tokens: int, field: str = "input_ids") -> None:
    """PromptError, naming `field` (the request field the prompt came in), for anything the model cannot take."""
    # set(map(type, ...)) runs in C (a third of the generator's time on 512 ids); anything but plain ints
    # (an int subclass, a bool, another type) takes the exact check.
    if not isinstance(ids, list) or (
        not set(map(type, ids)) <= {int} and not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise PromptError(f"`{field}` must be a list of integers", field)
    if not ids:
        raise PromptError(f"the prompt is empty (`{field}` has no tokens)", field)
    if len(ids) >= context_len:
        raise PromptError(
            f"the prompt has {len(ids)} tokens; the model's context is {context_len} (`{field}` too long)", field
        )
    if len(ids) + 1 > pool_tokens:
        raise PromptError(f"the prompt has {len(ids)} tokens; the KV pool holds {pool_tokens} (`{field}` too long)", field)
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        raise PromptError(f"`{field}` holds a token id outside [0, {vocab_size}): {low if low < 0 else high}", field)


def check_logprob_start_len(value: Any, prompt_len: int | None = None) -> int | None:
    """SGLang's `logprob_start_len`: the first prompt position whose token is listed with the prompt
    log-probs (each token after it gets its log-prob given its prefix); None or -1 (SGLang's default)
    ask for none. ValueError, naming it, for anything else, or (given the prompt's length) a start at
    or past the prompt's last token."""
    if value is None or (value == -1 and not isinstance(value, bool)):
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"`logprob_start_len` must be an integer >= -1, got {value!r}")
    if prompt_len is not None and value >= prompt_len:
        raise ValueError(f"`logprob_start_len` ({value}) must be less than the prompt's length ({prompt_len} tokens)")
    return value
