"""The OpenAI-compatible API of the gateway, driven by the official `openai` client, against a scripted
pipeline (tests/gateway_helpers.FakePipeline) on a real nats-server: request translation, SSE framing,
n fan-out, logprobs, stop, usage. The same API over the real services is in test_gateway_e2e.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from shared.protocol import Sampling
from tests.gateway_helpers import FAKE_MODEL, FakePipeline, GatewayThread


@pytest.fixture(scope="module")
def client(gateway: GatewayThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len("data: ") :] for line in response.text.split("\n\n") if line.startswith("data: ")]


def test_models_lists_what_live_workers_serve(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [FAKE_MODEL]
    assert client.models.retrieve(FAKE_MODEL).id == FAKE_MODEL


def test_chat_completion_returns_the_pipeline_text_and_usage(client: openai.OpenAI, pipeline: FakePipeline) -> None:
    reply = client.chat.completions.create(
        model=FAKE_MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha beta gamma"}],
        max_tokens=10,
        temperature=0.5,
        top_p=0.9,
        extra_body={"top_k": 5, "min_p": 0.1},
    )
    assert reply.object == "chat.completion"
    assert reply.model == FAKE_MODEL
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "alpha beta gamma "
    assert reply.choices[0].finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (3, 3, 6)
    sent = next(r for r in pipeline.requests if r.rid == reply.id.removeprefix("chatcmpl-"))
    assert [(m.role, m.content) for m in sent.messages or []] == [("system", "be brief"), ("user", "alpha beta gamma")]
    assert (sent.sampling.max_new_tokens, sent.sampling.temperature, sent.sampling.top_p) == (10, 0.5, 0.9)
    assert (sent.sampling.top_k, sent.sampling.min_p) == (5, 0.1)


def test_logit_bias_reaches_the_worker_keyed_by_token_id(client: openai.OpenAI, pipeline: FakePipeline) -> None:
    """OpenAI's JSON keys are strings; the worker gets token ids. Bad keys or values are 400s naming
    logit_bias (what the worker does with it: tests/test_sampler.py, tests/test_engine.py)."""
    reply = client.chat.completions.create(
        model=FAKE_MODEL, messages=[{"role": "user", "content": "bias me"}], logit_bias={"42": -100, "7": 2.5}
    )
    sent = next(r for r in pipeline.requests if r.rid == reply.id.removeprefix("chatcmpl-"))
    assert sent.sampling.logit_bias == {42: -100.0, 7: 2.5}
    reply = client.completions.create(model=FAKE_MODEL, prompt="x", logit_bias={"3": 1})
    assert next(r for r in pipeline.requests if r.rid == reply.id.removeprefix("cmpl-")).sampling.logit_bias == {3: 1.0}
    for bias, message in (({"the": 1}, "logit_bias keys must be token ids, got 'the'"),
                          ({"5": 101}, "logit_bias for token 5 must be a number in [-100, 100], got 101"),
                          ({"-5": 1}, "logit_bias keys must be token ids, got '-5'")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=FAKE_MODEL, prompt="x", logit_bias=bias)
        assert caught.value.status_code == 400
        assert caught.value.body["param"] == "logit_bias"
        assert message in caught.value.body["message"]


def test_response_format_regex_and_ebnf_reach_the_worker_as_its_grammar(client: openai.OpenAI, pipeline: FakePipeline) -> None:
    """json_object is "any object"; json_schema sends the schema as JSON text; SGLang's regex and ebnf
    extensions pass as they are, on chat and completions (what the worker does with them:
    tests/test_grammar.py; refusals: tests/test_gateway_faults.py)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def sent_for(reply: object, prefix: str) -> Sampling:
        return next(r for r in pipeline.requests if r.rid == reply.id.removeprefix(prefix)).sampling

    messages = [{"role": "user", "content": "json please"}]
    reply = client.chat.completions.create(model=FAKE_MODEL, messages=messages, response_format={"type": "json_object"})
    assert sent_for(reply, "chatcmpl-").json_schema == '{"type": "object"}'
    reply = client.chat.completions.create(
        model=FAKE_MODEL, messages=messages,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    sent = sent_for(reply, "chatcmpl-")
    assert json.loads(sent.json_schema) == schema and (sent.regex, sent.ebnf) == (None, None)
    reply = client.chat.completions.create(model=FAKE_MODEL, messages=messages, response_format={"type": "text"})
    assert sent_for(reply, "chatcmpl-").json_schema is None
    reply = client.completions.create(model=FAKE_MODEL, prompt="x", extra_body={"regex": "[0-9]+"})
    assert sent_for(reply, "cmpl-").regex == "[0-9]+"
    reply = client.completions.create(model=FAKE_MODEL, prompt="x", extra_body={"ebnf": 'root ::= "y"'})
    assert sent_for(reply, "cmpl-").ebnf == 'root ::= "y"'
    reply = client.completions.create(model=FAKE_MODEL, prompt="x", extra_body={"response_format": {"type": "json_object"}})
    assert sent_for(reply, "cmpl-").json_schema == '{"type": "object"}'


def test_chat_without_max_tokens_may_fill_the_context(client: openai.OpenAI, pipeline: FakePipeline) -> None:
    reply = client.chat.completions.create(model=FAKE_MODEL, messages=[{"role": "user", "content": "x y"}])
    sent = next(r for r in pipeline.requests if r.rid == reply.id.removeprefix("chatcmpl-"))
    assert sent.sampling.max_new_tokens == 64  # the worker's context_len; the worker clips it


def test_max_completion_tokens_ends_with_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=FAKE_MODEL, messages=[{"role": "user", "content": "a b c d e"}], max_completion_tokens=2
    )
    assert reply.choices[0].message.content == "a b "
    assert reply.choices[0].finish_reason == "length"


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, pipeline: FakePipeline) -> None:
    reply = client.completions.create(model=FAKE_MODEL, prompt="one two three four", stop=["three"], max_tokens=10)
    assert reply.choices[0].text == "one two "
    assert reply.choices[0].finish_reason == "stop"
    sent = next(r for r in pipeline.requests if r.rid == reply.id.removeprefix("cmpl-"))
    assert sent.sampling.stop == ["three"]


def test_n_fans_out_into_requests_with_consecutive_seeds(client: openai.OpenAI, pipeline: FakePipeline) -> None:
    reply = client.chat.completions.create(
        model=FAKE_MODEL, messages=[{"role": "user", "content": "p q"}], n=2, seed=7, max_tokens=5
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.content == "p q " for c in reply.choices)
    assert reply.usage.prompt_tokens == 2  # the prompt is counted once
    assert reply.usage.completion_tokens == 4
    seeds = sorted(r.sampling.seed for r in pipeline.requests if r.messages and r.messages[-1].content == "p q")
    assert seeds == [7, 8]


def test_chat_logprobs_name_tokens_and_top_candidates(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=FAKE_MODEL, messages=[{"role": "user", "content": "x y"}], logprobs=True, top_logprobs=2, max_tokens=5
    )
    content = reply.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in content] == [("x ", -0.1), ("y ", -0.2)]
    assert content[0].bytes == list(b"x ")
    assert [(c.token, c.logprob) for c in content[0].top_logprobs] == [("c0", -0.1), ("c1", -0.2)]


def test_completion_logprobs_use_the_legacy_shape(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=FAKE_MODEL, prompt="ab cd", logprobs=1, max_tokens=5)
    lp = reply.choices[0].logprobs
    assert lp.tokens == ["ab ", "cd "]
    assert lp.token_logprobs == [-0.1, -0.2]
    assert lp.top_logprobs == [{"c0": -0.1}, {"c0": -0.1}]
    assert lp.text_offset == [0, 3]


def test_completions_take_a_batch_of_token_id_prompts(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=FAKE_MODEL, prompt=[[1, 2], [3]], n=2, max_tokens=5)
    texts = [(c.index, c.text) for c in reply.choices]
    assert texts == [(0, "t1 t2 "), (1, "t1 t2 "), (2, "t3 "), (3, "t3 ")]
    assert reply.usage.prompt_tokens == 3


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=FAKE_MODEL, prompt="hello there", echo=True, max_tokens=5)
    assert reply.choices[0].text == "hello there" + "hello there "


def test_a_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "cache me if you can"
    first = client.completions.create(model=FAKE_MODEL, prompt=prompt, max_tokens=8)
    second = client.completions.create(model=FAKE_MODEL, prompt=prompt, max_tokens=8)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 4


def test_chat_stream_with_the_openai_client(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=FAKE_MODEL,
        messages=[{"role": "user", "content": "red green blue"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "red green blue "
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 3)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_with_n_2_interleaves_both_choices(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=FAKE_MODEL, prompt="u v w", n=2, stream=True, max_tokens=8)
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: "u v w ", 1: "u v w "}
    assert finishes == {0: "stop", 1: "stop"}


def test_sse_framing_is_data_lines_ending_with_done(gateway: GatewayThread) -> None:
    body = {"model": FAKE_MODEL, "prompt": "a b", "stream": True, "max_tokens": 4}
    response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "a b "
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert response.text.endswith("data: [DONE]\n\n")


def test_stream_logprobs_arrive_with_each_delta(gateway: GatewayThread) -> None:
    body = {
        "model": FAKE_MODEL, "messages": [{"role": "user", "content": "k l"}], "stream": True,
        "logprobs": True, "top_logprobs": 1,
    }
    events = sse_events(httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=10))
    entries = [
        entry
        for e in events[:-1]
        for choice in json.loads(e)["choices"]
        if choice["logprobs"]
        for entry in choice["logprobs"]["content"]
    ]
    assert [(e["token"], e["logprob"]) for e in entries] == [("k ", -0.1), ("l ", -0.2)]
