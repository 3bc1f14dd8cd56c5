"""Qwen3, Qwen3-MoE and Llama on the torch attention backend match HF transformers (float32, CPU):
prefill logits at every position, 32 greedy decode steps, batched requests and cached-prefix extends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.forward_helpers import (
    BatchDriver,
    assert_rows_close,
    check_greedy_decode,
    hf_logits,
    seeded_prompt,
)

ARCHITECTURES = ["qwen3_path", "qwen3_moe_path", "llama_path"]
DECODE_STEPS = 32


@pytest.fixture(scope="module", params=ARCHITECTURES)
def models(request: pytest.FixtureRequest) -> tuple[ModelConfig, torch.nn.Module, PreTrainedModel]:
    path: Path = request.getfixturevalue(request.param)
    config = ModelConfig.from_path(path, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return config, load_model(config, "cpu"), hf


def test_prefill_logits_match_hf_at_every_position(models) -> None:
    config, model, hf = models
    prompt = seeded_prompt(20, seed=1)
    driver = BatchDriver(model, config)
    logits = driver.extend([(driver.new_request(), prompt)], return_all_logits=True)
    assert logits.dtype == torch.float32
    assert_rows_close(logits, hf_logits(hf, prompt))


def test_greedy_decode_matches_hf_generate(models) -> None:
    config, model, hf = models
    check_greedy_decode(config, model, hf, seeded_prompt(20, seed=2), DECODE_STEPS)


def test_batched_requests_match_each_request_alone(models) -> None:
    config, model, hf = models
    long_prompt, short_prompt = seeded_prompt(20, seed=3), seeded_prompt(11, seed=4)
    driver = BatchDriver(model, config)
    rows = driver.new_request(), driver.new_request()
    last = driver.extend([(rows[0], long_prompt), (rows[1], short_prompt)])
    assert last.shape == (2, config.vocab_size)
    assert_rows_close(last[0:1], hf_logits(hf, long_prompt)[-1:])
    assert_rows_close(last[1:2], hf_logits(hf, short_prompt)[-1:])

    next_tokens = last.argmax(dim=-1).tolist()
    step = driver.decode([(rows[0], next_tokens[0]), (rows[1], next_tokens[1])])
    assert_rows_close(step[0:1], hf_logits(hf, long_prompt + next_tokens[:1])[-1:])
    assert_rows_close(step[1:2], hf_logits(hf, short_prompt + next_tokens[1:])[-1:])


def test_batched_extend_returns_all_logits_in_token_order(models) -> None:
    config, model, hf = models
    first, second = seeded_prompt(9, seed=5), seeded_prompt(14, seed=6)
    driver = BatchDriver(model, config)
    logits = driver.extend(
        [(driver.new_request(), first), (driver.new_request(), second)], return_all_logits=True
    )
    assert_rows_close(logits, torch.cat([hf_logits(hf, first), hf_logits(hf, second)]))


def test_extend_after_cached_prefix_matches_one_shot_prefill(models) -> None:
    config, model, _ = models
    prompt = seeded_prompt(20, seed=7)
    one_shot = BatchDriver(model, config)
    whole = one_shot.extend([(one_shot.new_request(), prompt)], return_all_logits=True)

    chunked = BatchDriver(model, config)
    row = chunked.new_request()
    head = chunked.extend([(row, prompt[:8])], return_all_logits=True)
    tail = chunked.extend([(row, prompt[8:])], return_all_logits=True)
    assert_rows_close(torch.cat([head, tail]), whole)


def test_extend_mixes_cached_and_fresh_requests(models) -> None:
    config, model, hf = models
    cached_prompt, fresh_prompt = seeded_prompt(20, seed=8), seeded_prompt(6, seed=9)
    driver = BatchDriver(model, config)
    cached_row = driver.new_request()
    driver.extend([(cached_row, cached_prompt[:8])])
    fresh_row = driver.new_request()
    logits = driver.extend(
        [(cached_row, cached_prompt[8:]), (fresh_row, fresh_prompt)], return_all_logits=True
    )
    assert_rows_close(logits, torch.cat([hf_logits(hf, cached_prompt)[8:], hf_logits(hf, fresh_prompt)]))


def test_single_request_decode_with_consecutive_or_scattered_slots_matches_hf(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone request whose keys sit in consecutive KV slots is read through a view of the pool; one
    whose slots are scattered (another request took the slots between) is gathered. Both give HF's
    logits."""
    from services.worker.runtime.attention import torch_backend

    config, model, hf = models
    seen: list[int | None] = []
    build = torch_backend._decode_metadata
    monkeypatch.setattr(torch_backend, "_decode_metadata", lambda batch: seen.append(build(batch).first_slot) or build(batch))
    driver = BatchDriver(model, config)
    a, b = driver.new_request(), driver.new_request()
    prompt = seeded_prompt(12, seed=9)
    token = int(driver.extend([(a, prompt)])[-1].argmax())
    step = driver.decode([(a, token)])  # slots 1..13: consecutive
    assert seen == [1]
    assert_rows_close(step, hf_logits(hf, prompt + [token])[-1:])
    driver.extend([(b, seeded_prompt(5, seed=10))])  # takes slots 14..18
    second = int(step[0].argmax())
    step = driver.decode([(a, second)])  # slot 19 follows 1..13: scattered
    assert seen[-1] is None
    assert_rows_close(step, hf_logits(hf, prompt + [token, second])[-1:])
