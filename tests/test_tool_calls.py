"""Tool calling. services/gateway/tool_calls.py: Hermes/Qwen <tool_call> blocks become OpenAI tool
calls; whole answers against worked cases (calls, several calls, invalid JSON and unclosed blocks kept
as content); streamed answers, cut anywhere, give the same content and calls. The tokenizer renders
tools and tool turns as transformers does; a gateway with --tool-call-parser returns tool_calls (and
finish_reason "tool_calls") in replies and streams. tool_choice "required" or a named function sends
the worker a grammar of tool-call blocks (forced_call_grammar), under which the default model writes
calls the parser reads. Bad input: a tool without a function name, a tool_choice naming no tool, or
tools whose parameters cannot be compiled, is a 400 naming it (tests/test_gateway_faults.py: tools on
a gateway without a parser)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from services.gateway.tool_calls import ToolCallStreamer, forced_call_grammar, parse
from services.worker.frontend.engine import Engine
from shared.natsd import NatsServer
from shared.prompt_tokenizer import PromptTokenizer
from shared.protocol import PROTOCOL_VERSION, ChatMessage, Sampling, TokenizeRequest
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, openai_client, served_by_fake

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'


def named(calls: list[dict]) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (WEATHER, "", [("get_weather", {"city": "Paris", "unit": "°C"})]),
        ("Let me check.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Rome"), "Let me check.\n\n",
         [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_weather", {"city": "Rome", "unit": "°C"})]),
        ('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', "", [("now", {})]),
        ('<tool_call>{"name": "now"}</tool_call>', "", [("now", {})]),
        ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        ('Sure <tool_call>{"name": "f", "argu', 'Sure <tool_call>{"name": "f", "argu', []),
        ("No tools needed. <tool_c", "No tools needed. <tool_c", []),
        ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', "", [("f", {"a": 1})]),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "<tool_call>" + "[" * 100_000 + "</tool_call>", []),
    ],
)
def test_whole_answers(text: str, content: str, calls: list[tuple[str, object]]) -> None:
    got_content, got_calls = parse(text)
    assert (got_content, named(got_calls)) == (content, calls)
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


PIECES = ["<tool_call>", "</tool_call>", "<tool_c", "all>", "</tool", "<", "{\"name\": \"f\", \"arguments\": {}}",
          "{\"x\":", " ", "\n", "ok", "<tool_call>{\"name\": \"g\"}</tool_call>"]


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=10), cuts=st.lists(st.integers(0, 160), max_size=8))
def test_any_streaming_gives_the_whole_answers_content_and_calls(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    streamer = ToolCallStreamer()
    content, calls = "", []
    for start, end in zip(bounds, bounds[1:]):
        c, new = streamer.feed(text[start:end])
        content, calls = content + c, calls + new
    content += streamer.finish()
    whole_content, whole_calls = parse(text)
    assert (content, named(calls)) == (whole_content, named(whole_calls))
    assert streamer.calls == len(calls)


# ---- the tokenizer renders tools and tool turns as transformers does ----------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} {{ c.function.arguments }}"
    "</tool_call>{% endfor %}{% endif %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}


def test_tools_and_tool_turns_render_as_transformers_renders_them(qwen3_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(qwen3_path)
    tok.chat_template = TEMPLATE
    prompt_tokenizer = PromptTokenizer(tok, vocab_size=1000, context_len=512)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "18 °C", "tool_call_id": "call_1"},
    ]
    req = TokenizeRequest(v=PROTOCOL_VERSION, rid="r", gateway_id="g", worker_id="w", sampling=Sampling(),
                          messages=[ChatMessage(**m) for m in history], tools=[TOOL])
    expected = tok.apply_chat_template(history, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    assert "<tools>" in expected and "<tool_call>get_weather" in expected and "[call_1]" in expected
    assert prompt_tokenizer.prompt_ids(req) == tok.encode(expected, add_special_tokens=False)


# ---- through a gateway with --tool-call-parser qwen3 (the fake pipeline echoes the prompt's words) ----

ASKS = 'Let me check. <tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'


@pytest.fixture(scope="module")
def served(nats: NatsServer) -> Iterator[tuple[openai.OpenAI, FakePipeline]]:
    with served_by_fake(nats.url, tool_call_parser="qwen3", reasoning_parser="qwen3") as (gateway, pipeline):
        yield openai_client(gateway), pipeline


def test_a_reply_carries_the_tool_calls(served: tuple[openai.OpenAI, FakePipeline]) -> None:
    client, pipeline = served
    reply = client.chat.completions.create(model=FAKE_MODEL, messages=[{"role": "user", "content": ASKS}], tools=[TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.  "  # the echo leaves a space after the block too
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather", {"city": "Paris"})
    assert next(r for r in pipeline.requests if r.rid == reply.id.removeprefix("chatcmpl-")).tools == [TOOL]


def test_a_stream_carries_the_same_calls(served: tuple[openai.OpenAI, FakePipeline]) -> None:
    client, _ = served
    chunks = list(client.chat.completions.create(
        model=FAKE_MODEL, messages=[{"role": "user", "content": ASKS}], tools=[TOOL], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in (d.tool_calls or [])]
    assert "".join(d.content or "" for d in deltas) == "Let me check.  "
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [(0, "get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_turns_reach_the_template_and_tool_choice_none_leaves_tools_out(
    served: tuple[openai.OpenAI, FakePipeline],
) -> None:
    client, pipeline = served
    history = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
               {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}]
    reply = client.chat.completions.create(model=FAKE_MODEL, messages=history, tools=[TOOL])
    sent = next(r for r in pipeline.requests if r.rid == reply.id.removeprefix("chatcmpl-"))
    assert sent.messages[1].tool_calls == [CALL] and sent.messages[1].content == ""
    assert (sent.messages[2].role, sent.messages[2].tool_call_id) == ("tool", "call_1")
    plain = client.chat.completions.create(
        model=FAKE_MODEL, messages=[{"role": "user", "content": ASKS}], tools=[TOOL], tool_choice="none")
    assert plain.choices[0].message.content.startswith("Let me check. <tool_call>")
    assert not plain.choices[0].message.tool_calls and plain.choices[0].finish_reason == "stop"
    assert next(r for r in pipeline.requests if r.rid == plain.id.removeprefix("chatcmpl-")).tools is None


def test_a_malformed_tool_is_400_naming_it(served: tuple[openai.OpenAI, FakePipeline]) -> None:
    client, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=FAKE_MODEL, messages=[{"role": "user", "content": "x"}],
                                       tools=[TOOL, {"type": "function", "function": {"description": "no name"}}])
    assert caught.value.body["param"] == "tools.1"


# ---- forcing a call: tool_choice "required" or a named function (constrained decoding) ----

CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                      "additionalProperties": False}}}


def test_forcing_a_call_sends_the_call_grammar_and_bad_choices_are_400(served: tuple[openai.OpenAI, FakePipeline]) -> None:
    """required: calls to any tool, several unless parallel_tool_calls is false; a named function:
    one call to it. The grammar goes to the worker as the request's ebnf (what it makes the model
    write: test_a_forced_call_from_the_default_model_parses_as_that_call)."""
    client, pipeline = served
    messages = [{"role": "user", "content": "weather"}]
    cases = [
        ({"tool_choice": "required"}, forced_call_grammar([TOOL, CLOCK], None, True)),
        ({"tool_choice": "required", "parallel_tool_calls": False}, forced_call_grammar([TOOL, CLOCK], None, False)),
        ({"tool_choice": {"type": "function", "function": {"name": "now"}}}, forced_call_grammar([TOOL, CLOCK], "now", True)),
    ]
    for extra, grammar in cases:
        reply = client.chat.completions.create(model=FAKE_MODEL, messages=messages, tools=[TOOL, CLOCK], **extra)
        assert next(r for r in pipeline.requests if r.rid == reply.id.removeprefix("chatcmpl-")).sampling.ebnf == grammar
    assert "start: call (" in cases[0][1] and "start: call\n" in cases[1][1] and '"const": "get_weather"' not in cases[2][1]
    bad = [
        ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice",
         "tool_choice names 'missing', which is not among the tools"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice", "a named tool_choice is"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
         "tool_choice 'required' and response_format cannot be combined"),
    ]
    for extra, param, message in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=FAKE_MODEL, messages=messages, tools=[TOOL], **extra)
        assert caught.value.body["param"] == param and message in caught.value.body["message"]
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "array", "minContains": 2}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=FAKE_MODEL, messages=messages, tools=[odd], tool_choice="required")
    assert caught.value.body["param"] == "tools"
    assert "the tools' parameters cannot be enforced" in caught.value.body["message"]


def test_a_forced_call_from_the_default_model_parses_as_that_call(default_model_path: Path) -> None:
    """The embedded model, which has no tool training, under the call grammar: its answer is Hermes
    blocks only, and the parser reads them as calls whose arguments fit the tool's parameters."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
        "additionalProperties": False}}}
    with Engine(str(default_model_path), max_total_tokens=2048) as engine:
        prompt = engine.apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}])
        results = [engine.generate(prompt, {"temperature": 0, "max_new_tokens": 60,
                                            "ebnf": forced_call_grammar([weather, CLOCK], None, False)})]
        results += engine.generate(prompt, {"temperature": 0.8, "seed": 3, "n": 4, "max_new_tokens": 60,
                                            "ebnf": forced_call_grammar([weather, CLOCK], "get_weather", True)})
    for result in results:
        content, calls = parse(result["text"])
        assert result["meta_info"]["finish_reason"]["type"] == "stop" and content == "", result["text"]
        assert len(calls) == 1 and calls[0]["function"]["name"] in ("get_weather", "now")
        arguments = json.loads(calls[0]["function"]["arguments"])
        if calls[0]["function"]["name"] == "get_weather":
            assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
        else:
            assert arguments == {}
    assert all(parse(r["text"])[1][0]["function"]["name"] == "get_weather" for r in results[1:])
