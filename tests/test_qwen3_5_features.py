"""Qwen3.5 hybrid models (dense and MoE) with the request features Qwen3 has, through the offline Engine,
each against a reference (retraction, abort, prompt log-probs, overlap and greedy n=2 are in
test_qwen3_5_engine.py / test_qwen3_5_prefix_cache.py):
- repetition penalty: transformers' generate with repetition_penalty; frequency and presence penalties
  (with repetition): the argmax of transformers' logits penalised step by step, as OpenAI defines them;
- constrained decoding (JSON schema, regex, EBNF): transformers' generate masked by an llguidance
  matcher of its own (tests/test_grammar.py's reference), and the output parses / matches;
- grammars, penalties and seeded sampling through retraction, chunked prefill and the overlap schedule:
  the tokens of an ample pool without overlap;
- seeded sampling with n=3: copy i is the request with seed + i, alone or in a mixed batch;
- top-k log-probs: transformers' log-softmax and its top k;
- finish reasons: max_new_tokens (length), a stop token id, a stop string (the text cut before it);
- the serving path: a worker process on the tiny Qwen3.5 behind an in-process gateway answers OpenAI
  completion and chat requests with the Engine's tokens (the official openai client)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from services.worker.frontend.engine import Engine
from shared.natsd import NatsServer
from tests.checkpoints import tiny_qwen3_5_moe_config, write_checkpoint
from tests.engine_helpers import GREEDY, EnginePool, hf_model, output_ids, random_prompts
from tests.gateway_helpers import GatewayThread, wait_for_workers
from tests.services_helpers import ServiceProcess
from tests.test_grammar import CONSTRAINTS, check_constrained_batch, fits

# The transformers references run single-threaded (tests/conftest.py's one_thread says why).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3_5_moe_tok_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """conftest's Qwen3.5-MoE checkpoint (same seed) with a tokenizer, for grammars and stop strings."""
    path = tmp_path_factory.mktemp("qwen3_5_moe_tok")
    return write_checkpoint(path, tiny_qwen3_5_moe_config(), seed=7, tokenizer=True)


@pytest.fixture(params=["qwen3_5_path", "qwen3_5_moe_tok_path"])
def hybrid(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def hf_repetition_greedy(path: Path, prompt: list[int], n: int, penalty: float) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(str(path)).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None,
            pad_token_id=0, repetition_penalty=penalty,
        )
    return out[0, len(prompt):].tolist()


def penalised_greedy(path: Path, prompt: list[int], n: int, rep: float, freq: float, pres: float) -> list[int]:
    """Greedy over transformers' logits of prompt + output so far, one full forward a step: the
    repetition penalty (transformers') on every token seen, then OpenAI's frequency and presence
    penalties on the output tokens."""
    model, output = hf_model(str(path)), []
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([prompt + output])).logits[0, -1].float()
        for t in set(prompt + output):
            row[t] = row[t] * rep if row[t] < 0 else row[t] / rep
        for t in set(output):
            row[t] -= freq * output.count(t) + pres
        output.append(int(row.argmax()))
    return output


def test_penalties_give_the_tokens_of_transformers_penalised_logits(hybrid: Path, engine_pool: EnginePool) -> None:
    """One batch: a repetition-penalty request, a frequency + presence (+ repetition) one, and a plain
    one; each gets its reference's tokens, and the penalties changed the tokens."""
    prompts = random_prompts(3, 6, 14, seed=51)
    n = 16
    params = [
        {**GREEDY, "max_new_tokens": n, "repetition_penalty": 5.0},
        {**GREEDY, "max_new_tokens": n, "frequency_penalty": 1.5, "presence_penalty": 0.8, "repetition_penalty": 1.1},
        {**GREEDY, "max_new_tokens": n},
    ]
    got = output_ids(engine_pool.get(hybrid).generate(input_ids=prompts, sampling_params=params))
    plain = penalised_greedy(hybrid, prompts[2], n, 1.0, 0.0, 0.0)
    assert got[2] == plain
    assert got[0] == hf_repetition_greedy(hybrid, prompts[0], n, 5.0)
    assert got[1] == penalised_greedy(hybrid, prompts[1], n, 1.1, 1.5, 0.8)
    assert got[0] != penalised_greedy(hybrid, prompts[0], n, 1.0, 0.0, 0.0)
    assert got[1] != penalised_greedy(hybrid, prompts[1], n, 1.0, 0.0, 0.0)


@pytest.mark.parametrize(("name", "overlap"), [("qwen3_5_path", False), ("qwen3_5_moe_tok_path", True)])
def test_constrained_tokens_match_transformers_with_a_masking_processor(
    name: str, overlap: bool, request: pytest.FixtureRequest, engine_pool: EnginePool
) -> None:
    """JSON schema, regex and EBNF requests beside an unconstrained one: transformers' tokens under the
    same masks, outputs that fit their grammar, and the unconstrained tokens as alone (dense without the
    overlap schedule, MoE with it)."""
    hybrid = request.getfixturevalue(name)
    check_constrained_batch(engine_pool.get(hybrid, disable_overlap_schedule=not overlap), hybrid)


def test_seeded_n_copies_are_the_requests_with_seed_plus_i_alone_and_in_a_batch(
    qwen3_5_moe_path: Path, engine_pool: EnginePool
) -> None:
    """n=3 with seed 42 at temperature 1: copy i's tokens are those of a lone request with seed 42 + i,
    also when the copies share a batch with other sampled and greedy requests; the copies differ."""
    prompt = random_prompts(1, 10, 10, seed=8)[0]
    others = random_prompts(3, 3, 30, seed=9)
    sampled = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
    engine = engine_pool.get(qwen3_5_moe_path)
    alone = [engine.generate(input_ids=prompt, sampling_params={**sampled, "seed": 42 + i}) for i in range(3)]
    copies = engine.generate(input_ids=prompt, sampling_params={**sampled, "seed": 42, "n": 3})
    mixed = engine.generate(
        input_ids=[others[0], prompt, *others[1:]],
        sampling_params=[
            {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 9},
            {**sampled, "seed": 42, "n": 3},
            {"temperature": 0.0, "max_new_tokens": 20},
            {"temperature": 1.3, "top_k": 5, "max_new_tokens": 16, "frequency_penalty": 0.5},
        ],
    )
    expected = output_ids(alone)
    assert len({tuple(e) for e in expected}) == 3
    assert output_ids(copies) == expected
    assert output_ids(mixed[1:4]) == expected


def test_top_logprobs_equal_transformers_log_softmax(qwen3_5_moe_path: Path, engine_pool: EnginePool) -> None:
    prompt = random_prompts(1, 12, 12, seed=10)[0]
    out = engine_pool.get(qwen3_5_moe_path).generate(
        input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 6}, return_logprob=True, top_logprobs_num=3
    )
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(str(qwen3_5_moe_path))(ids).logits[0].float(), dim=-1)
    assert len(out["meta_info"]["output_token_logprobs"]) == 6
    for step, (lp, tid, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        expected = ref[len(prompt) - 1 + step]
        assert math.isclose(lp, expected[tid].item(), rel_tol=1e-4, abs_tol=1e-4)
        top = out["meta_info"]["output_top_logprobs"][step]
        values, indices = expected.topk(3)
        assert [t for _, t, _ in top] == indices.tolist() and top[0][1] == tid
        for (got, _, _), want in zip(top, values.tolist()):
            assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-4)


def test_finish_reasons_length_stop_token_and_stop_string(qwen3_5_path: Path, engine_pool: EnginePool) -> None:
    prompt = "The capital of France is"
    engine = engine_pool.get(qwen3_5_path)
    free = engine.generate(prompt, {**GREEDY, "max_new_tokens": 24})
    text, ids = free["text"], free["output_ids"]
    stop_id = ids[3]
    by_id = engine.generate(prompt, {**GREEDY, "max_new_tokens": 24, "stop_token_ids": [stop_id]})
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = engine.generate(prompt, {**GREEDY, "max_new_tokens": 24, "stop": [stop]})
    assert free["meta_info"]["finish_reason"] == {"type": "length", "matched": 24} and len(ids) == 24
    assert by_id["output_ids"] == ids[: ids.index(stop_id) + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert len(text) > 8 and cut["text"] == text[: text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(cut["output_ids"]) < len(ids)


def test_grammars_penalties_and_seeds_survive_retraction_and_overlap(qwen3_5_moe_tok_path: Path) -> None:
    """Twelve requests (constrained, penalised, seeded sampling) in a pool small enough to retract, with
    the overlap schedule and chunked prefill: the tokens of an ample pool without overlap (a retracted
    request recomputes its linear-attention state from its prompt and output, and keeps its matcher,
    penalty counts and seed)."""
    prompts = random_prompts(12, 10, 20, seed=61)
    kinds = [
        *[{"temperature": 0, **c} for c in CONSTRAINTS],
        {"temperature": 0, "ignore_eos": True, "frequency_penalty": 1.5, "presence_penalty": 0.8},
        {"temperature": 1.0, "ignore_eos": True, "seed": 5, "repetition_penalty": 1.3},
        {"temperature": 0.8, "top_k": 20, "ignore_eos": True, "seed": 9},
    ]
    params = [{**kinds[i % len(kinds)], "max_new_tokens": 40} for i in range(len(prompts))]
    runs = []
    for options in ({"disable_overlap_schedule": True},
                    {"disable_overlap_schedule": False, "max_total_tokens": 100, "chunked_prefill_size": 8}):
        with Engine(str(qwen3_5_moe_tok_path), **options) as engine:
            runs.append(engine.generate(input_ids=prompts, sampling_params=params))
            stats = engine.get_server_info()["stats"]
    assert stats["num_retractions"] > 0
    assert output_ids(runs[1]) == output_ids(runs[0])
    for i, result in enumerate(runs[1]):
        if i % len(kinds) < len(CONSTRAINTS):
            assert fits(CONSTRAINTS[i % len(kinds)], result["text"]), result["text"]


@pytest.fixture(scope="module")
def qwen3_5_gateway(qwen3_5_path: Path, nats: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker process serving qwen3_5_path as "tiny35" (detokenizing in-process, one thread) and an
    in-process gateway tokenizing for it itself, on the module's nats-server: `up`'s services without
    the separate tokenizer and detokenizer processes."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        worker = ServiceProcess.start(
            "worker",
            ["--nats-url", nats.url, "--metrics-port", "0", "--model-path", str(qwen3_5_path),
             "--served-model-name", "tiny35", "--worker-id", "w0", "--with-detokenizer", "--max-total-tokens", "2048"],
            tmp_path_factory.mktemp("qwen3_5_worker"),
        )
    gateway = None
    try:
        worker.wait_ready()
        gateway = GatewayThread(nats.url, local_tokenizer=str(qwen3_5_path), served_model_name="tiny35")
        wait_for_workers(gateway.url, 1, timeout=30)
        yield gateway.url
    finally:
        if gateway is not None:
            gateway.close()
        worker.kill()


def test_the_gateway_serves_openai_requests_with_the_engine_s_tokens(
    qwen3_5_path: Path, qwen3_5_gateway: str, engine_pool: EnginePool
) -> None:
    """A completion and a chat completion through the gateway (the openai client): the Engine's greedy
    text and token counts for the same prompt (the chat prompt through the checkpoint's template)."""
    messages = [{"role": "user", "content": "hello there"}]
    prompt = "The capital of France is"
    engine = engine_pool.get(qwen3_5_path)
    want_text = engine.generate(prompt, {**GREEDY, "max_new_tokens": 12})
    want_chat = engine.generate(engine.apply_chat_template(messages), {**GREEDY, "max_new_tokens": 12})
    client = openai.OpenAI(base_url=f"{qwen3_5_gateway}/v1", api_key="unused")
    done = client.completions.create(
        model="tiny35", prompt=prompt, temperature=0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].text == want_text["text"] and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens == want_text["meta_info"]["prompt_tokens"]
    chat = client.chat.completions.create(
        model="tiny35", messages=messages, temperature=0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.content == want_chat["text"]
    assert chat.usage.prompt_tokens == want_chat["meta_info"]["prompt_tokens"] and chat.usage.completion_tokens == 12
