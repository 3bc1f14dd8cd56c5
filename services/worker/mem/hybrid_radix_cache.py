# Over 400 lines: snapshots, their eviction and the glue's tracked slots share the tree's private state.
"""Prefix cache for hybrid models: KV of the full-attention layers plus snapshots of the
linear-attention layers' state at radix nodes.

A linear-attention layer (Gated DeltaNet) keeps one fixed-size state per request (conv state and
recurrent state) instead of KV. A request that reuses a cached prefix must start from that state at
exactly the prefix's end, so a node may hold a *snapshot*: a slot of a snapshot allocator holding the
state after the node's whole path. The engine owns the state memory and injects two copies:
`copy_state(row, slot)` (a request's state row into a snapshot slot) and `restore_state(slot, row)`.

Rules:
- match_prefix returns the KV only up to the deepest node of the matched path that has a snapshot,
  that node, and its slot; KV cached past it is reported (`kv_len`) but not usable yet. Snapshots sit
  at node ends, so a match never splits an edge. Splitting a node (insert, the request glue) keeps the
  snapshot on the lower part: it is the state after the whole old edge; the new upper node has none.
- The request glue snapshots the request's state row at the node ending the tokens it inserted, when
  that node has none yet: at chunk boundaries (cache_unfinished_req) and at the end
  (cache_finished_req). A request's row holds the state after its first kv_committed_len tokens (in
  stream order: the copy is enqueued after the forward that wrote it), so the snapshot is taken only
  when the inserted tokens are exactly those: never for a finished request's last sampled token (no
  KV, not in the state either) nor when a committed position has no token (and a speculative step
  must roll the row back to kv_committed_len before the cache sees the request). No free slot: the
  policy's snapshot victim is evicted; none evictable: no snapshot, the KV still goes in.
- A prompt's last token is never matched (its logits are needed), so a snapshot at a prompt's end
  serves no identical prompt. The forward that ends a request's prefill therefore also writes the
  state one token short of its end into a slot (track_state, as SGLang's mamba track buffer does),
  and the glue hands that slot to the node there (splitting the edge) in place of the snapshot at
  the forward's end: the second identical prompt resumes from it and computes one token, as the
  third does. A tracked slot the glue sees later (a longer key) still goes there, and the end
  snapshot is then taken too.
- Snapshots exist only where some request's forward stopped or tracked. When a match's `kv_len`
  exceeds its length (requests sharing a prompt head, then diverging), the scheduler should end the
  request's first chunk at `kv_len`: cache_unfinished_req then snapshots the branch point, and the
  next request with that head resumes there instead of at an older snapshot.
- inc_lock_ref(node) protects the KV of the whole path, as in RadixCache, and node's own snapshot:
  the one a request restores from (a running request keeps its state in its own row, so the snapshots
  above its lock point are not pinned by it).
- evict frees leaves with their snapshots, leaves without a snapshot first (their KV can never be
  matched again), then in policy order. evict_snapshots frees snapshots alone, in policy order: on an
  unlocked leaf the leaf goes with it (its KV became unmatchable), elsewhere only the slot.

Ownership of snapshot slots, beside RadixCache's ownership of KV slots:

    state_slots.available_size() + snapshot_count() + tracking_count() == state_slots.total

(running requests keep their states in their own rows of the state pool; a tracked slot is held by
its request from track_state until the glue gives it to the tree or back).
The engine sizes `total` from the memory budget: each slot costs one request's state bytes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from services.worker.mem.radix_cache import (
    _EMPTY_SLOTS,
    CacheableReq,
    MatchResult,
    RadixCache,
    TreeNode,
    _common_prefix_len,
)

CopyState = Callable[[int, int], None]


class TrackingReq(CacheableReq, Protocol):
    """A request as the hybrid cache sees it: also the snapshot slot its step tracks (track_state)."""

    track_slot: int | None
    track_len: int


class StateSlotAllocator(Protocol):
    """What the cache needs of the snapshot slots' allocator."""

    total: int

    def alloc(self) -> int | None: ...

    def free(self, slot: int) -> None: ...

    def available_size(self) -> int: ...


class SnapshotSlots:
    """Free list over snapshot slots 0 .. total-1; freeing a slot that is not handed out is an error."""

    def __init__(self, total: int) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self.clear()

    def clear(self) -> None:
        self._free = list(range(self.total - 1, -1, -1))
        self._used: set[int] = set()

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"snapshot slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)


class HybridTreeNode(TreeNode):
    """A TreeNode that may hold a snapshot: `snapshot` is its slot (None: none). `own_lock_ref`
    counts the locks taken at this very node (lock_ref also counts those of its descendants)."""

    __slots__ = ("snapshot", "own_lock_ref")

    def __init__(
        self,
        key: list[int],
        value: torch.Tensor,
        parent: TreeNode | None,
        creation_order: int,
        priority: int = 0,
    ) -> None:
        super().__init__(key, value, parent, creation_order, priority)
        self.snapshot: int | None = None
        self.own_lock_ref = 0


@dataclass(frozen=True)
class HybridMatchResult(MatchResult):
    """A match usable by a hybrid model: `indices` end at `last_node`, the deepest matched node with a
    snapshot, and `snapshot` is that node's slot (None when nothing matched). `kv_len` tokens of the
    key have KV cached (>= len(indices)); a chunk boundary there leaves a snapshot at that point."""

    snapshot: int | None
    kv_len: int


class HybridRadixCache(RadixCache):
    """RadixCache whose matches restore linear-attention state from snapshots (see the module doc).

    Same API as RadixCache, plus: `insert(..., state_row=)`, `restore_prefix_state`,
    `evict_snapshots`, the snapshot counts, and `check_snapshot_slots`.
    """

    node_type = HybridTreeNode

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        state_slots: StateSlotAllocator,
        copy_state: CopyState,
        restore_state: CopyState,
        eviction_policy: str = "lru",
        disable: bool = False,
    ) -> None:
        self.state_slots = state_slots
        self.copy_state = copy_state
        self.restore_state = restore_state
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, eviction_policy, disable)
        policy_key = self._eviction_key
        self._snapshot_key = policy_key
        # KV eviction: leaves without a snapshot (unmatchable KV) before any other, then policy order.
        self._eviction_key = lambda node: (node.snapshot is not None, *policy_key(node))

    def reset(self) -> None:
        """Drop the tree (see RadixCache.reset); the caller also clears the snapshot slots."""
        super().reset()
        self._snapshot_nodes: set[HybridTreeNode] = set()
        self._tracking: set[int] = set()  # slots handed to requests by track_state

    # Sizes, in snapshots.

    def snapshot_count(self) -> int:
        return len(self._snapshot_nodes)

    def protected_snapshot_count(self) -> int:
        return sum(1 for node in self._snapshot_nodes if node.own_lock_ref > 0)

    def evictable_snapshot_count(self) -> int:
        return self.snapshot_count() - self.protected_snapshot_count()

    def tracking_count(self) -> int:
        """Snapshot slots held by requests whose step tracks a state (track_state)."""
        return len(self._tracking)

    def check_snapshot_slots(self) -> None:
        """free + held by tree nodes + held by tracking requests == total, each slot held once;
        AssertionError otherwise."""
        held = [node.snapshot for node in self._snapshot_nodes] + sorted(self._tracking)
        free, total = self.state_slots.available_size(), self.state_slots.total
        if len(set(held)) != len(held) or free + len(held) != total:
            raise AssertionError(
                f"snapshot slot leak: free {free} + held {len(held)} (tracking {len(self._tracking)}) != {total}"
            )

    # Lookup and insertion.

    def match_prefix(self, key: list[int]) -> HybridMatchResult:
        """The longest cached prefix of `key` that ends at a snapshot. Touches access time and hit
        count of the nodes on that prefix's path; never splits."""
        if self.disable or not key:
            return HybridMatchResult(_EMPTY_SLOTS, self.root, None, 0)
        if not isinstance(key, list):
            key = list(key)
        node, i, path = self.root, 0, []
        best, depth = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_prefix_len(child.key, key, i)
            i += n
            if n < len(child.key):
                break
            path.append(child)
            node = child
            if child.snapshot is not None:
                best, depth = child, len(path)
        now = next(self._clock)
        for child in path[:depth]:
            child.last_access_time = now
            child.hit_count += 1
        indices = torch.cat([child.value for child in path[:depth]]) if depth else _EMPTY_SLOTS
        return HybridMatchResult(indices, best, best.snapshot, i)

    def insert(
        self, key: list[int], value: torch.Tensor, priority: int = 0, state_row: int | None = None
    ) -> int:
        """RadixCache.insert; with `state_row`, that row's state (the state after all of `key`) is
        snapshotted at the node ending `key` unless it has one (or no slot can be had)."""
        num_cached, node = self._insert(key, value, priority)
        if state_row is not None:
            self._snapshot(node, state_row)
        return num_cached

    def _snapshot(self, node: TreeNode, row: int) -> None:
        assert isinstance(node, HybridTreeNode)
        if node is self.root or node.snapshot is not None:
            return
        # The victim is never `node`: it has no snapshot, and evict_snapshots removes only leaves
        # that have one.
        slot = self._alloc_slot()
        if slot is None:
            return
        self.copy_state(row, slot)
        self._attach(node, slot)

    def _alloc_slot(self) -> int | None:
        """A free snapshot slot, evicting the policy's snapshot victim when none is; None when none is
        evictable either."""
        slot = self.state_slots.alloc()
        if slot is None and self.evict_snapshots(1):
            slot = self.state_slots.alloc()
        return slot

    def _attach(self, node: HybridTreeNode, slot: int) -> None:
        node.snapshot = slot
        self._snapshot_nodes.add(node)

    def track_state(self, req: TrackingReq, end: int) -> int | None:
        """A snapshot slot for the state after req's first `end` tokens, which the step about to run
        writes there (the forward ends req's prefill and `end` is one token short of it): set as
        req.track_slot / req.track_len, held by the request until the glue (cache_unfinished_req,
        cache_finished_req) puts it at the node ending those tokens. None when disabled or no slot is
        free or evictable: the step then tracks nothing."""
        if req.track_slot is not None:
            raise ValueError(f"the request already tracks slot {req.track_slot}")
        if not req.kv_committed_len < end < len(req.fill_ids):
            raise ValueError(
                f"end {end} is not inside the step's tokens {req.kv_committed_len}..{len(req.fill_ids) - 1}"
            )
        if self.disable:
            return None
        slot = self._alloc_slot()
        if slot is not None:
            self._tracking.add(slot)
            req.track_slot, req.track_len = slot, end
        return slot

    def _on_req_cached(self, req: CacheableReq, key: list[int], node: TreeNode) -> None:
        tracked = self._place_tracked(req, key)
        if tracked is not None and tracked + 1 == len(key):
            return  # the tracked state replaces the snapshot one token later: see the module doc
        # The row holds the state after kv_committed_len tokens: a snapshot of any other length lies.
        if req.req_pool_idx is not None and len(key) == req.kv_committed_len:
            self._snapshot(node, req.req_pool_idx)

    def _place_tracked(self, req: CacheableReq, key: list[int]) -> int | None:
        """Give req's tracked slot (if any) to the node ending key[:req.track_len], splitting an edge
        there, or back to the free list when that node has a snapshot already or the key stops short.
        Returns the tracked length when it was within `key`."""
        req = cast(TrackingReq, req)
        slot, end = req.track_slot, req.track_len
        if slot is None:
            return None
        req.track_slot, req.track_len = None, 0
        self._tracking.remove(slot)
        if end > len(key):
            self.state_slots.free(slot)
            return None
        node, held, _ = self._descend(key[:end], next(self._clock))
        assert isinstance(node, HybridTreeNode) and held == end > 0
        if node.snapshot is None:
            self._attach(node, slot)
        else:
            self.state_slots.free(slot)
        return end

    def restore_prefix_state(self, req: CacheableReq) -> bool:
        """Copy the snapshot at req.last_node into the request's state row. Call it once, when the
        request matched (match_prefix) and got its ReqToTokenPool row, before its first extend.
        False when the prefix is empty: nothing restored, the row must start from the zero state."""
        if len(req.prefix_indices) == 0:
            return False
        node = req.last_node
        if req.req_pool_idx is None:
            raise ValueError("req.req_pool_idx is None: the request holds no row to restore into")
        if not isinstance(node, HybridTreeNode) or node.snapshot is None or node.lock_ref == 0:
            raise ValueError("req.last_node must be a locked node with a snapshot (from match_prefix)")
        if _path_len(node) != len(req.prefix_indices):
            raise ValueError(
                f"req.prefix_indices has {len(req.prefix_indices)} slots, the snapshot is at {_path_len(node)}"
            )
        self.restore_state(node.snapshot, req.req_pool_idx)
        return True

    # Locking.

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the KV of the path from `node` to the root and node's snapshot; returns the change of
        evictable KV size (<= 0)."""
        delta = super().inc_lock_ref(node)
        if not self.disable and node is not self.root:
            assert isinstance(node, HybridTreeNode)
            node.own_lock_ref += 1
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one `inc_lock_ref(node)`; returns the change of evictable KV size (>= 0)."""
        if self.disable or node is self.root:
            return super().dec_lock_ref(node)
        assert isinstance(node, HybridTreeNode)
        if node.own_lock_ref <= 0:
            raise ValueError("node.own_lock_ref would go below zero: dec_lock_ref without inc_lock_ref")
        node.own_lock_ref -= 1
        return super().dec_lock_ref(node)

    # Eviction.

    def _remove_leaf(self, leaf: TreeNode) -> TreeNode:
        parent = super()._remove_leaf(leaf)
        assert isinstance(leaf, HybridTreeNode)
        self._drop_snapshot(leaf)
        return parent

    def _drop_snapshot(self, node: HybridTreeNode) -> None:
        if node.snapshot is not None:
            self.state_slots.free(node.snapshot)
            node.snapshot = None
            self._snapshot_nodes.discard(node)

    def evict_snapshots(self, num_snapshots: int) -> int:
        """Free at least `num_snapshots` snapshot slots not locked (fewer if not that many are), in
        policy order; a node left an unlocked leaf when its snapshot goes (it was one, or its children
        went before it) goes with it. Returns the number of slots freed."""
        if num_snapshots < 0:
            raise ValueError(f"num_snapshots must be >= 0, got {num_snapshots}")
        if self.disable or num_snapshots == 0:
            return 0
        tie = itertools.count()  # heap entries never compare nodes
        # Policy keys tie only along a split path (the parts share their stats): the deeper part goes
        # first, which keeps the order deterministic.
        heap = [
            (self._snapshot_key(node), -_depth(node), next(tie), node)
            for node in self._snapshot_nodes
            if node.own_lock_ref == 0
        ]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_snapshots and heap:
            node = heapq.heappop(heap)[-1]
            num_freed += 1
            if not node.children and node.lock_ref == 0:
                freed.append(node.value)
                self._remove_leaf(node)
            else:
                self._drop_snapshot(node)
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return num_freed


def _depth(node: TreeNode) -> int:
    """Nodes on the path from the root to `node`."""
    n = 0
    while node.parent is not None:
        n += 1
        node = node.parent
    return n


def _path_len(node: TreeNode) -> int:
    """Tokens on the path from the root to `node`."""
    n = 0
    while node.parent is not None:
        n += len(node.key)
        node = node.parent
    return n
