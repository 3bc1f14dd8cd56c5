"""--enable-deterministic-inference through the offline Engine on the CPU: 16 requests give the same
tokens, greedy and sampled with a seed, whether each runs alone, all 16 run batched, or their prompts
are prefilled in chunks of 7 or 64 tokens, in float32 and in bfloat16. Without the flag the bfloat16 runs
differ: 3 of the 16 requests batched or chunked gave other tokens than alone where this was written (the
products and attention then sum in orders that depend on the batch); float32 happened to agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.config import EngineConfig
from services.worker.frontend.engine import Engine
from tests.engine_helpers import greedy_and_seeded, output_ids, random_prompts

PROMPTS = random_prompts(16, 5, 90, seed=26)


def _params() -> list[dict[str, object]]:
    return greedy_and_seeded(len(PROMPTS))


def _generate(
    path: Path, dtype: str, alone: bool, deterministic: bool = True, **kwargs: object
) -> list[list[int]]:
    with Engine(str(path), dtype=dtype, enable_deterministic_inference=deterministic, **kwargs) as engine:
        if alone:
            return [
                output_ids([engine.generate(input_ids=prompt, sampling_params=p)])[0]
                for prompt, p in zip(PROMPTS, _params())
            ]
        return output_ids(engine.generate(input_ids=PROMPTS, sampling_params=_params()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tokens_are_the_same_alone_batched_and_chunked(qwen3_path: Path, dtype: str) -> None:
    alone = _generate(qwen3_path, dtype, alone=True, chunked_prefill_size=None)
    assert [len(ids) for ids in alone] == [p["max_new_tokens"] for p in _params()]
    assert _generate(qwen3_path, dtype, alone=False, chunked_prefill_size=None) == alone
    for chunk in (7, 64):
        assert _generate(qwen3_path, dtype, alone=False, chunked_prefill_size=chunk) == alone, (
            f"chunk {chunk}"
        )


def test_moe_tokens_are_the_same_alone_and_batched(qwen3_moe_path: Path) -> None:
    alone = _generate(qwen3_moe_path, "float32", alone=True)
    assert _generate(qwen3_moe_path, "float32", alone=False, chunked_prefill_size=7) == alone


def test_deterministic_inference_refuses_what_it_cannot_keep(qwen3_path: Path, qwen3_5_path: Path) -> None:
    with pytest.raises(ValueError, match="needs tp_size 1"):
        EngineConfig(model_path=str(qwen3_path), tp_size=2, enable_deterministic_inference=True)
    with pytest.raises(ValueError, match="not flashinfer"):
        EngineConfig(
            model_path=str(qwen3_path), attention_backend="flashinfer", enable_deterministic_inference=True
        )
    with pytest.raises(ValueError, match="hybrid"):
        EngineConfig(model_path=str(qwen3_5_path), enable_deterministic_inference=True)
    with pytest.raises(ValueError, match="FP8 weights"):
        EngineConfig(model_path=str(qwen3_path), quantization="fp8", enable_deterministic_inference=True)
    with pytest.raises(ValueError, match="kv_cache_dtype 'auto'"):
        EngineConfig(
            model_path=str(qwen3_path), kv_cache_dtype="fp8_e4m3", enable_deterministic_inference=True
        )
