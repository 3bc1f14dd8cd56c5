"""Shared helpers for engine and scheduler tests: HF greedy references and prompt builders."""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.checkpoints import VOCAB_SIZE

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@lru_cache(maxsize=8)
def hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path | str, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation (no early stop)."""
    model = hf_model(str(path))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(count: int, low: int, high: int, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        (prefix or []) + [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(low, high))]
        for _ in range(count)
    ]


def output_ids(results: list[dict]) -> list[list[int]]:
    return [r["output_ids"] for r in results]
