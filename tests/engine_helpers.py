"""Shared helpers for engine and scheduler tests: HF greedy references, prompt builders and a Scheduler
built in the test's own thread."""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from tests.checkpoints import VOCAB_SIZE

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def scheduler_here(config: Any) -> Any:
    """A rank-0 Scheduler built in the calling thread (the test's), with cpu_bind 'none': under 'auto' the
    loop pins the thread that builds it to one core, and here that thread is pytest's, so every later test
    of the worker process, and every thread it starts, would inherit the one-core mask
    (tests/test_cpu_threads.py's two-core tests failed in a CI run that way)."""
    from services.worker.frontend.scheduler_loop import SchedulerLoop

    return SchedulerLoop(config.replace(cpu_bind="none"), rank=0, init_method="tcp://127.0.0.1:0").scheduler


@lru_cache(maxsize=8)
def hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path | str, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation (no early stop). Cached for the session: several tests
    compare against the same continuation."""
    return list(_hf_greedy(str(path), tuple(prompt), n))


@lru_cache(maxsize=256)
def _hf_greedy(path: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(path).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return tuple(out[0, len(prompt) :].tolist())


def random_prompts(
    count: int, low: int, high: int, seed: int = 0, prefix: list[int] | None = None
) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        (prefix or []) + [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(low, high))]
        for _ in range(count)
    ]


def greedy_and_seeded(count: int, new_tokens: int = 16) -> list[dict[str, object]]:
    """Sampling params of deterministic-inference tests: even requests greedy, odd ones sampled with a
    seed each; lengths vary (new_tokens + 3 * (i % 5)) so a batch shrinks as its requests end."""
    params: list[dict[str, object]] = []
    for i in range(count):
        sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i} if i % 2 else {"temperature": 0.0}
        params.append({**sampled, "ignore_eos": True, "max_new_tokens": new_tokens + 3 * (i % 5)})
    return params


def output_ids(results: list[dict]) -> list[list[int]]:
    return [r["output_ids"] for r in results]


class EnginePool:
    """Engines shared by a module's tests, one per (model, options); `get` empties the engine's prefix
    cache first, so each test starts from what a fresh Engine holds, without paying another start."""

    def __init__(self) -> None:
        self._engines: dict[tuple[str, tuple[tuple[str, object], ...]], Any] = {}

    def get(self, path: Path | str, **kwargs: object) -> Any:  # an Engine
        from services.worker.frontend.engine import Engine

        key = (str(path), tuple(sorted(kwargs.items())))
        engine = self._engines.get(key)
        if engine is None:
            engine = self._engines[key] = Engine(str(path), **kwargs)
        else:
            assert engine.flush_cache(), "a shared Engine still has requests in flight"
        return engine

    def close(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()
        self._engines.clear()
