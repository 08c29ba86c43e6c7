"""The host <-> device copy bandwidth of this worker's KV cache, measured at start-up.

`preemption_mode="auto"` weighs a swap (KV out to the host pool and back) against
recomputing the KV; the swap side is priced at this rate. It is measured with the swap
code itself (`KVCache.swap_out` / `swap_in` between device blocks and the host pool), on
blocks no request holds yet; without a host pool, a plain copy of the same blocks to a
host tensor stands in. On a CPU worker both sides are the same RAM, so it is a memcpy.
"""

from __future__ import annotations

import time

import torch

from worker.execution.kv_cache import KVCache

PROBE_BLOCKS = 16  # a few MB for a small model: well under a millisecond to tens of ms
REPEATS = 3


def measure_copy_bandwidth(
    kv: KVCache, max_blocks: int = PROBE_BLOCKS, repeats: int = REPEATS
) -> float:
    """Bytes per second of one direction (the best of `repeats` round trips)."""
    n = min(max_blocks, kv.num_blocks, kv.num_host_blocks or kv.num_blocks)
    pairs = tuple((i, i) for i in range(n))
    blocks = kv.device_cache[:, :, :n]
    scratch = None if kv.host_cache is not None else torch.empty(
        blocks.shape, dtype=blocks.dtype, device="cpu", pin_memory=blocks.is_cuda)
    best = float("inf")
    for _ in range(repeats):
        _sync(kv)
        start = time.perf_counter()
        if scratch is None:
            kv.swap_out(pairs)
            kv.swap_in(pairs)
        else:
            scratch.copy_(blocks)
            blocks.copy_(scratch)
        _sync(kv)
        best = min(best, time.perf_counter() - start)
    return 2 * n * kv.block_bytes / best if best > 0 else 0.0


def _sync(kv: KVCache) -> None:
    if kv.device_cache.is_cuda:
        torch.cuda.synchronize(kv.device_cache.device)
