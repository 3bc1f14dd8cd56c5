"""Shared pieces of the HybridRadixCache tests: a fake state memory whose states are the tokens they
consumed, the naive reference's snapshot queries, and a walk of the tree that checks its structure.
The pieces the RadixCache tests share too are in tests/radix_cache_helpers.py."""

from __future__ import annotations

import torch

from services.worker.mem.hybrid_radix_cache import HybridRadixCache, HybridTreeNode, SnapshotSlots
from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from tests.radix_cache_helpers import Prefix, cached_len, free_slots

ROW = 0  # the state row the tree-level tests snapshot from


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


def snapshot_len(ref: dict[Prefix, int], snaps: set[Prefix], key: list[int]) -> int:
    """The reference match: the longest cached prefix of key that has a snapshot."""
    return max((n for n in range(1, cached_len(ref, key) + 1) if tuple(key[:n]) in snaps), default=0)


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
    assert sorted(free_slots(cache) + list(kv.values()) + owned) == list(range(1, size + 1))
    assert cache.evictable_size() + cache.protected_size() == cache.total_size() == len(kv)
    cache.check_snapshot_slots()
    assert cache.snapshot_count() == len(snaps)

