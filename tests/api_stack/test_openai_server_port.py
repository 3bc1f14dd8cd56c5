"""What SGLang's test/srt/openai_server tests and vLLM's tests/entrypoints/openai tests ask of an
OpenAI-compatible server, asked of ours: one `radixserve up` on a tiny seeded Qwen3 (with a tool-call
parser), driven by the official `openai` client (raw HTTP where the client cannot say it). Texts and
log-probs are held to the offline Engine's greedy answers (which tests/test_engine.py holds to
transformers), token counts and the tokenize routes to the checkpoint's tokenizer, structured outputs
to json.loads and jsonschema. Where we differ from OpenAI, vLLM or SGLang on purpose, docs/API.md
("Differences from OpenAI, vLLM and SGLang") says so and the test asserts what we do."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.worker.frontend.engine import Engine
from tests.api_stack.conftest import Up

MODEL = "tiny"
CONTEXT = 256  # tiny_qwen3_config's max_position_embeddings
PROMPTS = ("The capital of France is", "A radix tree shares")
CHAT = [{"role": "user", "content": "What is the capital of Italy?"}]
N = 8  # tokens per greedy answer
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(qwen3_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(qwen3_path)


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


@pytest.fixture(scope="module")
def offline(qwen3_path: Path, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The Engine's greedy answers: N tokens for each of PROMPTS (with top-3 log-probs, the prompt's
    from position 0), 3 * N for CHAT (top-3 log-probs)."""
    greedy = {"temperature": 0.0}
    with Engine(str(qwen3_path)) as engine:
        texts = engine.generate(list(PROMPTS), {**greedy, "max_new_tokens": N}, return_logprob=True,
                                top_logprobs_num=3, logprob_start_len=0)
        chat = engine.generate(input_ids=chat_ids(tokenizer, CHAT), sampling_params={**greedy, "max_new_tokens": 3 * N},
                               return_logprob=True, top_logprobs_num=3)
    return {"texts": texts, "chat": chat}


@pytest.fixture(scope="module")
def url(tiny_up: Up) -> str:
    return tiny_up.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60) as raw:
        yield raw


def a_stop_in(text: str) -> str:
    """Two ASCII letters that first occur past the start of `text`: a stop string it will meet."""
    for i in range(1, len(text) - 1):
        piece = text[i : i + 2]
        if piece.isascii() and piece.isalpha() and text.find(piece) == i:
            return piece
    raise AssertionError(f"no stop string to pick in {text!r}")


# ---- completions --------------------------------------------------------------------------------


def test_greedy_completion_ends_with_length_at_max_tokens(client: openai.OpenAI, offline: dict[str, Any],
                                                           tokenizer: PreTrainedTokenizerBase) -> None:
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=0)
    want = offline["texts"][0]
    assert reply.object == "text_completion" and reply.model == MODEL
    assert [(c.index, c.text, c.finish_reason) for c in reply.choices] == [(0, want["text"], "length")]
    assert want["meta_info"]["finish_reason"]["type"] == "length"
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(tokenizer.encode(PROMPTS[0])), N)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_echo_with_logprobs_lists_the_prompt_then_the_answer(client: openai.OpenAI, offline: dict[str, Any]) -> None:
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=0, echo=True, logprobs=3)
    want = offline["texts"][0]
    choice = reply.choices[0]
    assert choice.text == PROMPTS[0] + want["text"]
    meta = want["meta_info"]
    expected = [v for v, _, _ in meta["input_token_logprobs"]] + [v for v, _, _ in meta["output_token_logprobs"]]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert len(choice.logprobs.tokens) == reply.usage.prompt_tokens + N
    assert "".join(choice.logprobs.tokens[: reply.usage.prompt_tokens]) == PROMPTS[0]  # ASCII: a text per token
    # Candidates are keyed by text (OpenAI's shape): at most 3, and each one a value the Engine had.
    for got, top in zip(choice.logprobs.top_logprobs[-N:], meta["output_top_logprobs"], strict=True):
        assert 1 <= len(got) <= 3 and all(any(math.isclose(v, w, abs_tol=1e-4) for w, _, _ in top) for v in got.values())
    assert choice.logprobs.text_offset[0] == 0


def test_n_choices_are_indexed_and_a_seed_gives_choice_i_the_seed_plus_i(client: openai.OpenAI) -> None:
    def sampled(seed: int, n: int = 1) -> list[str]:
        reply = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N, temperature=1.0, seed=seed, n=n,
                                          extra_body={"ignore_eos": True})
        assert [c.index for c in reply.choices] == list(range(n))
        assert reply.usage.completion_tokens == n * N
        return [c.text for c in reply.choices]

    first, again = sampled(11), sampled(11)
    assert first == again  # the same seed and temperature: the same text
    other = sampled(12)
    assert other != first
    assert sampled(11, n=2) == first + other  # documented: choice i of n samples with seed + i


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI, offline: dict[str, Any]) -> None:
    text = offline["texts"][0]["text"]
    stop = a_stop_in(text)
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=0, stop=[stop, "\x00\x01"])
    choice = reply.choices[0]
    assert (choice.text, choice.finish_reason) == (text[: text.index(stop)], "stop")
    assert choice.model_extra["matched_stop"] == stop  # SGLang's field


def test_a_batch_of_text_or_token_id_prompts_maps_choices_prompt_major(client: openai.OpenAI, offline: dict[str, Any],
                                                                      tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [tokenizer.encode(p) for p in PROMPTS]
    want = [o["text"] for o in offline["texts"]]
    for prompt in (list(PROMPTS), ids):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, n=2)
        assert [(c.index, c.text) for c in reply.choices] == [(0, want[0]), (1, want[0]), (2, want[1]), (3, want[1])]
        assert reply.usage.prompt_tokens == len(ids[0]) + len(ids[1])  # each prompt once, whatever n
        assert reply.usage.completion_tokens == 4 * N
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=N, temperature=0)
    assert single.choices[0].text == want[1]


def test_a_stream_with_include_usage_ends_with_a_usage_chunk(client: openai.OpenAI, offline: dict[str, Any],
                                                              tokenizer: PreTrainedTokenizerBase) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == offline["texts"][0]["text"]
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]
    assert chunks[-1].choices == [] and all(chunk.usage is None for chunk in chunks[:-1])
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(tokenizer.encode(PROMPTS[0])), N)
    plain = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, stream=True, n=2))
    assert all(chunk.usage is None and chunk.choices for chunk in plain)
    assert {c.index for chunk in plain for c in chunk.choices} == {0, 1}


# ---- chat ---------------------------------------------------------------------------------------


def test_greedy_chat_answers_as_the_engine_and_counts_the_template(client: openai.OpenAI, offline: dict[str, Any],
                                                                  tokenizer: PreTrainedTokenizerBase) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3 * N, temperature=0, n=2)
    want = offline["chat"]["text"]
    assert reply.object == "chat.completion"
    assert [(c.index, c.message.role, c.message.content) for c in reply.choices] == [(0, "assistant", want),
                                                                                     (1, "assistant", want)]
    assert reply.usage.prompt_tokens == len(chat_ids(tokenizer, CHAT))
    assert reply.usage.completion_tokens == 2 * 3 * N


def test_chat_logprobs_list_each_token_with_its_top_candidates(client: openai.OpenAI, offline: dict[str, Any]) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0, logprobs=True,
                                           top_logprobs=3)
    content = reply.choices[0].logprobs.content
    meta = offline["chat"]["meta_info"]
    assert len(content) == N
    for entry, (value, _, _), top in zip(content, meta["output_token_logprobs"], meta["output_top_logprobs"], strict=False):
        assert entry.logprob == pytest.approx(value, abs=1e-4)
        assert [c.logprob for c in entry.top_logprobs] == pytest.approx([w for w, _, _ in top], abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top candidate
        assert entry.bytes == list(entry.token.encode())  # the decoded text's bytes (docs/API.md, differences)
    zero = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in zero.choices[0].logprobs.content] == [[], []]
    none = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert none.choices[0].logprobs is None


def test_chat_stop_string(client: openai.OpenAI, offline: dict[str, Any]) -> None:
    text = offline["chat"]["text"]
    stop = a_stop_in(text)
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3 * N, temperature=0, stop=stop)
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == (text[: text.index(stop)], "stop")


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}},
])
def test_response_format_answers_parse_and_fit_the_schema(client: openai.OpenAI, response_format: dict[str, Any]) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0,
                                           response_format=response_format)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(answer := json.loads(choice.message.content), dict)
    if response_format["type"] == "json_schema":
        jsonschema.validate(answer, SCHEMA)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_a_forcing_tool_choice_gives_a_call_with_json_arguments(client: openai.OpenAI, tool_choice: object) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=150, temperature=0, tools=TOOLS,
                                           tool_choice=tool_choice, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_streamed_forced_call_arrives_whole_and_the_usage_last(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=150, temperature=0, tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    calls = [call for chunk in chunks for c in chunk.choices for call in c.delta.tool_calls or []]
    assert [(call.index, call.function.name) for call in calls] == [(0, "get_weather")]
    jsonschema.validate(json.loads(calls[0].function.arguments), PARAMETERS["get_weather"])
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["tool_calls"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_a_chat_stream_gives_the_greedy_text_and_usage(client: openai.OpenAI, offline: dict[str, Any],
                                                       tokenizer: PreTrainedTokenizerBase) -> None:
    # vLLM's continuous_usage_stats is not taken (docs/API.md, differences): the usage still comes once.
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3 * N, temperature=0,
                                                 stream=True, stream_options=options))
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == offline["chat"]["text"]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(chat_ids(tokenizer, CHAT)), 3 * N)
    assert all(chunk.usage is None for chunk in chunks[:-1])


# ---- tokenize and detokenize ----------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_and_detokenize_round_trip_as_the_tokenizer(http: httpx.Client, prefix: str,
                                                             tokenizer: PreTrainedTokenizerBase) -> None:
    for prompt in (*PROMPTS, "hello world, hello radixserve! ünïcödé"):
        for special in (True, False):
            got = http.post(f"{prefix}/tokenize", json={"model": MODEL, "prompt": prompt, "add_special_tokens": special})
            ids = tokenizer.encode(prompt, add_special_tokens=special)
            assert got.json() == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids}
        back = http.post(f"{prefix}/detokenize", json={"model": MODEL, "tokens": ids}).json()
        assert back == {"prompt": tokenizer.decode(ids)} and back["prompt"] == prompt
    chat = http.post(f"{prefix}/tokenize", json={"model": MODEL, "messages": CHAT}).json()
    assert chat["tokens"] == chat_ids(tokenizer, CHAT)


# ---- errors -------------------------------------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2}
CHAT_BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 2}


@pytest.mark.parametrize(("path", "fields", "param", "message"), [
    ("completions", {"max_tokens": -1}, "max_tokens", "max_tokens: Input should be greater than or equal to 0"),
    ("chat/completions", {"max_tokens": -1}, "max_tokens", "max_tokens: Input should be greater than or equal to 0"),
    ("completions", {"temperature": -0.5}, "temperature", "temperature must be >= 0, got -0.5"),
    ("chat/completions", {"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
    ("completions", {"n": 129}, "n", "n: Input should be less than or equal to 128"),
    ("completions", {"logprobs": 21}, "logprobs", "logprobs: Input should be less than or equal to 20"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs: Input should be less than or equal to 20"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ("completions", {"min_tokens": 5}, "min_tokens", "min_tokens (5) must not exceed max_tokens (2)"),
    ("chat/completions", {"max_completion_tokens": 3, "min_tokens": 5}, "min_tokens",
     "min_tokens (5) must not exceed max_completion_tokens (3)"),
    ("completions", {"prompt": ""}, "prompt", "prompt must not be empty"),
    ("completions", {"prompt": [[]]}, "prompt", "prompt must not be empty"),
    ("chat/completions", {"messages": []}, "messages", "messages: List should have at least 1 item"),
    ("completions", {"seed": 2**63}, "seed", "seed: Input should be less than or equal to 9007199254740991"),
    ("chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "tool_choice names 'nope', which is not among the tools"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "bogus"}}}}, "response_format", "json_schema cannot be compiled"),
    ("chat/completions", {"messages": [{"role": "my-custom-role", "content": "hi"}]}, "messages.0.role",
     "messages.0.role: Input should be 'system'"),
])
def test_bad_fields_are_400s_in_openai_shape_naming_the_field(http: httpx.Client, path: str, fields: dict[str, Any],
                                                              param: str, message: str) -> None:
    body = {**(COMPLETION if path == "completions" else CHAT_BODY), **fields}
    for stream in (False, True):  # a stream refused before its first output is still an HTTP status
        reply = http.post(f"/v1/{path}", json={**body, "stream": stream})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (set(error), error["type"], error["param"], error["code"]) == (
            {"message", "type", "param", "code"}, "invalid_request_error", param, 400)
        assert message in error["message"]


def test_the_openai_client_raises_not_found_and_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-9", prompt="x")
    assert missing.value.body == {"message": "model 'gpt-9' is not served here; available: ['tiny']",
                                  "type": "not_found_error", "param": "model", "code": 404}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=CHAT, stream=True)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert [(m.id, m.model_extra["max_model_len"]) for m in client.models.list().data] == [(MODEL, CONTEXT)]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert (bad.value.status_code, bad.value.param, bad.value.type) == (400, "temperature", "invalid_request_error")


def test_a_prompt_longer_than_the_context_is_a_400_naming_the_field_sent(
    client: openai.OpenAI, http: httpx.Client, tokenizer: PreTrainedTokenizerBase,
) -> None:
    long = "hello " * 200
    count = len(tokenizer.encode(long))
    assert count > CONTEXT
    with pytest.raises(openai.BadRequestError) as text:
        client.completions.create(model=MODEL, prompt=long, max_tokens=2)
    assert text.value.body["message"] == (
        f"the prompt has {count} tokens; the model's context is {CONTEXT} (`prompt` too long)")
    assert text.value.param == "prompt"
    # Token ids go straight to a worker, which refuses them: the same field.
    with pytest.raises(openai.BadRequestError) as ids:
        client.completions.create(model=MODEL, prompt=list(range(3, 3 + CONTEXT)), max_tokens=2)
    assert ids.value.body["message"] == (
        f"the prompt has {CONTEXT} tokens; the model's context is {CONTEXT} (`prompt` too long)")
    assert ids.value.param == "prompt"
    messages = [{"role": "user", "content": long}]
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=messages)
    chat_count = len(chat_ids(tokenizer, messages))
    assert chat.value.body["message"] == (
        f"the prompt has {chat_count} tokens; the model's context is {CONTEXT} (`messages` too long)")
    assert chat.value.param == "messages"
    # A stream is refused before its first output, as an HTTP status too; and the native door's fields.
    for path, body, param in (("/v1/chat/completions", {"model": MODEL, "messages": messages, "stream": True}, "messages"),
                              ("/generate", {"text": long}, "text"),
                              ("/generate", {"input_ids": list(range(3, 3 + CONTEXT))}, "input_ids")):
        reply = http.post(path, json=body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], f"(`{param}` too long)" in error["message"]) == (param, True), error


# ---- where we differ on purpose (docs/API.md, "Differences from OpenAI, vLLM and SGLang") ----------


@pytest.mark.parametrize("max_tokens", [50, None])
def test_max_tokens_past_the_context_or_null_is_cut_at_the_context(client: openai.OpenAI, max_tokens: int | None) -> None:
    """vLLM and SGLang refuse prompt + max_tokens over the context, OpenAI reads null as 16; we answer
    up to the context's end (as vLLM does for null)."""
    prompt = list(range(3, CONTEXT - 7))
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), CONTEXT - len(prompt))


def test_temperature_above_2_max_tokens_0_and_stream_options_without_stream_are_taken(client: openai.OpenAI) -> None:
    """OpenAI refuses temperature > 2, OpenAI and vLLM max_tokens 0 and stream_options without stream;
    SGLang and vLLM sample at any temperature >= 0, SGLang takes max_tokens 0, and we ignore stream
    options when not streaming."""
    hot = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=2.5)
    assert hot.usage.completion_tokens == 2
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=False,
                                           stream_options={"include_usage": True})
    assert plain.object == "chat.completion" and plain.usage.completion_tokens == 2
    empty = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=0)
    assert (empty.choices[0].message.content, empty.choices[0].finish_reason) == ("", "length")
    assert empty.usage.completion_tokens == 0
