"""Prompt log-probs through a real `radixserve up` on a tiny seeded Qwen3: `/v1/completions` with
`echo` (and `logprobs`) through the official `openai` client and raw SSE, and the native `/generate`
with `return_logprob` + `logprob_start_len` over raw HTTP. The prompt's log-probs equal the offline
Engine's (which tests/test_prompt_logprobs.py holds to transformers); the gRPC door's and the NATS
front door's (with `logprob_start_len` too) equal the native door's, and each door refuses a start
below -1 or past the prompt's end with its own kind of error."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import grpc
import httpx
import msgspec
import nats
import openai
import pytest

from services.gateway.protos import radixserve_pb2, radixserve_pb2_grpc
from services.worker.frontend.engine import Engine
from shared.protocol import PROTOCOL_VERSION, NatsGenerateChunk, NatsGenerateRequest, Sampling, encode
from tests.api_stack.conftest import Up

PROMPT = "hello there, general"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
CHUNK = msgspec.msgpack.Decoder(NatsGenerateChunk)


@pytest.fixture(scope="module")
def offline(qwen3_path: Path) -> dict[str, Any]:
    """The Engine's answer for PROMPT: 3 greedy tokens, the prompt's log-probs and top-2 from position 0."""
    with Engine(str(qwen3_path)) as engine:
        out = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 3}, return_logprob=True, top_logprobs_num=2,
                              logprob_start_len=0)
        out["prompt_ids"] = engine.tokenizer.encode(PROMPT)
    return out


@pytest.fixture(scope="module")
def up(tiny_up: Up) -> Up:
    return tiny_up


@pytest.fixture(scope="module")
def url(up: Up) -> str:
    return up.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def close(a: float | None, b: float | None) -> bool:
    return a is None and b is None or a is not None and b is not None and math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)


def test_echo_with_logprobs_lists_the_prompt_first(client: openai.OpenAI, offline: dict[str, Any]) -> None:
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                      extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text == PROMPT + offline["text"]
    lp = choice.logprobs
    n = len(offline["prompt_ids"])
    assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [v for v, _, _ in offline["meta_info"]["input_token_logprobs"]]
    expected += [v for v, _, _ in offline["meta_info"]["output_token_logprobs"]]
    assert all(close(a, b) for a, b in zip(lp.token_logprobs, expected, strict=True)), (lp.token_logprobs, expected)
    for got, want in zip(lp.top_logprobs[1:n], offline["meta_info"]["input_top_logprobs"][1:], strict=True):
        # (OpenAI's shape keys candidates by text: two tokens with one text keep one entry.)
        assert got and all(any(close(v, w) for w, _, _ in want) for v in got.values()), (got, want)
    # Offsets run over the prompt's token texts from 0, then over the answer's from the prompt's end.
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(PROMPT)
    assert all(lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i]) for i in range(n - 1))
    assert reply.usage.prompt_tokens == n and reply.usage.completion_tokens == 3


def test_echo_with_max_tokens_zero_gives_only_the_prompt_logprobs(client: openai.OpenAI, offline: dict[str, Any]) -> None:
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    choice = reply.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    expected = [v for v, _, _ in offline["meta_info"]["input_token_logprobs"]]
    assert all(close(a, b) for a, b in zip(choice.logprobs.token_logprobs, expected, strict=True))
    assert reply.usage.completion_tokens == 0
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None


def test_streamed_echo_sends_the_prompt_and_its_logprobs_first(url: str, offline: dict[str, Any]) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "echo": True,
            "logprobs": 1, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e)["choices"][0] for e in events if e != "[DONE]"]
    assert chunks[0]["text"] == PROMPT
    first = chunks[0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) == len(offline["prompt_ids"])
    expected = [v for v, _, _ in offline["meta_info"]["input_token_logprobs"]]
    assert all(close(a, b) for a, b in zip(first["token_logprobs"], expected, strict=True))
    assert "".join(c["text"] for c in chunks) == PROMPT + offline["text"]


@pytest.mark.parametrize("start", [0, 3])
def test_native_generate_returns_input_token_logprobs(url: str, offline: dict[str, Any], start: int) -> None:
    body = {"input_ids": offline["prompt_ids"], "sampling_params": {**GREEDY, "max_new_tokens": 3},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": start}
    reply = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    meta = reply.json()["meta_info"]
    want = offline["meta_info"]["input_token_logprobs"][start:]
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == offline["prompt_ids"][start:]
    assert got[0][0] is None
    assert all(close(a[0], b[0]) for a, b in zip(got[1:], want[1:], strict=True))
    assert meta["input_top_logprobs"][0] is None
    assert [[t for _, t, _ in step] for step in meta["input_top_logprobs"][1:]] == [
        [t for _, t, _ in step] for step in offline["meta_info"]["input_top_logprobs"][start + 1 :]]
    assert reply.json()["output_ids"] == offline["output_ids"]


def test_bad_logprob_start_len_is_a_400_naming_it(url: str, offline: dict[str, Any]) -> None:
    ids = offline["prompt_ids"]
    for start in (-2, len(ids)):
        reply = httpx.post(f"{url}/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": start},
                           timeout=60)
        assert reply.status_code == 400 and "logprob_start_len" in reply.text, reply.text


def test_token_id_prompts_echo_their_text_as_lm_eval_asks(client: openai.OpenAI, offline: dict[str, Any],
                                                          qwen3_path: Path) -> None:
    """lm-eval's tokenized requests: token-id prompts, echo, max_tokens 1, logprobs 1. The echo is the
    prompt's text (decoded by the detokenizer), its tokens' log-probs come first."""
    ids = offline["prompt_ids"]
    reply = client.completions.create(model="tiny", prompt=[ids, ids[:4]], max_tokens=1, temperature=0, echo=True,
                                      logprobs=1, extra_body={"ignore_eos": True})
    with Engine(str(qwen3_path)) as engine:
        texts = [engine.tokenizer.decode(p) for p in (ids, ids[:4])]
    whole, short = reply.choices
    assert whole.text == texts[0] + offline["text"][: len(whole.text) - len(texts[0])]
    assert whole.text.startswith(texts[0]) and short.text.startswith(texts[1])
    expected = [v for v, _, _ in offline["meta_info"]["input_token_logprobs"]]
    expected.append(offline["meta_info"]["output_token_logprobs"][0][0])
    assert all(close(a, b) for a, b in zip(whole.logprobs.token_logprobs, expected, strict=True))
    assert len(short.logprobs.token_logprobs) == 5 and short.logprobs.token_logprobs[0] is None
    assert all(close(a, b) for a, b in zip(short.logprobs.token_logprobs[1:4], expected[1:4], strict=True))
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text == texts[0] + offline["text"][: len(plain.choices[0].text) - len(texts[0])]
    assert plain.choices[0].logprobs is None


# ---- the gRPC door and the NATS front door ------------------------------------------------------


def native_prompt_logprobs(url: str, ids: list[int], start: int) -> dict[str, Any]:
    """The native door's meta_info for `ids` with the prompt's log-probs and top-2 from `start`."""
    body = {"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 3}, "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": start}
    reply = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def grpc_generate(up: Up, max_new_tokens: int = 3, **fields: Any) -> list[Any]:
    sampling = radixserve_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(up.grpc_target) as channel:
        stub = radixserve_pb2_grpc.RadixServeStub(channel)
        return list(stub.Generate(radixserve_pb2.GenerateRequest(sampling_params=sampling, **fields), timeout=60))


def nats_generate(up: Up, **fields: Any) -> list[NatsGenerateChunk]:
    """What a client of the NATS front door, logged in as `up` wrote, receives up to the final chunk."""
    request = NatsGenerateRequest(v=PROTOCOL_VERSION, sampling=Sampling(max_new_tokens=3, temperature=0.0, ignore_eos=True),
                                  **fields)

    async def ask() -> list[NatsGenerateChunk]:
        nc = await nats.connect(up.nats["url"], user=up.nats["user"], password=up.nats["password"])
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish(f"{up.nats['namespace']}.v1.generate", encode(request), reply=inbox)
            chunks = [CHUNK.decode((await sub.next_msg(timeout=60)).data)]
            while not chunks[-1].final:
                chunks.append(CHUNK.decode((await sub.next_msg(timeout=60)).data))
            return chunks
        finally:
            await nc.close()

    return asyncio.run(ask())


@pytest.mark.parametrize(("start", "form"), [(0, "text"), (3, "input_ids")])
def test_grpc_returns_the_native_doors_prompt_logprobs(up: Up, offline: dict[str, Any], start: int, form: str) -> None:
    ids = offline["prompt_ids"]
    native = native_prompt_logprobs(up.url, ids, start)
    prompt = {"text": PROMPT} if form == "text" else {"input_ids": radixserve_pb2.TokenIds(ids=ids)}
    responses = grpc_generate(up, **prompt, return_logprob=True, top_logprobs_num=2, logprob_start_len=start)
    (listed,) = [r for r in responses if r.prompt_logprobs]  # once, with the first token
    assert listed is responses[0] and list(listed.token_ids) == native["output_ids"][:1]
    entries = listed.prompt_logprobs
    want = native["meta_info"]["input_token_logprobs"]
    assert [e.token_id for e in entries] == [t for _, t, _ in want] == ids[start:]
    assert not entries[0].HasField("logprob") and not entries[0].top_logprobs
    assert all(close(e.logprob, w[0]) for e, w in zip(entries[1:], want[1:], strict=True))
    for entry, step in zip(entries[1:], native["meta_info"]["input_top_logprobs"][1:], strict=True):
        assert [c.token_id for c in entry.top_logprobs] == [t for _, t, _ in step]
        assert all(close(c.logprob, v) for c, (v, _, _) in zip(entry.top_logprobs, step, strict=True))
    assert [t for r in responses for t in r.token_ids] == native["output_ids"] == offline["output_ids"]
    plain = grpc_generate(up, text=PROMPT, return_logprob=True)  # no logprob_start_len: none
    assert not [r for r in plain if r.prompt_logprobs] and [lp.token_id for r in plain for lp in r.logprobs]
    (alone,) = grpc_generate(up, max_new_tokens=0, **prompt, return_logprob=True, logprob_start_len=start)
    assert alone.final and not alone.token_ids and [e.token_id for e in alone.prompt_logprobs] == ids[start:]
    assert all(close(e.logprob, w[0]) for e, w in zip(alone.prompt_logprobs[1:], want[1:], strict=True))


def test_grpc_refuses_a_start_below_minus_one_or_past_the_prompt(up: Up, offline: dict[str, Any]) -> None:
    ids = offline["prompt_ids"]
    for start in (-2, len(ids)):
        with pytest.raises(grpc.RpcError) as caught:
            grpc_generate(up, input_ids=radixserve_pb2.TokenIds(ids=ids), return_logprob=True, logprob_start_len=start)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "logprob_start_len" in caught.value.details(), caught.value.details()


@pytest.mark.parametrize("stream", [True, False])
def test_the_nats_front_door_returns_the_native_doors_prompt_logprobs(up: Up, offline: dict[str, Any], stream: bool) -> None:
    ids, start = offline["prompt_ids"], 2
    native = native_prompt_logprobs(up.url, ids, start)
    chunks = nats_generate(up, text=PROMPT, return_logprob=True, logprob_start_len=start, stream=stream)
    assert chunks[-1].error is None
    (listed,) = [c for c in chunks if c.prompt_logprobs is not None]
    # Streamed: on the chunk with the first token; not streamed: on the one final.
    assert listed is chunks[0] and listed.token_ids[:1] == native["output_ids"][:1] and listed.final is not stream
    want = native["meta_info"]["input_token_logprobs"]
    assert listed.prompt_token_ids == [t for _, t, _ in want] == ids[start:]
    assert listed.prompt_logprobs[0] is None
    assert all(close(a, w[0]) for a, w in zip(listed.prompt_logprobs[1:], want[1:], strict=True))
    assert [t for c in chunks for t in c.token_ids] == native["output_ids"]
    assert [v for c in chunks for v in c.logprobs or []] == pytest.approx(
        [v for v, _, _ in native["meta_info"]["output_token_logprobs"]], rel=1e-4, abs=1e-4)


def test_the_nats_front_door_refuses_a_start_below_minus_one_or_past_the_prompt(up: Up, offline: dict[str, Any]) -> None:
    ids = offline["prompt_ids"]
    for start in (-2, len(ids)):
        chunks = nats_generate(up, input_ids=ids, return_logprob=True, logprob_start_len=start)
        assert chunks[-1].final and chunks[-1].error.startswith("400: ") and "logprob_start_len" in chunks[-1].error, chunks
