"""The gateway's worker registry (services/gateway/router.py): liveness from WorkerLoad reports,
least-loaded choice, and forgetting dead workers. Pure logic, explicit clocks."""

from __future__ import annotations

import asyncio

from services.gateway.router import WorkerRegistry, model_matches
from shared.protocol import PROTOCOL_VERSION, WorkerLoad


def load(worker_id: str, running: int = 0, waiting: int = 0, model: str = "m", kv: float = 0.0) -> WorkerLoad:
    return WorkerLoad(
        v=PROTOCOL_VERSION, worker_id=worker_id, model=model, num_running=running, num_waiting=waiting,
        kv_usage=kv, cache_hit_rate=0.0, max_total_tokens=100, context_len=50, timestamp=0.0,
    )


def test_only_workers_heard_within_the_ttl_are_live() -> None:
    registry = WorkerRegistry(ttl_s=3.0, dead_s=5.0)
    registry.observe(load("old"), now=0.0)
    registry.observe(load("new"), now=2.0)
    assert [w.load.worker_id for w in registry.live(now=4.0)] == ["new"]
    assert registry.choose(now=4.0).load.worker_id == "new"
    assert registry.choose(now=10.0) is None


def test_choice_is_the_least_loaded_then_lowest_kv_usage() -> None:
    registry = WorkerRegistry(ttl_s=3.0, dead_s=5.0)
    registry.observe(load("a", running=3), now=0.0)
    registry.observe(load("b", running=1, waiting=1, kv=0.5), now=0.0)
    registry.observe(load("c", running=2, kv=0.1), now=0.0)
    assert registry.choose(now=0.0).load.worker_id == "c"


def test_a_burst_between_reports_spreads_over_workers() -> None:
    registry = WorkerRegistry(ttl_s=3.0, dead_s=5.0)
    registry.observe(load("a"), now=0.0)
    registry.observe(load("b"), now=0.0)
    chosen = [registry.choose(now=0.1).load.worker_id for _ in range(6)]
    assert sorted(chosen) == ["a", "a", "a", "b", "b", "b"]
    registry.observe(load("a", running=3), now=1.0)  # a report resets what was sent since the last one
    assert registry.get("a").sent_since_report == 0


def test_this_gateways_requests_count_when_a_report_predates_them() -> None:
    registry = WorkerRegistry(ttl_s=3.0, dead_s=5.0)
    registry.observe(load("a"), now=0.0)
    registry.observe(load("b", running=1), now=0.0)
    assert registry.choose(in_flight_here={"a": 2}, now=0.0).load.worker_id == "b"


def test_model_filter_matches_full_or_short_names() -> None:
    registry = WorkerRegistry(ttl_s=3.0, dead_s=5.0)
    registry.observe(load("a", model="/models/SmolLM2"), now=0.0)
    registry.observe(load("b", model="qwen3"), now=0.0)
    assert registry.choose("SmolLM2", now=0.0).load.worker_id == "a"
    assert registry.choose("llama", now=0.0) is None
    assert registry.models(now=0.0) == ["/models/SmolLM2", "qwen3"]
    assert model_matches("/models/SmolLM2", "/models/SmolLM2") and not model_matches("Smol", "/models/SmolLM2")


def test_silent_workers_are_pruned_as_dead_after_dead_s() -> None:
    registry = WorkerRegistry(ttl_s=3.0, dead_s=5.0)
    registry.observe(load("a"), now=0.0)
    registry.observe(load("b"), now=4.0)
    assert registry.prune_dead(now=4.0) == []
    assert registry.prune_dead(now=6.0) == ["a"]
    assert registry.get("a") is None and registry.get("b") is not None


def test_waiting_for_a_worker_ends_when_one_reports_or_times_out() -> None:
    async def scenario() -> tuple[bool, bool]:
        registry = WorkerRegistry(ttl_s=3.0, dead_s=5.0)
        timed_out = await registry.wait_for_worker(0.05)
        asyncio.get_running_loop().call_later(0.05, registry.observe, load("a"))
        arrived = await registry.wait_for_worker(5.0)
        return timed_out, arrived

    assert asyncio.run(scenario()) == (False, True)
