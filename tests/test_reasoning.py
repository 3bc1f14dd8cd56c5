"""services/gateway/reasoning.py: a thinking model's answer split into reasoning and content. Whole
answers against hand-worked cases; streamed answers, cut anywhere (inside the tags too), add up to
exactly the whole answer's split; a gateway with --reasoning-parser returns reasoning_content in
answers and deltas, and refuses an unknown parser at start."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.config import GatewayConfig
from services.gateway.reasoning import PARSERS, ReasoningSplitter, split
from shared.natsd import NatsServer
from tests.gateway_helpers import FAKE_MODEL, openai_client, served_by_fake


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [
        ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", ("Let me see.", "Paris.")),
        ("qwen3", "Paris.", ("", "Paris.")),  # enable_thinking false: no tags in the answer
        ("qwen3", "  Paris <think>", ("", "  Paris <think>")),  # only a leading tag opens reasoning
        ("qwen3", "<think>cut off by max_tokens", ("cut off by max_tokens", "")),
        ("qwen3", "<think></think>Paris.", ("", "Paris.")),
        ("qwen3", "<thi", ("", "<thi")),
        ("qwen3", "  <thi", ("", "  <thi")),  # no reasoning: kept as written, leading spaces too
        ("deepseek-r1", "Let me see.\n</think>\n\nParis.", ("Let me see.", "Paris.")),
        ("deepseek-r1", "<think>\nLet me see.</think>Paris.", ("Let me see.", "Paris.")),
        ("qwen3-thinking", "still thinking", ("still thinking", "")),
        ("qwen3", "<think>a </think> b </think> c", ("a", "b </think> c")),  # one reasoning part only
    ],
)
def test_whole_answers_split_as_worked_out(parser: str, text: str, expected: tuple[str, str]) -> None:
    assert split(text, parser) == expected


PIECES = ["<think>", "</think>", "<", "</", "<thi", "nk>", "think>", "/think", " ", "\n", "a", "Paris", ">"]


@settings(max_examples=400, deadline=None)
@given(
    parser=st.sampled_from(sorted(PARSERS)),
    pieces=st.lists(st.sampled_from(PIECES), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=8),
)
def test_any_streaming_adds_up_to_the_whole_answers_split(parser: str, pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    splitter = ReasoningSplitter.for_parser(parser)
    reasoning, content = "", ""
    for start, end in zip(bounds, bounds[1:]):
        r, c = splitter.feed(text[start:end])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    assert (reasoning + r, content + c) == split(text, parser)


# ---- through a gateway started with --reasoning-parser qwen3 (the fake pipeline echoes the prompt's words)


@pytest.fixture(scope="module")
def client(nats: NatsServer) -> Iterator[openai.OpenAI]:
    with served_by_fake(nats.url, reasoning_parser="qwen3") as (gateway, _):
        yield openai_client(gateway)


THOUGHT = [{"role": "user", "content": "<think> I should say Paris </think> Paris it is"}]


def test_chat_answers_carry_reasoning_content(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=FAKE_MODEL, messages=THOUGHT)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == ("I should say Paris", "Paris it is ")
    whole = client.chat.completions.create(model=FAKE_MODEL, messages=THOUGHT, extra_body={"separate_reasoning": False})
    assert whole.choices[0].message.content == "<think> I should say Paris </think> Paris it is "
    assert getattr(whole.choices[0].message, "reasoning_content", None) is None


def test_streamed_deltas_add_up_to_the_same_split(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=FAKE_MODEL, messages=THOUGHT, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == ("I should say Paris", "Paris it is ")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_an_unknown_parser_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek-r1, qwen3, qwen3-thinking or none"):
        GatewayConfig(reasoning_parser="o1")


def test_up_passes_the_parser_to_its_gateways(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from services.launch import add_up_commands

    parser = argparse.ArgumentParser()
    add_up_commands(parser.add_subparsers())
    assert parser.parse_args(["up", "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert parser.parse_args(["up"]).reasoning_parser is None
    assert parser.parse_args(["up", "--tool-call-parser", "hermes"]).tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--reasoning-parser", "o1"])
    assert "invalid choice: 'o1'" in capsys.readouterr().err
