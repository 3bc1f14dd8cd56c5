"""chat_template_kwargs (vLLM's and SGLang's name): extra variables for a chat template, such as Qwen3's
`enable_thinking`. The tokenizer renders them exactly as transformers' apply_chat_template does; the
gateway passes them on from /v1/chat/completions and the NATS front door. Bad input: a key that
apply_chat_template takes itself, kwargs without chat messages, or a template that raises, each a
ValueError / 400 naming chat_template_kwargs or messages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from shared.natsd import NatsServer
from shared.prompt_tokenizer import PromptTokenizer
from shared.protocol import PROTOCOL_VERSION, ChatMessage, Sampling, TokenizeRequest
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, GatewayThread, openai_client, served_by_fake

# Qwen3's way of turning thinking off, in the tiny tokenizer's ChatML, plus a variable that makes the
# template fail the way templates do (raise_exception).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    "{% if fail_with is defined %}{{ raise_exception(fail_with) }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def tokenizer(qwen3_path: Path) -> PromptTokenizer:
    tok = AutoTokenizer.from_pretrained(qwen3_path)
    tok.chat_template = TEMPLATE
    return PromptTokenizer(tok, vocab_size=tok.vocab_size + len(tok.get_added_vocab()), context_len=256)


def request(**fields: object) -> TokenizeRequest:
    values: dict[str, object] = {"messages": [ChatMessage(**m) for m in MESSAGES]}
    values.update(fields)
    return TokenizeRequest(v=PROTOCOL_VERSION, rid="r", gateway_id="g", worker_id="w", sampling=Sampling(), **values)


def test_the_variables_render_as_transformers_renders_them(tokenizer: PromptTokenizer) -> None:
    tok = tokenizer.tokenizer
    expected = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert expected.endswith("<think>\n\n</think>\n\n")
    off = tokenizer.prompt_ids(request(chat_template_kwargs={"enable_thinking": False}))
    assert off == tok.encode(expected, add_special_tokens=False)
    plain = tokenizer.prompt_ids(request())
    assert tokenizer.prompt_ids(request(chat_template_kwargs={"enable_thinking": True})) == plain != off


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs may not set add_generation_prompt"),
        ({"chat_template_kwargs": {"tokenize": True, "messages": []}}, "chat_template_kwargs may not set messages, tokenize"),
        ({"chat_template_kwargs": {"fail_with": "no such mode"}}, "messages could not be formatted by the chat template: no such mode"),
        ({"messages": None, "text": "hi", "chat_template_kwargs": {"enable_thinking": False}},
         "chat_template_kwargs apply to chat messages only"),
    ],
)
def test_bad_variables_are_value_errors_saying_why(tokenizer: PromptTokenizer, fields: dict, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        tokenizer.to_generate(request(**fields))
    assert message in str(caught.value)


@pytest.fixture(scope="module")
def served(nats: NatsServer) -> Iterator[tuple[GatewayThread, FakePipeline]]:
    with served_by_fake(nats.url) as pair:
        yield pair


def test_the_gateway_passes_them_to_the_tokenizer(served: tuple[GatewayThread, FakePipeline]) -> None:
    gateway, pipeline = served
    client = openai_client(gateway)
    reply = client.chat.completions.create(
        model=FAKE_MODEL, messages=MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    sent = next(r for r in pipeline.requests if r.rid == reply.id.removeprefix("chatcmpl-"))
    assert sent.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=FAKE_MODEL, messages=MESSAGES, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}
        )
    assert caught.value.body["param"] == "chat_template_kwargs"
    assert "may not set add_generation_prompt" in caught.value.body["message"]


def test_the_engine_takes_them_as_keywords(qwen3_path: Path, tokenizer: PromptTokenizer) -> None:
    from services.worker.frontend.engine import Engine

    with Engine(str(qwen3_path), max_total_tokens=512) as engine:
        engine.tokenizer.chat_template = TEMPLATE
        rendered = engine.apply_chat_template(MESSAGES, enable_thinking=False)
    assert engine.tokenizer.encode(rendered, add_special_tokens=False) == tokenizer.prompt_ids(
        request(chat_template_kwargs={"enable_thinking": False}))
    assert rendered.endswith("<think>\n\n</think>\n\n")
