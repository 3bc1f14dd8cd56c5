"""Eviction policies of the radix cache: which unlocked leaf goes first.

A policy is a sort key over tree nodes; `RadixCache.evict` keeps its evictable leaves in a min-heap
by that key, so the node with the smallest key is evicted first. A key reads only the usage fields
below (`NodeStats`), which the radix cache's TreeNode carries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class NodeStats(Protocol):
    """What an eviction policy reads of a tree node."""

    last_access_time: int
    hit_count: int
    creation_order: int
    priority: int


EvictionKey = Callable[[NodeStats], tuple[int, ...]]


def _lru(node: NodeStats) -> tuple[int, ...]:
    return (node.last_access_time,)


def _mru(node: NodeStats) -> tuple[int, ...]:
    return (-node.last_access_time,)


def _lfu(node: NodeStats) -> tuple[int, ...]:
    # Ties between equally popular nodes go to the least recently used.
    return (node.hit_count, node.last_access_time)


def _fifo(node: NodeStats) -> tuple[int, ...]:
    return (node.creation_order,)


def _filo(node: NodeStats) -> tuple[int, ...]:
    return (-node.creation_order,)


def _priority(node: NodeStats) -> tuple[int, ...]:
    # Lowest priority first; LRU among equals.
    return (node.priority, node.last_access_time)


EVICTION_POLICIES: dict[str, EvictionKey] = {
    "lru": _lru,
    "lfu": _lfu,
    "fifo": _fifo,
    "filo": _filo,
    "mru": _mru,
    "priority": _priority,
}


def eviction_key(eviction_policy: str) -> EvictionKey:
    """The sort key of a policy name; ValueError for an unknown name."""
    try:
        return EVICTION_POLICIES[eviction_policy]
    except KeyError:
        raise ValueError(
            f"eviction_policy must be one of {sorted(EVICTION_POLICIES)}, got {eviction_policy!r}"
        ) from None
