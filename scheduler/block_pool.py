"""`BlockPool`: the device KV blocks as metadata — reference counts, the free LRU queue and
the prefix-cache map from block content to block id. No tensors.

A block is in exactly one of three places::

    held    ref > 0          owned by one or more live requests (shared prefix blocks)
    free    ref == 0         in `free_queue`; may still hold a cached prefix (hash set)
                             until it is popped for reuse, which evicts the hash

`free_queue` is ordered oldest first: blocks without a cached prefix sit at the front so
that they are reused before any cached content is evicted; cached blocks leave from the
front in least-recently-freed order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

# A cached block's key: (hash of the parent block's key, the block's token ids). Keying by
# the tokens themselves makes a match exact for the block; the parent is identified by a
# 64-bit hash (a collision there is ~2^-64 per lookup).
BlockKey = tuple[int, tuple[int, ...]]


class BlockPool:
    """Owns `num_blocks` device block ids: allocation, ref counts, eviction, prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[BlockKey | None] = [None] * num_blocks
        self.cached: dict[BlockKey, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_cached_free = 0  # free blocks that still hold a cached prefix

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def lookup(self, key: BlockKey) -> int | None:
        return self.cached.get(key) if self.enable_caching else None

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of `block_ids` (cache hits) are currently in the free queue."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def allocate(self, n: int) -> list[int]:
        """Pop `n` blocks from the front of the free queue (evicting their cached content)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"allocate({n}) with only {len(self.free_queue)} free blocks")
        out: list[int] = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            key = self.block_keys[block]
            if key is not None:
                del self.cached[key]
                self.block_keys[block] = None
                self.num_cached_free -= 1
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on cached blocks (a prefix-cache hit)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
                self.num_cached_free -= self.block_keys[b] is not None
            self.ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; pass a request's blocks tail first so that the
        end of a sequence is evicted before its (more shareable) beginning."""
        for b in block_ids:
            rc = self.ref_counts[b]
            if rc <= 0:
                raise RuntimeError(f"block {b} freed with ref count {rc}")
            self.ref_counts[b] = rc - 1
            if rc == 1:
                self.free_queue[b] = None
                if self.block_keys[b] is None:
                    self.free_queue.move_to_end(b, last=False)
                else:
                    self.num_cached_free += 1

    def cache(self, block: int, key: BlockKey) -> None:
        """Register a full block's content. A block whose content is already cached elsewhere
        stays uncached (its twin serves future hits)."""
        if not self.enable_caching or self.block_keys[block] is not None or key in self.cached:
            return
        self.cached[key] = block
        self.block_keys[block] = key

    def check_integrity(self, holders: dict[int, int]) -> None:
        """`holders`: block id -> number of live requests holding it."""
        for b in range(self.num_blocks):
            rc = self.ref_counts[b]
            assert rc == holders.get(b, 0), (
                f"block {b}: ref count {rc} != {holders.get(b, 0)} holders"
            )
            assert (rc == 0) == (b in self.free_queue), (
                f"block {b}: ref {rc} but free={b in self.free_queue}"
            )
        for key, b in self.cached.items():
            assert self.block_keys[b] == key, f"cached block {b} has a stale key"
        cached_free = sum(1 for b in self.free_queue if self.block_keys[b] is not None)
        assert cached_free == self.num_cached_free, (
            f"{self.num_cached_free} cached free blocks counted, {cached_free} found"
        )
        assert self.num_used + self.num_free == self.num_blocks
