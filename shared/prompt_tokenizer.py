"""PromptTokenizer: a TokenizeRequest becomes the GenerateRequest its worker runs, or a ValueError that
names the bad field (the service sends that message back to the gateway as an error final).

Text is encoded as the offline Engine encodes a prompt; chat messages go through the checkpoint's chat
template (which already holds any BOS, so no special tokens are added again); input_ids pass as given.
The tokenizer trusts the gateway's check of the request (Sampling.validate): it checks only what needs
the model's tokenizer, chat template or figures (the prompt's ids against the vocabulary and context,
made early so a bad prompt never costs a worker anything). The worker checks the sampling settings
against its vocabulary and the prompt against its KV pool.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from jinja2 import TemplateError

from shared.hf_tokenizer import load_hf_tokenizer
from shared.input_ids import validate_input_ids
from shared.model_path import resolve_model_path
from shared.protocol import (
    PROTOCOL_VERSION,
    ChatMessage,
    GenerateRequest,
    TextTokenize,
    TextTokenized,
    TokenizeRequest,
)
from shared.request_contract import check_chat_template_kwargs, prompt_field

# Token ids, and prompts up to this many characters, are encoded on the tokenizer service's event loop:
# handing them to a thread costs more than they do (a short chat's template and encoding ~0.12 ms, the
# hand-off ~0.16 ms more, measured here). Longer prompts go to a thread.
INLINE_TOKENIZE_CHARS = 4096


def _check_prompt_fields(msg: TokenizeRequest | TextTokenize) -> None:
    """ValueError unless exactly one of text, messages or input_ids is given, with chat_template_kwargs
    only beside messages (which the chat template needs to be told)."""
    prompt_field(msg.text, msg.messages, msg.input_ids)
    if msg.chat_template_kwargs:
        check_chat_template_kwargs(msg.chat_template_kwargs, has_messages=msg.messages is not None)


def prompt_chars(req: TokenizeRequest) -> int:
    """The characters there are to tokenize: the text's, or all chat messages' roles and contents (0 for ids)."""
    if req.text is not None:
        return len(req.text)
    if req.messages is not None:
        tools = len(json.dumps(req.tools)) if req.tools else 0
        return tools + sum(len(m.role) + len(m.content) + (len(json.dumps(m.tool_calls)) if m.tool_calls else 0)
                           for m in req.messages)
    return 0


def is_quick(req: TokenizeRequest, max_chars: int = INLINE_TOKENIZE_CHARS) -> bool:
    """Whether `to_generate(req)` is cheap enough to run on an event loop: ids, or at most `max_chars`
    characters of text or chat."""
    return req.input_ids is not None or prompt_chars(req) <= max_chars


class PromptTokenizer:
    """One model's tokenizer and the limits prompts are checked against."""

    def __init__(self, tokenizer: Any, vocab_size: int, context_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len

    @classmethod
    def load(
        cls, model_path: str | None, context_length: int | None = None, tokenizer_path: str | None = None,
        chat_template: str | None = None, revision: str | None = None,
    ) -> PromptTokenizer:
        """The checkpoint's tokenizer (or `tokenizer_path`'s, with `chat_template` when given), vocabulary
        size and context length (or `context_length`)."""
        from transformers import AutoConfig

        path = resolve_model_path(model_path or None, revision=revision)
        config = AutoConfig.from_pretrained(path)
        tokenizer = load_hf_tokenizer(str(path), tokenizer_path, chat_template)
        text_config = getattr(config, "text_config", None) or config
        if context_length is not None and context_length <= 0:
            raise ValueError(f"context_length must be positive, got {context_length}")
        return cls(
            tokenizer,
            vocab_size=int(text_config.vocab_size),
            context_len=int(context_length or text_config.max_position_embeddings),
        )

    def prompt_ids(self, req: TokenizeRequest) -> list[int]:
        _check_prompt_fields(req)
        if req.input_ids is not None:
            return list(req.input_ids)
        if req.text is not None:
            if not req.text:
                raise ValueError("the prompt is empty (`text`)")
            return list(self.tokenizer.encode(req.text))
        assert req.messages is not None
        return self.chat_ids(req.messages, req.add_generation_prompt, req.chat_template_kwargs, req.tools)

    def chat_ids(
        self, messages: list[ChatMessage], add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None, tools: list[dict[str, Any]] | None,
    ) -> list[int]:
        """Chat messages through the checkpoint's chat template (kwargs already checked)."""
        if not messages:
            raise ValueError("`messages` is empty")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: send `text` or `input_ids` instead of `messages`")
        try:
            rendered = self.tokenizer.apply_chat_template(
                [m.template_dict() for m in messages],
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
        except TemplateError as exc:  # the template's own raise_exception(), or what the variables broke
            raise ValueError(f"messages could not be formatted by the chat template: {exc}") from None
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def answer(self, msg: TextTokenize) -> TextTokenized:
        """/tokenize and /detokenize: the ids of text or chat messages, or the text of ids; a bad
        request is an answer with `error` (naming the field), never an exception."""
        try:
            _check_prompt_fields(msg)
            if msg.input_ids is not None:
                # Decoded ids come typed (msgspec, pydantic strict): only the range is left to check.
                if msg.input_ids and (min(msg.input_ids) < 0 or max(msg.input_ids) >= self.vocab_size):
                    bad = min(msg.input_ids) if min(msg.input_ids) < 0 else max(msg.input_ids)
                    raise ValueError(f"`tokens` entry {bad} is not a token id in [0, {self.vocab_size})")
                text = self.tokenizer.decode(msg.input_ids, skip_special_tokens=False)
                return TextTokenized(v=PROTOCOL_VERSION, text=text, context_len=self.context_len)
            if msg.text is not None:
                ids = list(self.tokenizer.encode(msg.text, add_special_tokens=msg.add_special_tokens))
            else:
                assert msg.messages is not None
                ids = self.chat_ids(msg.messages, msg.add_generation_prompt, msg.chat_template_kwargs, msg.tools)
            return TextTokenized(v=PROTOCOL_VERSION, input_ids=ids, context_len=self.context_len)
        except ValueError as exc:
            return TextTokenized(v=PROTOCOL_VERSION, error=str(exc), context_len=self.context_len)

    def to_generate(self, req: TokenizeRequest) -> GenerateRequest:
        """The worker's request; ValueError naming the field for anything a worker would refuse."""
        ids = self.prompt_ids(req)
        # The KV pool is the worker's to check; the context and vocabulary are the model's.
        field = "input_ids" if req.input_ids is not None else "text" if req.text is not None else "messages"
        validate_input_ids(ids, self.vocab_size, self.context_len, sys.maxsize, field)
        return generate_request(req, ids)


# What a GenerateRequest carries over from its TokenizeRequest: every field the two share, but the prompt.
_CARRIED = tuple(f for f in GenerateRequest.__struct_fields__ if f in TokenizeRequest.__struct_fields__ and f != "input_ids")


def generate_request(req: TokenizeRequest, ids: list[int]) -> GenerateRequest:
    """`req` as its worker gets it, with prompt `ids`."""
    return GenerateRequest(input_ids=ids, **{f: getattr(req, f) for f in _CARRIED})
