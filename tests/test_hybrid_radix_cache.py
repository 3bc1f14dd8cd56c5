"""HybridRadixCache against a naive reference: a dict from every cached token prefix to its KV slot,
and the set of prefixes that hold a state snapshot (whose state must be exactly that prefix's tokens).
Random insert/match/lock/unlock/evict sequences per eviction policy, with few snapshot slots, and
targeted cases: splits, matches, snapshot eviction, no free slot, eviction order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.mem.hybrid_radix_cache import SnapshotSlots
from tests.hybrid_cache_helpers import check_pools, contents, insert_fresh, make_cache, snapshot_len
from tests.radix_cache_helpers import (
    INSERT_ABC,
    POLICIES,
    FakeReq,
    Locks,
    Prefix,
    cached_len,
    locked_prefixes,
    path_key,
)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 2), max_size=7), st.booleans()),
        st.tuples(st.sampled_from(["match", "lock"]), st.lists(st.integers(0, 2), max_size=8), st.none()),
        st.tuples(st.sampled_from(["unlock", "evict", "evict_snapshots"]), st.integers(0, 9), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(POLICIES), num_slots=st.integers(0, 4), ops=ops)
def test_tree_matches_reference_under_insert_match_lock_evict(policy: str, num_slots: int, ops: list) -> None:
    cache, states = make_cache(size=400, snapshots=num_slots, policy=policy)
    ref: dict[Prefix, int] = {}
    snaps: set[Prefix] = set()
    locks = Locks()
    for op, arg, flag in ops:
        protected = {key for key in +locks.count if key}  # lock points hold a snapshot, which is theirs
        if op == "insert":
            expected = cached_len(ref, arg)
            free_before = cache.state_slots.available_size()
            slots = insert_fresh(cache, states, arg, snapshot=flag)
            added = {tuple(arg[: i + 1]): int(slots[i]) for i in range(expected, len(arg))}
            kv, new_snaps = contents(cache, states)
            key = tuple(arg)
            if flag and key and key not in snaps and free_before:
                assert new_snaps == snaps | {key} and kv == ref | added
            elif flag and key and key not in snaps and snaps - protected:
                # No free slot: exactly one unlocked snapshot made room (its leaf's KV went with it).
                (victim,) = snaps - new_snaps
                assert victim not in protected and new_snaps == snaps - {victim} | {key}
                gone = (ref | added).keys() - kv.keys()
                assert all(victim[: len(p)] == p for p in gone) and gone.isdisjoint(locked_prefixes(locks.count))
            else:
                assert new_snaps == snaps and kv == ref | added
            ref, snaps = kv, new_snaps
        elif op in ("match", "lock"):
            n = snapshot_len(ref, snaps, arg)
            match = cache.match_prefix(arg)
            assert match.indices.tolist() == [ref[tuple(arg[: i + 1])] for i in range(n)]
            assert path_key(match.last_node) == arg[:n] and match.kv_len == cached_len(ref, arg)
            assert (match.snapshot is None) == (n == 0)
            if n:
                assert states.slots[match.snapshot].tolist() == arg[:n]
            if op == "lock":
                locks.lock(cache, match.last_node, tuple(arg[:n]))
        elif op == "unlock" and locks.held:
            locks.unlock(cache, arg)
        elif op == "evict":
            evictable = cache.evictable_size()
            useless = {p for p in ref if not any(s[: len(p)] == p for s in snaps)} - locked_prefixes(locks.count)
            freed = cache.evict(arg)
            assert min(arg, evictable) <= freed <= evictable
            assert freed >= arg or cache.evictable_size() == 0
            kv, new_snaps = contents(cache, states)
            gone = ref.keys() - kv.keys()
            assert kv == {k: ref[k] for k in kv} and len(gone) == freed
            assert gone.isdisjoint(locked_prefixes(locks.count)) and new_snaps == snaps & kv.keys()
            if new_snaps != snaps:
                assert useless <= gone  # unmatchable KV goes before any snapshot
            ref, snaps = kv, new_snaps
        elif op == "evict_snapshots":
            freed = cache.evict_snapshots(arg)
            assert freed == min(arg, len(snaps - protected))
            kv, new_snaps = contents(cache, states)
            dropped = snaps - new_snaps
            assert new_snaps <= snaps and len(dropped) == freed and dropped.isdisjoint(protected)
            for s in dropped:  # a node left an unlocked leaf goes with its snapshot; others keep their KV
                leaf = not any(len(p) > len(s) and p[: len(s)] == s for p in kv)
                assert (s in kv) == (not leaf or s in locked_prefixes(locks.count))
            assert all(any(s[: len(p)] == p for s in dropped) for p in ref.keys() - kv.keys())
            ref, snaps = kv, new_snaps
        assert contents(cache, states) == (ref, snaps)
        assert cache.protected_size() == len(locked_prefixes(locks.count))
        assert cache.protected_snapshot_count() == len({key for key in +locks.count if key})
        assert cache.evictable_snapshot_count() == len(snaps - {key for key in +locks.count if key})
        check_pools(cache, ref, snaps, [])



def test_split_keeps_the_snapshot_on_the_lower_part() -> None:
    cache, states = make_cache()
    slots = insert_fresh(cache, states, [1, 2, 3, 4])
    whole = cache.match_prefix([1, 2, 3, 4, 5])
    insert_fresh(cache, states, [1, 2, 9], snapshot=False)  # splits [1, 2 | 3, 4]
    upper = cache.root.children[1]
    assert upper.key == [1, 2] and upper.snapshot is None
    assert upper.children[3] is whole.last_node and whole.last_node.snapshot == whole.snapshot
    match = cache.match_prefix([1, 2, 3, 4, 5])
    assert match.indices.tolist() == slots.tolist() and match.snapshot == whole.snapshot
    assert states.slots[match.snapshot].tolist() == [1, 2, 3, 4]
    miss = cache.match_prefix([1, 2, 9, 9])  # KV for three tokens, but no state to resume from
    assert miss.indices.numel() == 0 and miss.last_node is cache.root and miss.kv_len == 3


def test_match_stops_at_the_deepest_snapshot_without_splitting() -> None:
    cache, states = make_cache()
    slots = insert_fresh(cache, states, [1, 2, 3])
    insert_fresh(cache, states, [1, 2, 3, 4, 5], snapshot=False)
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert match.indices.tolist() == slots.tolist() and match.kv_len == 5
    assert states.slots[match.snapshot].tolist() == [1, 2, 3]
    assert cache.match_prefix([1, 2, 3, 4]).kv_len == 4
    assert [child.key for child in cache.root.children.values()] == [[1, 2, 3]]
    assert [child.key for child in cache.root.children[1].children.values()] == [[4, 5]]


def test_snapshot_eviction_frees_inner_slots_alone_and_leaves_with_their_kv() -> None:
    cache, states = make_cache(size=16)
    insert_fresh(cache, states, [1, 2])
    insert_fresh(cache, states, [1, 2, 3])
    insert_fresh(cache, states, [7, 7])
    locked = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(locked.last_node)  # protects [1, 2, 3]'s snapshot and the KV of its path
    assert cache.evict_snapshots(5) == 2  # [1, 2]'s slot, and the [7, 7] leaf whole
    assert cache.total_size() == 3 and cache.snapshot_count() == 1
    assert cache.token_to_kv_pool_allocator.available_size() == 13
    assert cache.match_prefix([1, 2, 3, 4]).snapshot == locked.snapshot
    assert cache.match_prefix([1, 2, 9]).indices.numel() == 0
    cache.dec_lock_ref(locked.last_node)
    assert cache.evict_snapshots(1) == 1 and cache.total_size() == 2  # the [3] leaf went with it
    assert cache.evict(1) == 2  # [1, 2] is now unmatchable KV
    cache.check_snapshot_slots()


def test_without_a_free_slot_the_policy_victim_makes_room_unless_it_is_locked() -> None:
    cache, states = make_cache(snapshots=1)
    insert_fresh(cache, states, [1, 1])
    held = cache.match_prefix([1, 1, 5])
    cache.inc_lock_ref(held.last_node)
    insert_fresh(cache, states, [2, 2])  # the only slot is locked: KV cached, no snapshot
    assert cache.total_size() == 4 and cache.snapshot_count() == 1
    assert cache.match_prefix([2, 2, 5]).indices.numel() == 0
    cache.dec_lock_ref(held.last_node)
    insert_fresh(cache, states, [3, 3])  # evicts [1, 1] (a leaf: its KV goes too) for [3, 3]
    assert cache.match_prefix([1, 1]).kv_len == 0
    match = cache.match_prefix([3, 3, 5])
    assert states.slots[match.snapshot].tolist() == [3, 3] and cache.snapshot_count() == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_kv_eviction_takes_unmatchable_leaves_before_any_policy_order(policy: str) -> None:
    cache, states = make_cache(policy=policy)
    insert_fresh(cache, states, [1, 1], priority=5)
    insert_fresh(cache, states, [2, 2], snapshot=False, priority=5)
    insert_fresh(cache, states, [3, 3], priority=0)
    cache.match_prefix([2, 2])
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).kv_len == 0
    assert cache.match_prefix([1, 1]).kv_len == cache.match_prefix([3, 3]).kv_len == 2


def _snapshot_evicted_first(policy: str, setup: list[tuple[str, list[int], int]]) -> list[int]:
    cache, states = make_cache(policy=policy)
    for op, key, priority in setup:
        if op == "insert":
            insert_fresh(cache, states, key, priority=priority)
        else:
            cache.match_prefix(key)
    assert cache.evict_snapshots(1) == 1
    gone = [key for key in ([1, 1], [2, 2], [3, 3]) if cache.match_prefix(key).snapshot is None]
    assert len(gone) == 1
    return gone[0]


@pytest.mark.parametrize(
    ("policy", "steps", "victim"),
    [
        ("lru", [("match", [1, 1], 0)], [2, 2]),
        ("mru", [("match", [3, 3], 0), ("match", [1, 1], 0)], [1, 1]),
        ("fifo", [("match", [1, 1], 0), ("match", [2, 2], 0)], [1, 1]),
        ("filo", [("match", [3, 3], 0), ("match", [1, 1], 0)], [3, 3]),
        ("lfu", [("match", [3, 3], 0)] * 3 + [("match", [1, 1], 0)] * 2 + [("match", [2, 2], 0)], [2, 2]),
        ("priority", [("insert", [1, 1], 5), ("insert", [2, 2], 1), ("insert", [3, 3], 3)], [2, 2]),
    ],
)
def test_snapshot_eviction_follows_the_policy(
    policy: str, steps: list[tuple[str, list[int], int]], victim: list[int]
) -> None:
    assert _snapshot_evicted_first(policy, INSERT_ABC + steps) == victim


def test_bad_arguments_are_rejected() -> None:
    cache, states = make_cache()
    with pytest.raises(ValueError, match="num_snapshots"):
        cache.evict_snapshots(-1)
    insert_fresh(cache, states, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    with pytest.raises(ValueError, match="own_lock_ref"):
        cache.dec_lock_ref(node)
    req = FakeReq(0, [1, 2, 3], cache.match_prefix([1, 2]).indices, node, 2)
    with pytest.raises(ValueError, match="locked node with a snapshot"):
        cache.restore_prefix_state(req)  # never locked: its snapshot may be gone
    slots = SnapshotSlots(2)
    with pytest.raises(ValueError, match="not allocated"):
        slots.free(1)
    with pytest.raises(ValueError, match="total"):
        SnapshotSlots(-1)
