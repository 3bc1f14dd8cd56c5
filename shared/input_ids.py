"""The check every door makes of a prompt given as token ids, with the model's figures: torch-free, so the
tokenizer service and the worker make the same one."""

from __future__ import annotations

from typing import Any


def validate_input_ids(ids: Any, vocab_size: int, context_len: int, pool_tokens: int) -> None:
    """ValueError, naming `input_ids`, for anything the model cannot take."""
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("`input_ids` must be a list of integers")
    if not ids:
        raise ValueError("the prompt is empty (`input_ids` has no tokens)")
    if len(ids) >= context_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; the model's context is {context_len} (`input_ids` too long)"
        )
    if len(ids) + 1 > pool_tokens:
        raise ValueError(f"the prompt has {len(ids)} tokens; the KV pool holds {pool_tokens} (`input_ids` too long)")
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        raise ValueError(f"`input_ids` holds a token id outside [0, {vocab_size}): {low if low < 0 else high}")


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
