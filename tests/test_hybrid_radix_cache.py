"""HybridRadixCache against a naive reference: a dict from every cached token prefix to its KV slot,
and the set of prefixes that hold a state snapshot. The engine's state memory is faked: a request
row's state is the tensor of the tokens it consumed, so a snapshot or a restored state must equal the
tokens of its prefix. Random insert/match/lock/evict sequences per eviction policy, and requests
driven like the scheduler (chunked prefill, decode, retraction) with few snapshot slots."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.mem.eviction_policy import EVICTION_POLICIES
from services.worker.mem.hybrid_radix_cache import HybridRadixCache, HybridTreeNode, SnapshotSlots
from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

POLICIES = sorted(EVICTION_POLICIES)
ROW = 0  # the state row the tree-level tests snapshot from
Prefix = tuple[int, ...]


class FakeStates:
    """State rows and snapshot slots; each holds the tokens its state has consumed."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}
        self.slots: dict[int, torch.Tensor] = {}

    def copy_state(self, row: int, slot: int) -> None:
        self.slots[slot] = self.rows[row].clone()

    def restore_state(self, slot: int, row: int) -> None:
        self.rows[row] = self.slots[slot].clone()

    def set_row(self, row: int, tokens: list[int]) -> None:
        self.rows[row] = torch.tensor(tokens, dtype=torch.int64)


def make_cache(
    size: int = 64, snapshots: int = 8, policy: str = "lru", disable: bool = False
) -> tuple[HybridRadixCache, FakeStates]:
    states = FakeStates()
    cache = HybridRadixCache(
        ReqToTokenPool(8, 32, "cpu"),
        TokenToKVPoolAllocator(size, "cpu"),
        SnapshotSlots(snapshots),
        states.copy_state,
        states.restore_state,
        policy,
        disable,
    )
    return cache, states


def contents(cache: HybridRadixCache, states: FakeStates) -> tuple[dict[Prefix, int], set[Prefix]]:
    """Every cached prefix -> KV slot, and the prefixes holding a snapshot; checks the structure,
    the lock counts and that each snapshot holds the state of exactly its prefix."""
    kv: dict[Prefix, int] = {}
    snaps: set[Prefix] = set()
    stack: list[tuple[HybridTreeNode, Prefix]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        if node is not cache.root:
            assert node.lock_ref == node.own_lock_ref + sum(c.lock_ref for c in node.children.values())
        for first, child in node.children.items():
            assert child.parent is node and child.key and child.key[0] == first
            path = (*prefix, *child.key)
            kv.update({path[: len(prefix) + i + 1]: s for i, s in enumerate(child.value.tolist())})
            if child.snapshot is not None:
                snaps.add(path)
                assert states.slots[child.snapshot].tolist() == list(path)
            stack.append((child, path))
    assert cache.root.snapshot is None
    return kv, snaps


def free_kv(cache: HybridRadixCache) -> list[int]:
    allocator = cache.token_to_kv_pool_allocator
    slots = allocator.alloc(allocator.available_size())
    assert slots is not None
    allocator.free(slots)
    return slots.tolist()


def path_key(node: HybridTreeNode) -> list[int]:
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def cached_len(ref: dict[Prefix, int], key: list[int]) -> int:
    n = 0
    while n < len(key) and tuple(key[: n + 1]) in ref:
        n += 1
    return n


def snapshot_len(ref: dict[Prefix, int], snaps: set[Prefix], key: list[int]) -> int:
    """The reference match: the longest cached prefix of key that has a snapshot."""
    return max((n for n in range(1, cached_len(ref, key) + 1) if tuple(key[:n]) in snaps), default=0)


def on_locked_path(locked: Counter[Prefix]) -> set[Prefix]:
    return {key[:i] for key in +locked for i in range(1, len(key) + 1)}


def insert_fresh(
    cache: HybridRadixCache, states: FakeStates, key: list[int], snapshot: bool = True, priority: int = 0
) -> torch.Tensor:
    slots = cache.token_to_kv_pool_allocator.alloc(len(key))
    assert slots is not None
    states.set_row(ROW, key)
    n = cache.insert(key, slots, priority, state_row=ROW if snapshot else None)
    cache.token_to_kv_pool_allocator.free(slots[:n])
    return slots


def check_pools(cache: HybridRadixCache, kv: dict[Prefix, int], snaps: set[Prefix], owned: list[int]) -> None:
    size = cache.token_to_kv_pool_allocator.size
    assert sorted(free_kv(cache) + list(kv.values()) + owned) == list(range(1, size + 1))
    assert cache.evictable_size() + cache.protected_size() == cache.total_size() == len(kv)
    cache.check_snapshot_slots()
    assert cache.snapshot_count() == len(snaps)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 2), max_size=7), st.booleans()),
        st.tuples(st.sampled_from(["match", "lock"]), st.lists(st.integers(0, 2), max_size=8), st.none()),
        st.tuples(st.sampled_from(["unlock", "evict", "evict_snapshots"]), st.integers(0, 9), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(POLICIES), num_slots=st.integers(0, 4), ops=ops)
def test_tree_matches_reference_under_insert_match_lock_evict(policy: str, num_slots: int, ops: list) -> None:
    cache, states = make_cache(size=400, snapshots=num_slots, policy=policy)
    ref: dict[Prefix, int] = {}
    snaps: set[Prefix] = set()
    locks: list[tuple[HybridTreeNode, Prefix]] = []
    locked: Counter[Prefix] = Counter()
    for op, arg, flag in ops:
        protected = {key for key in +locked if key}  # lock points hold a snapshot, which is theirs
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
                assert all(victim[: len(p)] == p for p in gone) and gone.isdisjoint(on_locked_path(locked))
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
                before = on_locked_path(locked)
                newly = sum(tuple(arg[:i]) not in before for i in range(1, n + 1))
                assert cache.inc_lock_ref(match.last_node) == -newly
                locks.append((match.last_node, tuple(arg[:n])))
                locked[tuple(arg[:n])] += 1
        elif op == "unlock" and locks:
            node, key = locks.pop(arg % len(locks))
            assert tuple(path_key(node)) == key
            locked[key] -= 1
            still = on_locked_path(locked)
            assert cache.dec_lock_ref(node) == sum(key[:i] not in still for i in range(1, len(key) + 1))
        elif op == "evict":
            evictable = cache.evictable_size()
            useless = {p for p in ref if not any(s[: len(p)] == p for s in snaps)} - on_locked_path(locked)
            freed = cache.evict(arg)
            assert min(arg, evictable) <= freed <= evictable
            assert freed >= arg or cache.evictable_size() == 0
            kv, new_snaps = contents(cache, states)
            gone = ref.keys() - kv.keys()
            assert kv == {k: ref[k] for k in kv} and len(gone) == freed
            assert gone.isdisjoint(on_locked_path(locked)) and new_snaps == snaps & kv.keys()
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
                assert (s in kv) == (not leaf or s in on_locked_path(locked))
            assert all(any(s[: len(p)] == p for s in dropped) for p in ref.keys() - kv.keys())
            ref, snaps = kv, new_snaps
        assert contents(cache, states) == (ref, snaps)
        assert cache.protected_size() == len(on_locked_path(locked))
        assert cache.protected_snapshot_count() == len({key for key in +locked if key})
        check_pools(cache, ref, snaps, [])


# Request glue, driven the way the scheduler drives it (see tests/test_radix_cache.py's Harness).


@dataclass
class FakeReq:
    req_pool_idx: int | None
    origin_input_ids: list[int]
    prefix_indices: torch.Tensor
    last_node: HybridTreeNode | None
    kv_committed_len: int
    target_output: list[int] = field(default_factory=list)
    chunk: int = 1
    priority: int = 0
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


class Harness:
    """A scheduler and a model in miniature: `kv` maps each KV slot to the prefix it holds, and a
    request's state row grows by the tokens each forward consumes."""

    def __init__(self, size: int, snapshots: int, policy: str = "lru", disable: bool = False) -> None:
        self.cache, self.states = make_cache(size, snapshots, policy, disable)
        self.pool = self.cache.req_to_token_pool
        self.allocator = self.cache.token_to_kv_pool_allocator
        self.kv: dict[int, Prefix] = {}

    def admit(self, input_ids: list[int], output: list[int], chunk: int = 64, priority: int = 0) -> FakeReq:
        key = input_ids[:-1]  # the last prompt token is always computed
        kv, snaps = contents(self.cache, self.states)
        match = self.cache.match_prefix(key)
        n = len(match.indices)
        assert n == snapshot_len(kv, snaps, key) and match.kv_len == cached_len(kv, key)
        self.cache.inc_lock_ref(match.last_node)
        rows = self.pool.alloc(1)
        assert rows is not None
        self.pool.write(rows[0], 0, match.indices)
        req = FakeReq(rows[0], input_ids, match.indices, match.last_node, n, output, chunk, priority)
        self.states.set_row(rows[0], [])  # the zero state
        assert self.cache.restore_prefix_state(req) == (n > 0)
        assert self.states.rows[rows[0]].tolist() == input_ids[:n]  # the state at the hit point
        return req

    def compute(self, req: FakeReq, end: int) -> None:
        start = req.kv_committed_len
        short = end - start - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
        slots = self.allocator.alloc(end - start)
        assert slots is not None and req.req_pool_idx is not None
        self.pool.write(req.req_pool_idx, start, slots)
        ids = req.all_ids
        self.kv.update({slot: tuple(ids[: pos + 1]) for pos, slot in zip(range(start, end), slots.tolist())})
        row = req.req_pool_idx
        self.states.rows[row] = torch.cat((self.states.rows[row], torch.tensor(ids[start:end], dtype=torch.int64)))
        req.kv_committed_len = end

    def step(self, req: FakeReq, cache_after: bool = False) -> bool:
        num_input = len(req.origin_input_ids)
        if req.kv_committed_len < num_input:
            end = min(num_input, req.kv_committed_len + req.chunk)
            req.fill_ids = req.origin_input_ids[:end]
            self.compute(req, end)
            if end < num_input:
                self.cache.cache_unfinished_req(req)
                return False
        else:
            self.compute(req, req.kv_committed_len + 1)
        req.output_ids.append(req.target_output[len(req.output_ids)])
        if len(req.output_ids) == len(req.target_output):
            self.cache.cache_finished_req(req)
            return True
        if cache_after:
            req.fill_ids = req.all_ids
            self.cache.cache_unfinished_req(req)
        return False

    def check(self, running: list[FakeReq]) -> None:
        owned: list[int] = []
        for req in running:
            assert req.req_pool_idx is not None
            assert self.states.rows[req.req_pool_idx].tolist() == req.all_ids[: req.kv_committed_len]
            slots = self.pool.read(req.req_pool_idx, 0, req.kv_committed_len).tolist()
            assert [self.kv[s] for s in slots] == [tuple(req.all_ids[: p + 1]) for p in range(len(slots))]
            owned += slots if self.cache.disable else slots[len(req.prefix_indices) :]
        kv, snaps = contents(self.cache, self.states)
        assert all(self.kv[slot] == prefix for prefix, slot in kv.items())
        check_pools(self.cache, kv, snaps, owned)

    def check_idle(self) -> None:
        """Nothing leaks: with every request done, evicting everything gives back every slot."""
        self.check([])
        cache = self.cache
        assert cache.protected_size() == cache.protected_snapshot_count() == 0
        assert self.pool.available_size() == self.pool.size
        cache.evict(cache.evictable_size())
        cache.evict_snapshots(cache.snapshot_count())
        assert cache.total_size() == cache.snapshot_count() == 0
        assert self.allocator.available_size() == self.allocator.size
        assert cache.state_slots.available_size() == cache.state_slots.total
        cache.reset()
        assert cache.match_prefix([0, 1, 2]).kv_len == 0


request = st.tuples(
    st.lists(st.integers(0, 2), min_size=1, max_size=10),
    st.lists(st.integers(0, 2), min_size=1, max_size=4),
    st.integers(1, 6),
    st.integers(0, 3),
)


def _serve(harness: Harness, specs: list[tuple], data: st.DataObject) -> None:
    """Run every request to completion in a drawn interleaving (with evictions and retractions),
    checking pools, states and matches after each step."""
    waiting, running = list(specs), []
    while waiting or running:
        what = data.draw(st.sampled_from(["step", "step", "evict", "evict_snapshots", "retract"]), label="op")
        if what == "evict":
            harness.cache.evict(data.draw(st.integers(0, 6), label="tokens"))
        elif what == "evict_snapshots":
            harness.cache.evict_snapshots(data.draw(st.integers(0, 2), label="snapshots"))
        need = sum(len(r.origin_input_ids) + len(r.target_output) for r in running)
        fits = waiting and need + len(waiting[0][0]) + len(waiting[0][1]) <= harness.allocator.size
        if fits and (not running or data.draw(st.booleans(), label="admit")):
            running.append(harness.admit(*waiting.pop(0)))
        elif what == "retract" and running:
            req = running.pop(data.draw(st.integers(0, len(running) - 1), label="victim"))
            harness.cache.cache_finished_req(req)  # as retract() does; it frees the request's row
            waiting.append((req.all_ids, req.target_output[len(req.output_ids) :], req.chunk, req.priority))
        elif running:
            req = running[data.draw(st.integers(0, len(running) - 1), label="req")]
            if harness.step(req, cache_after=data.draw(st.booleans(), label="cache after")):
                running.remove(req)
        harness.check(running)
    harness.check_idle()


@settings(max_examples=100, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    num_slots=st.integers(0, 4),
    specs=st.lists(request, min_size=1, max_size=5),
    data=st.data(),
)
def test_requests_restore_the_snapshotted_state_without_leaking(
    policy: str, num_slots: int, specs: list[tuple], data: st.DataObject
) -> None:
    totals = [len(i) + len(o) for i, o, _, _ in specs]
    size = data.draw(st.integers(max(totals), sum(totals)), label="pool size")
    _serve(Harness(size, num_slots, policy), specs, data)


@settings(max_examples=30, deadline=None)
@given(specs=st.lists(request, min_size=1, max_size=4), data=st.data())
def test_disabled_cache_keeps_no_kv_and_no_snapshot(specs: list[tuple], data: st.DataObject) -> None:
    harness = Harness(sum(len(i) + len(o) for i, o, _, _ in specs), 4, disable=True)
    _serve(harness, specs, data)


# Targeted cases.


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


def test_no_snapshot_slots_caches_kv_that_is_never_matched_and_goes_first() -> None:
    harness = Harness(size=16, snapshots=0)
    req = harness.admit([1, 2, 3, 4], [5])
    assert harness.step(req)
    assert harness.cache.total_size() == 4 and harness.cache.snapshot_count() == 0
    again = harness.admit([1, 2, 3, 4], [5])
    assert again.kv_committed_len == 0 and again.last_node is harness.cache.root
    assert harness.step(again)
    harness.check_idle()


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


INSERT_ABC = [("insert", [1, 1], 0), ("insert", [2, 2], 0), ("insert", [3, 3], 0)]


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


def test_finished_req_is_snapshotted_where_its_state_and_kv_agree() -> None:
    harness = Harness(size=16, snapshots=4)
    req = harness.admit([1, 2, 3], [4, 5])
    assert not harness.step(req) and harness.step(req)
    # KV and state cover [1, 2, 3, 4]; the last sampled token 5 is in neither.
    kv, snaps = contents(harness.cache, harness.states)
    assert snaps == {(1, 2, 3, 4)} and len(kv) == 4
    dropped = harness.admit([7, 8, 9], [])
    harness.compute(dropped, 4)  # a committed position whose token was dropped: state has 4 tokens
    harness.cache.cache_finished_req(dropped)
    assert contents(harness.cache, harness.states)[1] == {(1, 2, 3, 4)}
    harness.check_idle()


def test_chunk_boundaries_leave_snapshots_a_later_request_resumes_from() -> None:
    harness = Harness(size=32, snapshots=8)
    first = harness.admit([1, 2, 3, 4, 5, 6, 7], [9], chunk=3)
    while not harness.step(first):
        pass
    assert contents(harness.cache, harness.states)[1] == {(1, 2, 3), (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6, 7)}
    second = harness.admit([1, 2, 3, 4, 5, 0, 0], [9])  # resumes at 3 tokens: KV to 5, no state there
    assert len(second.prefix_indices) == 3
    assert harness.step(second)
    harness.check_idle()


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
