"""RadixCache against a naive reference: a dict from every cached token prefix to the KV slot of its
last token. Random insert/match/lock/evict sequences over a tiny alphabet (so prefixes collide and
edges split), policy order per eviction policy, and the request glue driven like the scheduler."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from services.worker.mem.radix_cache import RadixCache, TreeNode
from tests.radix_cache_helpers import (
    INSERT_ABC,
    POLICIES,
    FakeReq,
    Locks,
    Prefix,
    RequestHarness,
    cached_len,
    free_slots,
    locked_prefixes,
    path_key,
    request,
)

keys = st.lists(st.integers(0, 2), max_size=8)


def make_cache(size: int = 64, policy: str = "lru", disable: bool = False) -> RadixCache:
    return RadixCache(ReqToTokenPool(8, 32, "cpu"), TokenToKVPoolAllocator(size, "cpu"), policy, disable)


def tree_contents(cache: RadixCache) -> dict[Prefix, int]:
    """Every cached prefix -> slot of its last token; checks the tree's structural invariants."""
    out: dict[Prefix, int] = {}
    stack: list[tuple[TreeNode, Prefix]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node and child.key and child.key[0] == first
            assert child.value.dtype == torch.int64 and child.value.numel() == len(child.key)
            assert child.lock_ref >= 0 and (node is cache.root or node.lock_ref >= child.lock_ref)
            path = prefix
            for token, slot in zip(child.key, child.value.tolist()):
                path = (*path, token)
                out[path] = slot
            stack.append((child, path))
    return out


def insert_fresh(cache: RadixCache, key: list[int], priority: int = 0) -> torch.Tensor:
    """Insert `key` with new slots the way a caller does: free its copies of the cached prefix."""
    slots = cache.token_to_kv_pool_allocator.alloc(len(key))
    assert slots is not None
    n = cache.insert(key, slots, priority)
    cache.token_to_kv_pool_allocator.free(slots[:n])
    return slots


def check_sizes(cache: RadixCache, ref: dict[Prefix, int], locked: Counter[Prefix]) -> None:
    assert tree_contents(cache) == ref
    assert cache.protected_size() == len(locked_prefixes(locked))
    assert cache.evictable_size() + cache.protected_size() == cache.total_size() == len(ref)
    size = cache.token_to_kv_pool_allocator.size
    assert sorted(free_slots(cache) + list(ref.values())) == list(range(1, size + 1))


ops = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["insert", "match", "lock"]), keys),
        st.tuples(st.just("unlock"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(0, 12)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(POLICIES), ops=ops)
def test_tree_matches_reference_under_insert_match_lock_evict(policy: str, ops: list[tuple]) -> None:
    cache = make_cache(size=400, policy=policy)
    ref: dict[Prefix, int] = {}
    locks = Locks()
    for op, arg in ops:
        if op == "insert":
            expected = cached_len(ref, arg)
            slots = cache.token_to_kv_pool_allocator.alloc(len(arg))
            assert slots is not None
            assert cache.insert(arg, slots) == expected
            cache.token_to_kv_pool_allocator.free(slots[:expected])
            for i in range(expected, len(arg)):
                ref[tuple(arg[: i + 1])] = int(slots[i])
        elif op in ("match", "lock"):
            n = cached_len(ref, arg)
            match = cache.match_prefix(arg)
            assert match.indices.tolist() == [ref[tuple(arg[: i + 1])] for i in range(n)]
            assert path_key(match.last_node) == arg[:n]
            if op == "lock":
                locks.lock(cache, match.last_node, tuple(arg[:n]))
        elif op == "unlock" and locks.held:
            locks.unlock(cache, arg)
        elif op == "evict":
            evictable = cache.evictable_size()
            freed = cache.evict(arg)
            assert min(arg, evictable) <= freed <= evictable
            assert freed >= arg or cache.evictable_size() == 0
            after = tree_contents(cache)
            assert after == {k: ref[k] for k in after}
            removed = ref.keys() - after.keys()
            assert len(removed) == freed
            assert removed.isdisjoint(locked_prefixes(locks.count))
            ref = after
        check_sizes(cache, ref, locks.count)


def test_match_ending_inside_an_edge_splits_it() -> None:
    cache = make_cache()
    slots = insert_fresh(cache, [1, 2, 3, 4])
    match = cache.match_prefix([1, 2, 9])
    assert match.indices.tolist() == slots[:2].tolist()
    assert match.last_node.key == [1, 2] and list(match.last_node.children) == [3]
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == slots.tolist()


def test_insert_returns_cached_prefix_and_keeps_first_slots() -> None:
    cache = make_cache()
    first = insert_fresh(cache, [5, 6, 7])
    second = insert_fresh(cache, [5, 6, 8, 9])
    assert cache.insert([5, 6, 7], torch.tensor([60, 61, 62])) == 3
    assert cache.match_prefix([5, 6, 7]).indices.tolist() == first.tolist()
    assert cache.match_prefix([5, 6, 8, 9]).indices.tolist() == first[:2].tolist() + second[2:].tolist()
    assert cache.total_size() == 5


def test_locked_path_survives_evicting_everything() -> None:
    cache = make_cache(size=8)
    slots = insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [7, 7])
    node = cache.match_prefix([1, 2]).last_node
    assert cache.inc_lock_ref(node) == -2
    assert (cache.evictable_size(), cache.protected_size()) == (4, 2)
    assert cache.evict(100) == 4
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == slots[:2].tolist()
    assert cache.token_to_kv_pool_allocator.available_size() == 6
    assert cache.dec_lock_ref(node) == 2
    assert cache.evict(1) == 2 and cache.total_size() == 0


def test_evict_cascades_to_parents_that_become_leaves() -> None:
    cache = make_cache(size=8)
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 2, 4])
    assert cache.evict(3) == 4
    assert cache.total_size() == cache.evictable_size() == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 8


def _evicted_first(policy: str, setup: list[tuple[str, list[int], int]]) -> list[int]:
    """Run insert/match steps on three two-token sequences, evict one of them, return which."""
    cache = make_cache(policy=policy)
    for op, key, priority in setup:
        if op == "insert":
            insert_fresh(cache, key, priority)
        else:
            cache.match_prefix(key)
    assert cache.evict(1) == 2
    gone = [key for key in ([1, 1], [2, 2], [3, 3]) if len(cache.match_prefix(key).indices) == 0]
    assert len(gone) == 1
    return gone[0]


@pytest.mark.parametrize(
    ("policy", "steps", "victim"),
    [
        ("lru", [("match", [1, 1], 0)], [2, 2]),
        ("lru", [("insert", [1, 1], 0)], [2, 2]),
        ("mru", [("match", [3, 3], 0), ("match", [1, 1], 0)], [1, 1]),
        ("fifo", [("match", [1, 1], 0), ("match", [2, 2], 0)], [1, 1]),
        ("filo", [("match", [3, 3], 0), ("match", [1, 1], 0)], [3, 3]),
        ("lfu", [("match", [3, 3], 0)] * 3 + [("match", [1, 1], 0)] * 2 + [("match", [2, 2], 0)], [2, 2]),
    ],
)
def test_policy_picks_its_victim(
    policy: str, steps: list[tuple[str, list[int], int]], victim: list[int]
) -> None:
    assert _evicted_first(policy, INSERT_ABC + steps) == victim


def test_priority_policy_evicts_lowest_priority_then_lru_among_equals() -> None:
    setup = [("insert", [1, 1], 5), ("insert", [2, 2], 1), ("insert", [3, 3], 3), ("match", [2, 2], 0)]
    assert _evicted_first("priority", setup) == [2, 2]
    equal = [("insert", [1, 1], 2), ("insert", [2, 2], 2), ("insert", [3, 3], 2), ("match", [1, 1], 0)]
    assert _evicted_first("priority", equal) == [2, 2]


def test_priority_of_a_shared_prefix_is_the_highest_inserter() -> None:
    cache = make_cache(policy="priority")
    insert_fresh(cache, [1, 2, 3], priority=1)
    insert_fresh(cache, [1, 2], priority=7)  # splits the edge: [1, 2] is shared by priorities 1 and 7
    insert_fresh(cache, [4, 4], priority=3)
    assert cache.evict(1) == 1  # [3], priority 1; [1, 2] becomes a leaf
    assert cache.evict(1) == 2
    assert len(cache.match_prefix([4, 4]).indices) == 0
    assert len(cache.match_prefix([1, 2]).indices) == 2


def test_unknown_eviction_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="eviction_policy"):
        make_cache(policy="random")


def test_bad_arguments_are_rejected() -> None:
    cache = make_cache()
    with pytest.raises(ValueError, match="value"):
        cache.insert([1, 2, 3], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="num_tokens"):
        cache.evict(-1)
    insert_fresh(cache, [1, 2])
    with pytest.raises(ValueError, match="lock_ref"):
        cache.dec_lock_ref(cache.match_prefix([1, 2]).last_node)


def test_disabled_cache_stores_nothing() -> None:
    cache = make_cache(disable=True)
    slots = torch.tensor([3, 4])
    assert cache.insert([1, 2], slots) == 0
    match = cache.match_prefix([1, 2])
    assert match.indices.numel() == 0 and match.last_node is cache.root
    assert cache.total_size() == cache.evict(10) == 0


def test_reset_drops_the_tree_and_leaves_freeing_to_the_allocator() -> None:
    cache = make_cache(size=8)
    insert_fresh(cache, [1, 2, 3])
    cache.inc_lock_ref(cache.match_prefix([1]).last_node)
    cache.reset()
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.match_prefix([1, 2, 3]).indices.numel() == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 5
    cache.token_to_kv_pool_allocator.clear()
    assert sorted(free_slots(cache)) == list(range(1, 9))


# Request glue, driven the way the scheduler drives it.


class Harness(RequestHarness):
    """RequestHarness over a RadixCache, admitting requests the way the scheduler does."""

    def __init__(self, size: int, policy: str = "lru", disable: bool = False) -> None:
        super().__init__(make_cache(size, policy, disable))

    def admit(self, input_ids: list[int], output: list[int], chunk: int = 64, priority: int = 0) -> FakeReq:
        match = self.cache.match_prefix(input_ids[:-1])  # the last prompt token is always computed
        self.cache.inc_lock_ref(match.last_node)
        rows = self.pool.alloc(1)
        assert rows is not None
        self.pool.write(rows[0], 0, match.indices)
        return FakeReq(
            rows[0], input_ids, match.indices, match.last_node, len(match.indices), output, chunk, priority
        )

    def check(self, running: list[FakeReq]) -> None:
        cache, owned = self.cache, []
        for req in running:
            slots = self.pool.read(req.req_pool_idx, 0, req.kv_committed_len).tolist()
            assert [self.kv[s] for s in slots] == [tuple(req.all_ids[: p + 1]) for p in range(len(slots))]
            num_prefix = len(req.prefix_indices)
            assert slots[:num_prefix] == req.prefix_indices.tolist()
            if cache.disable:
                owned += slots
            else:
                owned += slots[num_prefix:]
                assert cache.match_prefix(req.all_ids[:num_prefix]).indices.tolist() == slots[:num_prefix]
        contents = tree_contents(cache)
        assert all(self.kv[slot] == prefix for prefix, slot in contents.items())
        assert sorted(free_slots(cache) + list(contents.values()) + owned) == list(
            range(1, self.allocator.size + 1)
        )
        available = self.allocator.available_size()
        assert available + cache.evictable_size() + cache.protected_size() + len(owned) == self.allocator.size
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()

    def check_idle(self) -> None:
        self.check([])
        assert self.cache.protected_size() == 0
        assert self.pool.available_size() == self.pool.size


def _serve(harness: Harness, specs: list[tuple], data: st.DataObject) -> None:
    """Run every request to completion in a drawn interleaving, checking the pools after each step.
    Admission keeps the running requests' total tokens within the pool, as the scheduler's budget does."""
    waiting, running = list(specs), []
    while waiting or running:
        if data.draw(st.booleans(), label="evict first"):
            harness.cache.evict(data.draw(st.integers(0, 6), label="evict"))
        if harness.fits(running, waiting) and (not running or data.draw(st.booleans(), label="admit")):
            running.append(harness.admit(*waiting.pop(0)))
        else:
            harness.step_drawn(running, data)
        harness.check(running)
    harness.check_idle()


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(POLICIES), specs=st.lists(request, min_size=1, max_size=5), data=st.data())
def test_requests_share_prefixes_without_leaking_slots(
    policy: str, specs: list[tuple], data: st.DataObject
) -> None:
    totals = [len(i) + len(o) for i, o, _, _ in specs]
    size = data.draw(st.integers(max(totals), sum(totals)), label="pool size")
    _serve(Harness(size, policy), specs, data)


@settings(max_examples=50, deadline=None)
@given(specs=st.lists(request, min_size=1, max_size=4), data=st.data())
def test_disabled_cache_frees_every_slot_of_every_request(specs: list[tuple], data: st.DataObject) -> None:
    harness = Harness(sum(len(i) + len(o) for i, o, _, _ in specs), disable=True)
    _serve(harness, specs, data)
    assert harness.cache.total_size() == 0
    assert harness.allocator.available_size() == harness.allocator.size


def test_finished_duplicate_is_freed_and_first_copy_kept() -> None:
    harness = Harness(size=16)
    first = harness.admit([1, 2, 3, 4], [9])
    second = harness.admit([1, 2, 3, 4], [9])
    assert harness.step(first) and harness.step(second)
    assert harness.cache.total_size() == 4
    assert harness.allocator.available_size() == 12
    kept = harness.cache.match_prefix([1, 2, 3, 4]).indices.tolist()
    assert [harness.kv[s] for s in kept] == [(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)]
    harness.check_idle()


def test_unfinished_req_is_repointed_at_slots_cached_first_by_another() -> None:
    harness = Harness(size=32)
    slow = harness.admit([5, 6, 7, 8, 1, 2], [3], chunk=4)
    fast = harness.admit([5, 6, 7, 8, 4], [3])
    assert harness.step(fast)
    own = harness.pool.read(slow.req_pool_idx, 0, 4)
    assert not harness.step(slow)  # first chunk: its four slots duplicate what `fast` cached
    assert slow.prefix_indices.tolist() == harness.cache.match_prefix([5, 6, 7, 8]).indices.tolist()
    assert set(slow.prefix_indices.tolist()).isdisjoint(own.tolist())
    assert harness.pool.read(slow.req_pool_idx, 0, 4).tolist() == slow.prefix_indices.tolist()
    harness.check([slow])
    assert harness.step(slow)
    harness.check_idle()


def test_committed_slot_past_the_request_tokens_is_freed() -> None:
    harness = Harness(size=8)
    req = harness.admit([1, 2, 3], [])
    harness.compute_kv(req, 4)  # one slot more than the request has tokens: its token was dropped
    harness.cache.cache_finished_req(req)
    assert harness.cache.total_size() == 3
    assert harness.allocator.available_size() == 5
    harness.check_idle()


def test_finishing_a_req_without_a_pool_row_is_rejected() -> None:
    harness = Harness(size=8)
    req = harness.admit([1, 2], [3])
    req.req_pool_idx = None
    with pytest.raises(ValueError, match="req_pool_idx"):
        harness.cache.cache_finished_req(req)
