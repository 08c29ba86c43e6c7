"""`KVCacheManager`: which blocks each request holds, prefix-cache lookups, and the host
(swap) pool. The scheduler asks `allocate_slots(request, n)` and gets blocks or None.

Blocks of a request with `block_size` B cover its token positions like this::

    positions  0 ........ B-1 | B ....... 2B-1 | 2B .. (num_computed + n - 1)
    blocks     [    b0        |     b1         |   b2 (partly filled)       ]

A block is cached (hashed) once every position in it is computed *and* its token ids are
known; with two plans in flight, a sampled-but-unreceived token is computed but unknown.
"""

from __future__ import annotations

from typing import NamedTuple

from common.arith import cdiv
from scheduler.block_pool import BlockKey, BlockPool
from scheduler.config import SchedulerConfig
from scheduler.request import Request


class BlockMap(NamedTuple):
    """Who holds which device block right now (a copy: reading it changes nothing)."""

    tables: dict[str, list[int]]  # request id -> its block table
    shared: dict[int, int]  # block -> ref count, for blocks held by more than one request
    cached_free: list[int]  # free blocks that still hold a cached prefix


class KVCacheManager:
    """Per-request block tables over one `BlockPool`, plus host swap slots."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_gpu_blocks, config.enable_prefix_caching)
        self.num_cpu_blocks = config.num_cpu_blocks
        self.host_free: list[int] = list(range(config.num_cpu_blocks - 1, -1, -1))
        # Host slots read by this step's swap-ins; the worker runs swap-outs first, so they
        # must not be handed to a swap-out before the next step.
        self.host_released: list[int] = []
        self.blocks: dict[str, list[int]] = {}
        self.host_blocks: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}  # leading blocks of a request already hashed
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- prefix cache -------------------------------------------------------------
    def _block_key(self, request: Request, i: int) -> BlockKey:
        """Key of block i; the hashes of blocks before it must be known."""
        parent = request.block_hashes[i - 1] if i else 0
        return parent, request.token_slice(i * self.block_size, (i + 1) * self.block_size)

    def _key_at(self, request: Request, i: int) -> BlockKey:
        """Key of block i, memoising the chained hashes of blocks up to it on the request."""
        hashes = request.block_hashes
        while len(hashes) <= i:
            hashes.append(hash(self._block_key(request, len(hashes))))
        return self._block_key(request, i)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix; leaves at least one token to compute.
        None for a request that asks for its prompt's logprobs: a hit would skip positions
        whose logprobs it needs, so it computes them all (its blocks are cached for others)."""
        if not self.pool.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        for i in range((request.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(self._key_at(request, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, request: Request, num_computed: int | None = None) -> None:
        """Register the request's full blocks whose positions are all computed (or, with
        `num_computed`, planned in the current step) and whose token ids are known."""
        if not self.pool.enable_caching:
            return
        computed = request.num_computed_tokens if num_computed is None else num_computed
        num_full = min(computed, request.num_tokens) // self.block_size
        done = self.num_cached.get(request.request_id, 0)
        if num_full <= done:
            return
        blocks = self.blocks[request.request_id]
        for i in range(done, num_full):
            self.pool.cache(blocks[i], self._key_at(request, i))
        self.num_cached[request.request_id] = num_full

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # ---- allocation -----------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make room for positions up to num_computed + hits + num_new_tokens.

        Returns the newly allocated block ids (cache hits not included), or None — with
        nothing changed — when the pool cannot serve it.
        """
        hits = cached_blocks or []
        held = self.blocks.setdefault(request.request_id, [])
        num_total = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        need = cdiv(num_total, self.block_size) - len(held) - len(hits)
        if need <= 0 and not hits:
            return []  # the common decode: the last block still has room
        # Hits sitting in the free queue stop being allocatable once touched.
        if max(need, 0) + self.pool.num_free_among(hits) > self.pool.num_free:
            if not held:
                del self.blocks[request.request_id]
            return None
        self.pool.touch(hits)
        held.extend(hits)
        new = self.pool.allocate(need) if need > 0 else []
        held.extend(new)
        return new

    def free(self, request: Request) -> None:
        """Release everything the request holds, device and host."""
        rid = request.request_id
        self.pool.free(reversed(self.blocks.pop(rid, [])))
        self.host_free.extend(self.host_blocks.pop(rid, []))
        self.num_cached.pop(rid, None)

    def block_ids(self, request_id: str) -> list[int]:
        return self.blocks.get(request_id, [])

    def blocks_freed_by(self, request: Request) -> int:
        """Device blocks that freeing `request` would return to the pool (not shared)."""
        refs = self.pool.ref_counts
        return sum(1 for b in self.blocks.get(request.request_id, ()) if refs[b] == 1)

    # ---- swap -------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return len(self.blocks.get(request.request_id, ())) <= len(self.host_free)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to host slots; returns (device, host) pairs."""
        device = self.blocks.pop(request.request_id, [])
        host = [self.host_free.pop() for _ in device]
        self.host_blocks[request.request_id] = host
        self.num_cached.pop(request.request_id, None)
        self.pool.free(reversed(device))
        return list(zip(device, host, strict=True))

    def swap_in(
        self, request: Request, num_new_tokens: int
    ) -> tuple[list[tuple[int, int]], list[int]] | None:
        """Bring a swapped request back with room for `num_new_tokens` more; returns the
        (host, device) pairs and the whole new block table, or None if it does not fit."""
        host = self.host_blocks[request.request_id]
        need = max(cdiv(request.num_computed_tokens + num_new_tokens, self.block_size), len(host))
        if need > self.pool.num_free:
            return None
        device = self.pool.allocate(need)
        del self.host_blocks[request.request_id]
        self.host_released.extend(host)
        self.blocks[request.request_id] = device
        return list(zip(host, device[: len(host)], strict=True)), device

    def end_step(self) -> None:
        """The plan is final: slots read by its swap-ins may be reused from the next step."""
        self.host_free.extend(self.host_released)
        self.host_released.clear()

    # ---- accounting ---------------------------------------------------------------------
    def block_map(self) -> BlockMap:
        """A read-only picture of the device blocks for the live view: O(held + free)."""
        refs, keys = self.pool.ref_counts, self.pool.block_keys
        tables = {rid: list(blocks) for rid, blocks in self.blocks.items() if blocks}
        shared = {b: refs[b] for blocks in tables.values() for b in blocks if refs[b] > 1}
        cached_free = [b for b in self.pool.free_queue if keys[b] is not None]
        return BlockMap(tables, shared, cached_free)

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def check_integrity(self, live: set[str]) -> None:
        holders: dict[int, int] = {}
        for rid, blocks in self.blocks.items():
            assert rid in live, f"blocks held by dead request {rid}"
            assert len(set(blocks)) == len(blocks), f"request {rid} holds a block twice"
            for b in blocks:
                holders[b] = holders.get(b, 0) + 1
        self.pool.check_integrity(holders)
        host_held = [h for hs in self.host_blocks.values() for h in hs]
        assert all(r in live for r in self.host_blocks), "host blocks held by a dead request"
        host_free = self.host_free + self.host_released
        assert len(host_held) + len(host_free) == self.num_cpu_blocks, "host slots leaked"
        assert len(set(host_held) | set(host_free)) == self.num_cpu_blocks, "host slot twice"
