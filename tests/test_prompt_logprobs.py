"""Prompt log-probs (SGLang's `logprob_start_len`) from the offline Engine equal transformers'
log_softmax at each prompt position: alone, beside a request that asks for none, with chunked prefill,
and when a prefix of the prompt is already in the radix cache."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.worker.frontend.engine import Engine
from services.worker.runtime import model_runner
from tests.engine_helpers import GREEDY, hf_greedy, hf_model, random_prompts


def hf_log_softmax(path: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(str(path))(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_prompt_logprobs(meta: dict, prompt: list[int], start: int, ref: torch.Tensor, top: int = 0) -> None:
    """input_token_logprobs lists prompt tokens start .. n-1, the first without a log-prob, each other
    one with log P(token | its prefix) as transformers computes it."""
    entries = meta["input_token_logprobs"]
    assert [tid for _, tid, _ in entries] == prompt[start:]
    assert entries[0][0] is None
    for pos, (lp, tid, _) in enumerate(entries[1:], start=start):
        assert math.isclose(lp, ref[pos, tid].item(), rel_tol=1e-4, abs_tol=1e-4), (pos, lp, ref[pos, tid].item())
    if top:
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(entries) and tops[0] is None
        for pos, step in enumerate(tops[1:], start=start):
            assert [tid for _, tid, _ in step] == ref[pos].topk(top).indices.tolist()
            for lp, tid, _ in step:
                assert math.isclose(lp, ref[pos, tid].item(), rel_tol=1e-4, abs_tol=1e-4)
    else:
        assert "input_top_logprobs" not in meta


@pytest.mark.parametrize("start", [0, 5])
def test_prompt_logprobs_equal_transformers_beside_a_plain_request(qwen3_path: Path, start: int) -> None:
    prompt, other = random_prompts(2, 14, 20, seed=31)
    ref = hf_log_softmax(qwen3_path, prompt)
    params = {**GREEDY, "max_new_tokens": 4}
    with Engine(str(qwen3_path)) as engine:
        asked, plain = engine.generate(
            input_ids=[prompt, other], sampling_params=params, return_logprob=[True, False],
            top_logprobs_num=[3, 0], logprob_start_len=[start, None],
        )
    assert_prompt_logprobs(asked["meta_info"], prompt, start, ref, top=3)
    assert "input_token_logprobs" not in plain["meta_info"]
    assert asked["output_ids"] == hf_greedy(qwen3_path, prompt, 4)
    assert plain["output_ids"] == hf_greedy(qwen3_path, other, 4)


@pytest.mark.parametrize("chunk", [3, 7])
def test_prompt_logprobs_with_chunked_prefill(qwen3_path: Path, chunk: int) -> None:
    prompt = random_prompts(1, 23, 23, seed=32)[0]
    ref = hf_log_softmax(qwen3_path, prompt)
    with Engine(str(qwen3_path), chunked_prefill_size=chunk) as engine:
        out = engine.generate(
            input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3}, return_logprob=True,
            logprob_start_len=2,
        )
    assert_prompt_logprobs(out["meta_info"], prompt, 2, ref)
    assert out["output_ids"] == hf_greedy(qwen3_path, prompt, 3)


def test_prompt_logprobs_after_a_shared_prefix_is_cached(qwen3_path: Path) -> None:
    """The prefix is cached by a first request; a second with the same prefix and logprob_start_len 0
    gets every position's log-prob (the cache is not used past its start), one with start 16 uses
    the cached prefix up to there."""
    shared = random_prompts(1, 20, 20, seed=33)[0]
    first, second, third = random_prompts(3, 6, 6, seed=34, prefix=shared)
    params = {**GREEDY, "max_new_tokens": 2}
    with Engine(str(qwen3_path)) as engine:
        engine.generate(input_ids=first, sampling_params=params)
        whole = engine.generate(input_ids=second, sampling_params=params, return_logprob=True, logprob_start_len=0)
        tail = engine.generate(input_ids=third, sampling_params=params, return_logprob=True, logprob_start_len=16)
    assert whole["meta_info"]["cached_tokens"] == 0
    assert_prompt_logprobs(whole["meta_info"], second, 0, hf_log_softmax(qwen3_path, second))
    assert tail["meta_info"]["cached_tokens"] == 16
    assert_prompt_logprobs(tail["meta_info"], third, 16, hf_log_softmax(qwen3_path, third))


def test_max_new_tokens_zero_returns_only_the_prompt_logprobs(qwen3_path: Path) -> None:
    prompt = random_prompts(1, 9, 9, seed=35)[0]
    with Engine(str(qwen3_path)) as engine:
        out = engine.generate(
            input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 0}, return_logprob=True,
            logprob_start_len=0,
        )
        with pytest.raises(ValueError, match="logprob_start_len"):
            engine.generate(input_ids=prompt, return_logprob=True, logprob_start_len=len(prompt))
        with pytest.raises(ValueError, match="logprob_start_len"):
            engine.generate(input_ids=prompt, return_logprob=True, logprob_start_len=-2)
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "matched": 0}
    assert_prompt_logprobs(out["meta_info"], prompt, 0, hf_log_softmax(qwen3_path, prompt))


def test_prompt_logprobs_beside_running_decodes_with_overlap_and_mixed_chunks(qwen3_path: Path) -> None:
    """A request asking for prompt log-probs arrives while another decodes: with the overlap schedule and
    mixed steps (its chunks ride beside the decode), its log-probs and both answers stay exact."""
    long_run, prompt = random_prompts(2, 18, 18, seed=36)
    ref = hf_log_softmax(qwen3_path, prompt)
    with Engine(str(qwen3_path), disable_overlap_schedule=False, enable_mixed_chunk=True, chunked_prefill_size=5) as engine:
        running = engine.generate(input_ids=long_run, sampling_params={**GREEDY, "max_new_tokens": 160}, stream=True)
        first = next(running)
        out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3}, return_logprob=True,
                              top_logprobs_num=2, logprob_start_len=1)
        rest = [chunk["output_ids"] for chunk in running]
    assert_prompt_logprobs(out["meta_info"], prompt, 1, ref, top=2)
    assert out["output_ids"] == hf_greedy(qwen3_path, prompt, 3)
    assert first["output_ids"] + [t for ids in rest for t in ids] == hf_greedy(qwen3_path, long_run, 160)


def test_prompt_logprobs_in_row_blocks_equal_one_log_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long chunk's rows go through log-softmax a block at a time: the same values and top lists."""
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 3)
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(37))
    targets = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(38)).tolist()
    values, top = model_runner.prompt_logprobs(logits, targets, 2)
    ref = torch.log_softmax(logits, dim=-1)
    assert values == pytest.approx(ref[torch.arange(8), torch.tensor(targets)].tolist(), abs=1e-6)
    assert top is not None and [[tid for tid, _ in row] for row in top] == ref.topk(2).indices.tolist()
    assert model_runner.prompt_logprobs(logits, targets, 0) == (values, None)
