# Over 400 lines: tree, eviction and request glue share private state; the hybrid cache's hooks add a few.
"""RadixAttention prefix cache: a compressed prefix tree over token ids whose values are KV slots.

Each edge holds a run of token ids (`key`) and the KV slots of those tokens (`value`, same length).
A request that shares a prefix with an earlier one reuses the earlier slots instead of recomputing.

Ownership of KV slots, which the scheduler checks after every step:

    allocator.available_size() + evictable_size() + protected_size() + (slots that running requests
    hold outside the tree) == total slots

A node is *protected* while some running request has locked a path through it (`inc_lock_ref`),
otherwise *evictable*: `evict` frees unlocked leaves in the order of the eviction policy, and a parent
whose last child went becomes a leaf in turn.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from services.worker.mem.eviction_policy import eviction_key
from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

_EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the radix tree and the node at its end.

    `children` are keyed by the first token of their edge. `lock_ref` counts the running requests
    whose locked path goes through this node. The remaining fields feed the eviction policies.
    """

    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "lock_ref",
        "last_access_time",
        "hit_count",
        "creation_order",
        "priority",
    )

    def __init__(
        self,
        key: list[int],
        value: torch.Tensor,
        parent: TreeNode | None,
        creation_order: int,
        priority: int = 0,
    ) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = 0
        self.hit_count = 0
        self.creation_order = creation_order
        self.priority = priority

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a key: its KV slots (int64, CPU) and the node ending it."""

    indices: torch.Tensor
    last_node: TreeNode


class CacheableReq(Protocol):
    """What the cache reads and updates on a request (the scheduler's Req has these attributes)."""

    req_pool_idx: int | None
    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    prefix_indices: torch.Tensor
    last_node: TreeNode | None
    priority: int
    kv_committed_len: int


def _common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    """Length of the common prefix of `edge` and key[start:]."""
    n = min(len(edge), len(key) - start)
    # Whole-edge matches are the common case; a slice comparison runs them in C.
    if key[start : start + n] == (edge if n == len(edge) else edge[:n]):
        return n
    for i in range(n):
        if edge[i] != key[start + i]:
            return i
    return n


class RadixCache:
    """Prefix cache over KV slots, shared by all requests of one worker.

    `eviction_policy` is one of "lru" (default), "lfu", "fifo", "filo", "mru", "priority".
    With `disable=True` nothing is shared: matches are empty and finished requests free their slots.
    Subclasses (the hybrid cache) extend `node_type`, `_remove_leaf` and `_on_req_cached`.
    """

    node_type: type[TreeNode] = TreeNode

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        eviction_policy: str = "lru",
        disable: bool = False,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.eviction_policy = eviction_policy
        self._eviction_key = eviction_key(eviction_policy)
        self.disable = disable
        # A logical clock: deterministic, and strictly increasing across operations.
        self._clock = itertools.count(1)
        self._creation = itertools.count()
        self.reset()

    def reset(self) -> None:
        """Drop the whole tree without freeing its slots.

        The caller guarantees no request is running and clears the allocator and the
        ReqToTokenPool itself (a flush); freeing here too would hand slots out twice after
        `allocator.clear()`.
        """
        self.root = self.node_type([], _EMPTY_SLOTS, None, next(self._creation))
        self._evictable_size = 0
        self._protected_size = 0
        # Unlocked nodes without children: the candidates of `evict`, kept up to date incrementally.
        self._evictable_leaves: set[TreeNode] = set()

    # Sizes, in tokens.

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        """Tokens in the tree, counted by walking it (a check on the incremental sizes)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += len(node.key)
            stack.extend(node.children.values())
        return total

    # Lookup and insertion.

    def match_prefix(self, key: list[int]) -> MatchResult:
        """The longest cached prefix of `key`.

        A match ending inside an edge splits it, so `last_node`'s path is exactly the matched prefix
        (and locking it protects exactly that). Touches access time and hit count along the path.
        """
        return self._match_kv(key)

    def _match_kv(self, key: list[int]) -> MatchResult:
        """match_prefix over KV alone: what the request glue uses whatever a subclass matches."""
        if self.disable or not key:
            return MatchResult(_EMPTY_SLOTS, self.root)
        if not isinstance(key, list):
            key = list(key)  # list slices compare in C; a tuple never equals a list
        node, _, path = self._descend(key, next(self._clock))
        for child in path:
            child.hit_count += 1
        indices = torch.cat([child.value for child in path]) if path else _EMPTY_SLOTS
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor, priority: int = 0) -> int:
        """Cache `value` (KV slots) for `key`; returns the length of the prefix that was already cached.

        The tree keeps its own slots for that prefix, so the caller frees value[:returned length]
        when those slots are its own. The rest of `value` now belongs to the tree.
        """
        return self._insert(key, value, priority)[0]

    def _insert(self, key: list[int], value: torch.Tensor, priority: int) -> tuple[int, TreeNode]:
        """insert, also returning the node whose path is exactly `key` (the root for an empty key)."""
        if value.numel() != len(key):
            raise ValueError(f"value must have one slot per key token: {value.numel()} != {len(key)}")
        if self.disable or not key:
            return 0, self.root
        if not isinstance(key, list):
            key = list(key)  # edges are lists: see match_prefix
        now = next(self._clock)
        node, i, path = self._descend(key, now)
        for child in path:
            child.priority = max(child.priority, priority)
        if i < len(key):
            node = self._add_leaf(node, key[i:], value[i:], priority, now)
        return i, node

    def _descend(self, key: list[int], now: int) -> tuple[TreeNode, int, list[TreeNode]]:
        """Walk down from the root along `key` as far as the tree holds it, splitting an edge the key
        ends inside (so the last node's path is exactly the part held). Returns that last node, how
        many tokens of the key its path holds, and the nodes passed below the root, each with its
        access time now `now`."""
        node, i, path = self.root, 0, []
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_prefix_len(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            path.append(child)
            node, i = child, i + n
        return node, i, path

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; returns the new node holding the first part.

        The new node sits on every path that went through `child`, so it takes over child's lock
        count and policy state; the sizes do not change.
        """
        parent = child.parent
        assert parent is not None
        mid = self.node_type(child.key[:n], child.value[:n], parent, child.creation_order, child.priority)
        mid.lock_ref = child.lock_ref
        mid.last_access_time = child.last_access_time
        mid.hit_count = child.hit_count
        parent.children[child.key[0]] = mid
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = mid
        mid.children[child.key[0]] = child
        return mid

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, priority: int, now: int
    ) -> TreeNode:
        # Own copy: the caller's tensor may be a view it reuses, and a view would pin its storage.
        slots = value.to("cpu", torch.int64).clone()
        leaf = self.node_type(key, slots, parent, next(self._creation), priority)
        leaf.last_access_time = now
        parent.children[key[0]] = leaf
        self._evictable_leaves.discard(parent)
        self._evictable_leaves.add(leaf)
        self._evictable_size += len(key)
        return leaf

    # Locking.

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path from `node` to the root; returns the change of evictable size (<= 0)."""
        if self.disable:
            return 0
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta -= len(node.key)
                # Only the first node of the walk can be a leaf; the others have it as a child.
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one `inc_lock_ref(node)`; returns the change of evictable size (>= 0)."""
        if self.disable:
            return 0
        # Ancestors carry at least the node's count, so checking the node checks the whole path.
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError("node.lock_ref would go below zero: dec_lock_ref without inc_lock_ref")
        delta = 0
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta += len(node.key)
                if not node.children:
                    self._evictable_leaves.add(node)
            assert node.parent is not None
            node = node.parent
        return delta

    # Eviction.

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves (fewer if not that many are
        evictable), in policy order; returns the number of slots freed."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if self.disable or num_tokens == 0:
            return 0
        tie = itertools.count()  # heap entries never compare nodes
        heap = [(self._eviction_key(leaf), next(tie), leaf) for leaf in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            freed.append(leaf.value)
            num_freed += len(leaf.key)
            parent = self._remove_leaf(leaf)
            if parent in self._evictable_leaves:
                heapq.heappush(heap, (self._eviction_key(parent), next(tie), parent))
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return num_freed

    def _remove_leaf(self, leaf: TreeNode) -> TreeNode:
        """Unlink an unlocked leaf (the caller frees its KV slots); returns its parent."""
        parent = leaf.parent
        assert parent is not None and leaf.lock_ref == 0 and not leaf.children
        del parent.children[leaf.key[0]]
        self._evictable_leaves.discard(leaf)
        self._evictable_size -= len(leaf.key)
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            self._evictable_leaves.add(parent)
        return parent

    def _on_req_cached(self, req: CacheableReq, key: list[int], node: TreeNode) -> None:
        """Hook: req's tokens `key` are in the tree, ending at `node`; its row is live."""

    # Request glue.

    def cache_finished_req(self, req: CacheableReq) -> None:
        """Hand a finished request's KV to the tree, free what the tree already had, release the
        request's lock and its ReqToTokenPool row.

        Positions kv_committed_len.. have no KV written and are not looked at. A committed position
        past the request's tokens (none normally) has its slot freed.
        """
        row = req.req_pool_idx
        if row is None:
            raise ValueError("req.req_pool_idx is None: the request holds no ReqToTokenPool row")
        kv = self.req_to_token_pool.read(row, 0, req.kv_committed_len)
        if self.disable:
            self.token_to_kv_pool_allocator.free(kv)
            self.req_to_token_pool.free(row)
            return
        token_ids = (req.origin_input_ids + req.output_ids)[: req.kv_committed_len]
        num_tokens = len(token_ids)
        num_cached, node = self._insert(token_ids, kv[:num_tokens], req.priority)
        self._on_req_cached(req, token_ids, node)
        allocator = self.token_to_kv_pool_allocator
        allocator.free(kv[len(req.prefix_indices) : num_cached])
        allocator.free(kv[num_tokens:])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """Cache the KV a running request has so far (after a prefill chunk, or any extend) and move
        its lock to the new end, so later chunks and other requests share it.

        The request's positions then point at the tree's slots: where another request had cached
        the same tokens first, the request's own copies are freed and req_to_token is rewritten.
        When disabled, prefix_indices becomes all the request's slots, which stay its own to free.
        """
        row = req.req_pool_idx
        if row is None:
            raise ValueError("req.req_pool_idx is None: the request holds no ReqToTokenPool row")
        token_ids = req.fill_ids[: req.kv_committed_len]
        kv = self.req_to_token_pool.read(row, 0, len(token_ids))
        if self.disable:
            req.prefix_indices = kv
            return
        num_old_prefix = len(req.prefix_indices)
        num_cached, node = self._insert(token_ids, kv, req.priority)
        self._on_req_cached(req, token_ids, node)
        self.token_to_kv_pool_allocator.free(kv[num_old_prefix:num_cached])
        match = self._match_kv(token_ids)
        self.req_to_token_pool.write(row, num_old_prefix, match.indices[num_old_prefix:])
        # Lock the new path before unlocking the old one, so the shared part never looks evictable.
        self.inc_lock_ref(match.last_node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.prefix_indices = match.indices
        req.last_node = match.last_node

    # Debugging.

    def pretty_print(self) -> str:
        """The tree as indented text, one node per line: key, slots, lock count."""
        lines: list[str] = []
        stack: list[tuple[TreeNode, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            if node is not self.root:
                lines.append(f"{'  ' * depth}{node.key} -> {node.value.tolist()} lock={node.lock_ref}")
            stack.extend((child, depth + 1) for child in reversed(node.children.values()))
        return "\n".join(lines)
