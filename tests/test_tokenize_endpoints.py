"""The tokenizer's own answers behind the gateway's /tokenize and /detokenize (PromptTokenizer.answer),
against transformers' encode, chat template and decode; bad requests are answers with an error naming
the field, never exceptions. Through the real services: tests/test_gateway_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shared.prompt_tokenizer import PromptTokenizer
from shared.protocol import PROTOCOL_VERSION, ChatMessage, TextTokenize


@pytest.fixture(scope="module")
def prompts(qwen3_path: Path) -> PromptTokenizer:
    return PromptTokenizer.load(str(qwen3_path))


def ask(**fields: object) -> TextTokenize:
    return TextTokenize(v=PROTOCOL_VERSION, **fields)  # type: ignore[arg-type]


def test_text_chat_and_ids_answer_as_transformers_does(prompts: PromptTokenizer, qwen3_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(qwen3_path)
    text = "The capital of France is Paris."
    assert prompts.answer(ask(text=text)).input_ids == tok.encode(text)
    assert prompts.answer(ask(text=text, add_special_tokens=False)).input_ids == tok.encode(text, add_special_tokens=False)
    chat = [{"role": "user", "content": "hello world"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    answer = prompts.answer(ask(messages=[ChatMessage(**m) for m in chat]))
    assert answer.input_ids == tok.encode(rendered, add_special_tokens=False)
    assert answer.context_len == prompts.context_len and answer.error is None
    ids = tok.encode(text)
    assert prompts.answer(ask(input_ids=ids)).text == tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"input_ids": [1, 10**6]}, "`tokens` entry 1000000 is not a token id in [0, "),
        ({"input_ids": [-1]}, "`tokens` entry -1 is not a token id"),
        ({"text": "a", "input_ids": [1]}, "give exactly one of `text`, `messages` or `input_ids`"),
        ({"messages": [ChatMessage("user", "x")], "chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs may not set tokenize"),
    ],
)
def test_bad_requests_are_answers_with_an_error(prompts: PromptTokenizer, fields: dict, message: str) -> None:
    answer = prompts.answer(ask(**fields))
    assert answer.error is not None and message in answer.error
    assert answer.input_ids is None and answer.text is None
