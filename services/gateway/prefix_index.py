"""The gateway's approximate picture of each worker's prefix cache, for cache-aware routing.

The gateway routes before the prompt is tokenized, so it indexes the request as bytes (its text, its
chat messages, or its token ids) cut into blocks of `block_bytes`. Block i is identified by a hash
chained over blocks 0..i, so a hit on block i means the whole prefix up to it was sent to that worker
before (hash collisions aside). A worker's set keeps its most recently used `max_blocks` block
hashes, like an LRU over the worker's real radix cache; the worker may have evicted more, which only
costs a routing miss, never a wrong answer.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable

from shared.protocol import ChatMessage


def routing_key(text: str | None, messages: list[ChatMessage] | None, input_ids: list[int] | None) -> bytes:
    """The bytes a request's prompt starts with, so two requests sharing a prompt prefix share a key
    prefix. Messages are joined role, content, role, content... with separators that cannot occur in
    UTF-8 text; token ids are C ints (4 bytes each here)."""
    if text is not None:
        return text.encode()
    if messages is not None:
        parts: list[bytes] = []
        for message in messages:
            parts += [message.role.encode(), b"\xff", message.content.encode(), b"\xfe"]
        return b"".join(parts)
    if input_ids is not None:
        return array("i", input_ids).tobytes()
    return b""


class PrefixIndex:
    """Per worker, the chained hashes of the prompt blocks recently routed to it."""

    def __init__(self, block_bytes: int = 16, max_blocks: int = 1 << 17) -> None:
        if block_bytes < 1 or max_blocks < 1:
            raise ValueError(f"block_bytes and max_blocks must be >= 1, got {block_bytes} and {max_blocks}")
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def chain(self, key: bytes) -> list[int]:
        """The key's block hashes, block i's chained over blocks 0..i (matched_bytes and record take it, so
        one routing decision hashes its key once)."""
        hashes: list[int] = []
        h = 0
        for start in range(0, len(key) - self.block_bytes + 1, self.block_bytes):
            h = hash((h, key[start : start + self.block_bytes]))
            hashes.append(h)
        return hashes

    def matched_bytes(self, key: bytes, workers: Iterable[str], chain: list[int] | None = None) -> dict[str, int]:
        """For each of `workers`, how many leading bytes of `key` it was sent before (whole blocks).
        `chain`: self.chain(key), where the caller has it."""
        chain = self.chain(key) if chain is None else chain
        out: dict[str, int] = {}
        for worker in workers:
            blocks = self._blocks.get(worker)
            n = 0
            if blocks:
                for h in chain:
                    if h not in blocks:
                        break
                    n += 1
            out[worker] = n * self.block_bytes
        return out

    def record(self, worker: str, key: bytes, chain: list[int] | None = None) -> None:
        """`key` was routed to `worker`: its blocks become that worker's most recent. `chain`: as in
        matched_bytes."""
        blocks = self._blocks.setdefault(worker, OrderedDict())
        for h in self.chain(key) if chain is None else chain:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def forget(self, worker: str) -> None:
        """A worker died or flushed its cache."""
        self._blocks.pop(worker, None)

    def size(self, worker: str) -> int:
        """How many blocks are held for `worker`."""
        return len(self._blocks.get(worker, ()))
