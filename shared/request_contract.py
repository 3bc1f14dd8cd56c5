"""The request checks every door shares that are not a sampling value's (those are Sampling.validate's):
which prompt form a request gives, and the chat template variables it may set. Torch- and
tokenizer-free, so the gateway checks them at the edge and the tokenizer uses the same functions.
"""

from __future__ import annotations

from typing import Any

PROMPT_FIELDS = ("text", "messages", "input_ids")

# Arguments apply_chat_template takes itself: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def prompt_field(text: object, messages: object, input_ids: object) -> str:
    """Which one of text, messages or input_ids a request gives; ValueError unless exactly one."""
    given = [name for name, value in zip(PROMPT_FIELDS, (text, messages, input_ids)) if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of `text`, `messages` or `input_ids` (got {given or 'none'})")
    return given[0]


def check_chat_template_kwargs(kwargs: dict[str, Any], has_messages: bool) -> None:
    """ValueError (its message starts with the field's name) unless `kwargs` can go to a chat template."""
    if not has_messages:
        raise ValueError("chat_template_kwargs apply to chat messages only")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
