"""The gateway's worker registry (services/gateway/router.py): liveness from WorkerLoad reports,
least-loaded and cache-aware choice, and forgetting dead workers; the prefix index against a naive
longest-common-prefix. Pure logic, explicit clocks."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.prefix_index import PrefixIndex, routing_key
from services.gateway.router import WorkerRegistry, model_matches
from shared.protocol import PROTOCOL_VERSION, ChatMessage, WorkerLoad


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


# ---- cache-aware routing -------------------------------------------------------------------------


def cache_aware(**kw: float) -> WorkerRegistry:
    registry = WorkerRegistry(ttl_s=3.0, dead_s=5.0, policy="cache_aware", **kw)
    registry.observe(load("a"), now=0.0)
    registry.observe(load("b"), now=0.0)
    return registry


def test_a_repeated_prompt_goes_back_to_the_worker_that_has_it_cached() -> None:
    registry = cache_aware()
    system = b"You are a helpful assistant. " * 20
    first = registry.choose(now=0.1, key=system + b"question one").load.worker_id
    # The least-loaded rule alone would now pick the other worker (the first has one request more).
    assert registry.choose(now=0.1).load.worker_id != first
    registry.observe(load("a"), now=0.2)
    registry.observe(load("b"), now=0.2)
    assert registry.choose(now=0.3, key=system + b"question two").load.worker_id == first
    assert registry.choose(now=0.3, key=system + b"question three").load.worker_id == first


def test_a_prompt_nobody_has_seen_goes_to_the_least_loaded() -> None:
    registry = cache_aware()
    registry.observe(load("a", running=2), now=0.0)
    assert registry.choose(now=0.1, key=b"x" * 500).load.worker_id == "b"
    # A short shared prefix (under cache_threshold of the prompt) does not pull a request.
    registry.observe(load("b", running=5), now=0.2)
    assert registry.choose(now=0.3, key=b"x" * 100 + b"y" * 900).load.worker_id == "a"


def test_imbalanced_queues_override_the_cache() -> None:
    registry = cache_aware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    key = b"shared prompt " * 40
    first = registry.choose(now=0.1, key=key).load.worker_id
    other = "b" if first == "a" else "a"
    registry.observe(load(first, running=4), now=0.2)
    registry.observe(load(other, running=1), now=0.2)
    assert registry.choose(now=0.3, key=key).load.worker_id == first  # 4 - 1 is not above 4
    registry.observe(load(first, running=10), now=0.4)
    registry.observe(load(other, running=1), now=0.4)
    assert registry.choose(now=0.5, key=key).load.worker_id == other


def test_a_dead_worker_takes_its_prefixes_with_it() -> None:
    registry = cache_aware()
    key = b"p" * 160
    first = registry.choose(now=0.1, key=key).load.worker_id
    assert registry.prefixes.size(first) == 10
    registry.observe(load("b" if first == "a" else "a"), now=4.0)
    assert registry.prune_dead(now=6.0) == [first]
    assert registry.prefixes.size(first) == 0


def test_least_loaded_policy_ignores_prefixes() -> None:
    registry = WorkerRegistry(ttl_s=3.0, dead_s=5.0, policy="least_loaded")
    registry.observe(load("a"), now=0.0)
    registry.observe(load("b"), now=0.0)
    key = b"k" * 1000
    assert [registry.choose(now=0.1, key=key).load.worker_id for _ in range(4)] == ["a", "b", "a", "b"]


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="routing policy must be one of"):
        WorkerRegistry(ttl_s=3.0, dead_s=5.0, policy="round_robin")


@settings(max_examples=200, deadline=None)
@given(
    stored=st.lists(st.binary(min_size=0, max_size=300), max_size=6),
    query=st.binary(min_size=0, max_size=300),
    block=st.integers(min_value=1, max_value=16),
)
def test_prefix_index_matches_a_naive_longest_common_prefix(stored: list[bytes], query: bytes, block: int) -> None:
    index = PrefixIndex(block_bytes=block)
    for key in stored:
        index.record("w", key)

    def common(a: bytes, b: bytes) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    # Only whole blocks count: the naive answer is the longest common prefix with any stored key,
    # rounded down to whole blocks of both.
    expected = max(
        [(min(common(query, key), len(key), len(query)) // block) * block for key in stored], default=0
    )
    assert index.matched_bytes(query, ["w", "nobody"]) == {"w": expected, "nobody": 0}


def test_routing_keys_share_a_prefix_exactly_when_prompts_do() -> None:
    one = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
    two = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="bye")]
    k1, k2 = routing_key(None, one, None), routing_key(None, two, None)
    assert k1[: len(k1) - 3] == k2[: len(k1) - 3] and k1 != k2
    # A role change is not a content change that happens to share bytes.
    as_user = routing_key(None, [ChatMessage(role="user", content="be brief")], None)
    as_system = routing_key(None, [ChatMessage(role="system", content="be brief")], None)
    assert not as_system.startswith(as_user[:5])
    assert routing_key(None, None, [1, 2, 3]) == routing_key(None, None, [1, 2, 3, 4])[:12]
    assert routing_key("héllo", None, None) == "héllo".encode()
