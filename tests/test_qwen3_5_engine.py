"""Qwen3.5 hybrid models through the offline Engine and the scheduler: greedy tokens match
transformers; chunked prefill, batching, mixed steps, overlap and retraction give the same tokens; the
state pool's accounting is exact after every step of a workload with aborts and retraction; TP=2
matches TP=1; speculative decoding is refused at start."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.worker.config import EngineConfig
from services.worker.frontend.engine import Engine
from services.worker.mem.state_pool import MAX_STATE_SHARE
from services.worker.runtime import model_runner
from services.worker.runtime.model_config import ModelConfig
from services.worker.scheduler.req import Req
from shared.sampling_params import SamplingParams
from tests.engine_helpers import (
    GREEDY,
    EnginePool,
    hf_greedy,
    hf_model,
    output_ids,
    random_prompts,
    scheduler_here,
)

# The transformers references run single-threaded (tests/conftest.py's one_thread says why).
pytestmark = pytest.mark.usefixtures("one_thread")


def generate_ids(
    pool: EnginePool, path: Path, prompts: list[list[int]], n: int = 16, **engine_kwargs: object
) -> list[list[int]]:
    """Greedy tokens from the module's Engine for (path, engine_kwargs), its prefix cache emptied first."""
    engine = pool.get(path, **engine_kwargs)
    return output_ids(engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": n}))


@pytest.mark.parametrize("name", ["qwen3_5_path", "qwen3_5_moe_path"])
def test_greedy_matches_transformers_for_32_steps(
    name: str, request: pytest.FixtureRequest, engine_pool: EnginePool
) -> None:
    path = request.getfixturevalue(name)
    prompts = random_prompts(3, 5, 30, seed=1)
    for prompt, got in zip(prompts, generate_ids(engine_pool, path, prompts, n=32)):
        assert got == hf_greedy(path, prompt, 32)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_unchunked(qwen3_5_path: Path, chunk: int, engine_pool: EnginePool) -> None:
    prompts = random_prompts(4, 10, 80, seed=2)
    assert generate_ids(engine_pool, qwen3_5_path, prompts, chunked_prefill_size=chunk) == generate_ids(
        engine_pool, qwen3_5_path, prompts, chunked_prefill_size=None
    )


def test_request_batched_with_15_others_matches_alone(qwen3_5_moe_path: Path, engine_pool: EnginePool) -> None:
    prompts = random_prompts(16, 3, 40, seed=3)
    batched = generate_ids(engine_pool, qwen3_5_moe_path, prompts, n=20)
    alone = generate_ids(engine_pool, qwen3_5_moe_path, prompts[7:8], n=20)
    assert batched[7] == alone[0]


def test_mixed_chunks_and_overlap_give_the_same_tokens(qwen3_5_tied_path: Path, engine_pool: EnginePool) -> None:
    prompts = random_prompts(6, 5, 40, seed=4)
    plain = generate_ids(engine_pool, qwen3_5_tied_path, prompts, disable_overlap_schedule=True)
    mixed = generate_ids(
        engine_pool,
        qwen3_5_tied_path, prompts, enable_mixed_chunk=True, chunked_prefill_size=16, disable_overlap_schedule=False
    )
    assert mixed == plain


def test_repeated_prompts_and_n_copies_give_transformers_tokens_and_hit_the_prefix_cache(
    qwen3_5_path: Path, engine_pool: EnginePool
) -> None:
    """The same prompt three times, then n=2 copies of it: every answer is transformers' greedy one, and
    from the second request on each resumes one token short of the prompt (the first one's prefill saved
    the state there), as the engine reports in cached_tokens."""
    prompt = random_prompts(1, 20, 20, seed=6)[0]
    params = {**GREEDY, "max_new_tokens": 8}
    engine = engine_pool.get(qwen3_5_path)  # its prefix cache empty
    runs = [engine.generate(input_ids=prompt, sampling_params=params) for _ in range(3)]
    pair = engine.generate(input_ids=prompt, sampling_params={**params, "n": 2})
    assert [r["meta_info"]["cached_tokens"] for r in runs] == [0, len(prompt) - 1, len(prompt) - 1]
    assert all(p["meta_info"]["cached_tokens"] == len(prompt) - 1 for p in pair)
    assert [r["output_ids"] for r in runs] == [hf_greedy(qwen3_5_path, prompt, 8)] * 3
    assert [p["output_ids"] for p in pair] == [runs[0]["output_ids"]] * 2


def hf_argmax_tokens(path: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation with EOS an ordinary token (hf_greedy bans it until the n-th
    token, as min_new_tokens does; a request with ignore_eos only does not stop at it)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(str(path)).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_prompt_and_output_logprobs_equal_transformers_with_chunked_prefill(qwen3_5_path: Path) -> None:
    """Log-probs of every prompt token (over three prefill chunks carrying the state) and of each
    output token are transformers' log-softmax."""
    prompt = random_prompts(1, 20, 20, seed=9)[0]
    with Engine(str(qwen3_5_path), chunked_prefill_size=7) as engine:
        out = engine.generate(
            input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 5}, return_logprob=True, logprob_start_len=0
        )
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(str(qwen3_5_path))(ids).logits[0].float(), dim=-1)
    meta = out["meta_info"]
    assert [tid for _, tid, _ in meta["input_token_logprobs"]] == prompt
    scored = [(pos, lp, tid) for pos, (lp, tid, _) in enumerate(meta["input_token_logprobs"][1:])]
    scored += [(len(prompt) - 1 + step, lp, tid) for step, (lp, tid, _) in enumerate(meta["output_token_logprobs"])]
    assert len(scored) == len(prompt) - 1 + 5
    for pos, lp, tid in scored:
        assert math.isclose(lp, ref[pos, tid].item(), rel_tol=1e-4, abs_tol=1e-4), (pos, lp, ref[pos, tid].item())


def make_scheduler(path: Path, **kwargs: object):  # noqa: ANN201 - a Scheduler
    config = EngineConfig.from_kwargs(str(path), **kwargs)
    return scheduler_here(config)


@pytest.mark.parametrize("options", [{}, {"enable_mixed_chunk": True, "disable_overlap_schedule": False}], ids=str)
def test_state_pool_invariant_after_every_step_with_aborts_and_retraction(
    qwen3_5_moe_path: Path, options: dict
) -> None:
    """free state rows + rows of live requests == all rows after every step; (greedy) requests that were
    not aborted still produce transformers' tokens (retracted ones restart from a zeroed state)."""
    scheduler = make_scheduler(qwen3_5_moe_path, max_total_tokens=120, max_running_requests=16, **options)
    pool = scheduler.runner.state_pool
    assert pool is not None and pool.size == 16
    submitted: dict[str, Req] = {}
    for i, prompt in enumerate(random_prompts(12, 10, 20, seed=5)):  # all at once: the pool fills up
        params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
        params.normalize()
        submitted[f"r{i}"] = Req(f"r{i}", prompt, params, seed=i)
        scheduler.add_request(submitted[f"r{i}"])
    aborts = {3: "r3", 40: "r8", 41: "r9"}  # a request prefilling, and two decoding
    steps = 0
    while scheduler.has_work():
        if steps in aborts:
            scheduler.abort_request(aborts[steps])
        scheduler.step()
        scheduler.check_pool_invariant()
        steps += 1
        assert steps < 3000, "the workload did not drain"
    assert pool.available_size() == pool.size
    assert {r.rid for r in submitted.values() if r.finished_reason.type == "abort"} == set(aborts.values())
    assert scheduler.stats.num_retractions > 0
    greedy = [r for r in submitted.values() if r.finished_reason.type != "abort"]
    assert any(r.num_retractions for r in greedy), "no greedy request was retracted: the check would be void"
    for req in greedy:
        assert req.output_ids == hf_argmax_tokens(qwen3_5_moe_path, req.origin_input_ids, len(req.output_ids))


def test_state_pool_comes_out_of_the_memory_budget_first(
    qwen3_5_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ModelConfig.from_path(qwen3_5_path)
    shape = config.state_shape()
    assert shape.num_layers == 2 and shape.bytes_per_row() == 2 * (96 * 3 * 4 + 4 * 16 * 8 * 4)  # conv 2*2*16 + 4*8 channels
    budget = 20 * shape.bytes_per_row()
    monkeypatch.setattr(model_runner, "_available_ram_bytes", lambda: int(budget / model_runner.CPU_MEM_SHARE))
    # Without the prefix cache there are no state snapshots (their share: tests/test_qwen3_5_prefix_cache.py).
    scheduler = make_scheduler(qwen3_5_path, max_running_requests=64, disable_radix_cache=True)
    runner = scheduler.runner
    rows = int(budget * MAX_STATE_SHARE) // shape.bytes_per_row() - 1  # one more row is the padding row
    assert runner.state_pool.size == runner.req_to_token_pool.size == rows == 9
    kv_bytes = runner.token_to_kv_pool.bytes_per_token(2, 2, 16, torch.float32)  # two attention layers' KV
    assert runner.max_total_tokens == (budget - (rows + 1) * shape.bytes_per_row()) // kv_bytes
    assert len(runner.token_to_kv_pool.k_buffer) == 2


def test_tensor_parallel_2_matches_1(qwen3_5_moe_path: Path, engine_pool: EnginePool) -> None:
    """Linear-attention heads, conv channels and states split over two gloo ranks, beside the gated
    attention, routed experts and shared expert: the same greedy tokens as one rank, also for a prompt
    sent again, which resumes from the state each rank saved one token short of its end."""
    prompts = random_prompts(4, 5, 25, seed=8)
    assert generate_ids(engine_pool, qwen3_5_moe_path, prompts, tp_size=2) == generate_ids(
        engine_pool, qwen3_5_moe_path, prompts
    )
    engine = engine_pool.get(qwen3_5_moe_path, tp_size=2)
    params = {**GREEDY, "max_new_tokens": 8}
    first, again = (engine.generate(input_ids=prompts[0], sampling_params=params) for _ in range(2))
    assert again["meta_info"]["cached_tokens"] == len(prompts[0]) - 1
    assert again["output_ids"] == first["output_ids"] == generate_ids(engine_pool, qwen3_5_moe_path, prompts[:1], n=8)[0]


def test_speculative_decoding_is_refused_at_start(qwen3_5_moe_path: Path, qwen3_path: Path) -> None:
    with pytest.raises(ValueError, match="speculative decoding is not supported for Qwen3_5MoeForCausalLM"):
        EngineConfig.from_kwargs(str(qwen3_5_moe_path), speculative_algorithm="ngram")
    with pytest.raises(ValueError, match="is a hybrid model .* which cannot draft"):
        EngineConfig.from_kwargs(
            str(qwen3_path), speculative_algorithm="draft", speculative_draft_model_path=str(qwen3_5_moe_path)
        )
