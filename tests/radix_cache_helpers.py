"""The naive reference and the request harness that the RadixCache and HybridRadixCache tests share.

The reference is a dict from every cached token prefix to the KV slot of its last token; `Locks`
mirrors the locks a test holds. `RequestHarness` drives a cache's request glue the way the scheduler
does; each test module adds its own admission and checks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from services.worker.mem.eviction_policy import EVICTION_POLICIES
from services.worker.mem.radix_cache import RadixCache, TreeNode

POLICIES = sorted(EVICTION_POLICIES)
Prefix = tuple[int, ...]

# Three two-token sequences, inserted in order: the start of the eviction-order cases.
INSERT_ABC = [("insert", [1, 1], 0), ("insert", [2, 2], 0), ("insert", [3, 3], 0)]

# (prompt, output, prefill chunk, priority) of one request, over a tiny alphabet so prefixes collide.
request = st.tuples(
    st.lists(st.integers(0, 2), min_size=1, max_size=10),
    st.lists(st.integers(0, 2), min_size=1, max_size=4),
    st.integers(1, 6),
    st.integers(0, 3),
)


def path_key(node: TreeNode) -> list[int]:
    """The tokens on the path from the root to `node`."""
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def cached_len(ref: dict[Prefix, int], key: list[int]) -> int:
    """The reference's longest cached prefix of `key`."""
    n = 0
    while n < len(key) and tuple(key[: n + 1]) in ref:
        n += 1
    return n


def locked_prefixes(locked: Counter[Prefix]) -> set[Prefix]:
    """Every token prefix on a path that some lock holds."""
    return {key[:i] for key in +locked for i in range(1, len(key) + 1)}


def free_slots(cache: RadixCache) -> list[int]:
    """The allocator's free KV slots (taken and given back)."""
    allocator = cache.token_to_kv_pool_allocator
    slots = allocator.alloc(allocator.available_size())
    assert slots is not None
    allocator.free(slots)
    return slots.tolist()


class Locks:
    """The locks a test holds, as the reference sees them: each lock's node and prefix (`held`) and
    the number of locks per prefix (`count`). Taking and releasing one checks the size change the
    cache reports against the prefixes that become (un)locked."""

    def __init__(self) -> None:
        self.held: list[tuple[TreeNode, Prefix]] = []
        self.count: Counter[Prefix] = Counter()

    def lock(self, cache: RadixCache, node: TreeNode, key: Prefix) -> None:
        before = locked_prefixes(self.count)
        newly = sum(key[:i] not in before for i in range(1, len(key) + 1))
        assert cache.inc_lock_ref(node) == -newly
        self.held.append((node, key))
        self.count[key] += 1

    def unlock(self, cache: RadixCache, pick: int) -> None:
        """Release lock number `pick` (modulo the number held; there must be one)."""
        node, key = self.held.pop(pick % len(self.held))
        assert tuple(path_key(node)) == key
        self.count[key] -= 1
        still = locked_prefixes(self.count)
        assert cache.dec_lock_ref(node) == sum(key[:i] not in still for i in range(1, len(key) + 1))


@dataclass
class FakeReq:
    """The attributes the cache reads on a request, plus the test's script for it."""

    req_pool_idx: int | None
    origin_input_ids: list[int]
    prefix_indices: torch.Tensor
    last_node: TreeNode | None
    kv_committed_len: int
    target_output: list[int] = field(default_factory=list)
    chunk: int = 1
    priority: int = 0
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    track_slot: int | None = None
    track_len: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


class RequestHarness:
    """A scheduler in miniature over `cache`: prefills in chunks, decodes, finishes. `kv` stands in
    for the KV pool: the token prefix whose KV each slot holds."""

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self.pool = cache.req_to_token_pool
        self.allocator = cache.token_to_kv_pool_allocator
        self.kv: dict[int, Prefix] = {}

    def compute_kv(self, req: FakeReq, end: int) -> None:
        """The forward's KV for positions kv_committed_len .. end-1, evicting first if slots are short."""
        start = req.kv_committed_len
        short = end - start - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
        slots = self.allocator.alloc(end - start)
        assert slots is not None and req.req_pool_idx is not None
        self.pool.write(req.req_pool_idx, start, slots)
        ids = req.all_ids
        self.kv.update({slot: tuple(ids[: pos + 1]) for pos, slot in zip(range(start, end), slots.tolist())})
        req.kv_committed_len = end

    def step(self, req: FakeReq, cache_after: bool = False) -> bool:
        """One forward of `req`; returns whether it finished."""
        num_input = len(req.origin_input_ids)
        if req.kv_committed_len < num_input:
            end = min(num_input, req.kv_committed_len + req.chunk)
            req.fill_ids = req.origin_input_ids[:end]
            self.compute_kv(req, end)
            if end < num_input:
                self.cache.cache_unfinished_req(req)
                return False
        else:
            self.compute_kv(req, req.kv_committed_len + 1)  # KV of the last sampled token
        req.output_ids.append(req.target_output[len(req.output_ids)])
        if len(req.output_ids) == len(req.target_output):
            self.cache.cache_finished_req(req)
            return True
        if cache_after:
            req.fill_ids = req.all_ids
            self.cache.cache_unfinished_req(req)
        return False

    def fits(self, running: list[FakeReq], waiting: list[tuple]) -> bool:
        """Whether the first waiting (prompt, output, ...) fits beside the running requests: their total
        tokens stay within the pool, as the scheduler's budget keeps them."""
        need = sum(len(r.origin_input_ids) + len(r.target_output) for r in running)
        return bool(waiting) and need + len(waiting[0][0]) + len(waiting[0][1]) <= self.allocator.size

    def step_drawn(self, running: list[FakeReq], data: st.DataObject) -> None:
        """Step a running request that `data` draws (caching it after, if drawn); a finished one leaves
        `running`."""
        req = running[data.draw(st.integers(0, len(running) - 1), label="req")]
        if self.step(req, cache_after=data.draw(st.booleans(), label="cache after")):
            running.remove(req)
