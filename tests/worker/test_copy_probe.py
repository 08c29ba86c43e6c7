"""The start-up copy-bandwidth probe: a positive rate with and without a host swap pool,
and the KV cache left as it was (it copies blocks out and back)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from worker.execution.copy_probe import measure_copy_bandwidth
from worker.execution.kv_cache import KVCache

SHAPE = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("swap_gib", [0.0, 0.001])
def test_bandwidth_is_measured_and_the_cache_unchanged(swap_gib: float) -> None:
    kv = KVCache(SHAPE, 32, 16, torch.float32, torch.device("cpu"), swap_gib)  # type: ignore[arg-type]
    assert (kv.num_host_blocks > 0) == (swap_gib > 0)
    kv.device_cache.copy_(torch.randn_like(kv.device_cache))
    before = kv.device_cache.clone()
    rate = measure_copy_bandwidth(kv)
    assert 1e6 < rate < 1e13  # bytes/s: anything from a slow link to a cache-resident memcpy
    assert torch.equal(kv.device_cache, before)


def test_probe_fits_a_tiny_pool() -> None:
    kv = KVCache(SHAPE, 2, 16, torch.float32, torch.device("cpu"), 1e-5)  # type: ignore[arg-type]
    assert kv.num_blocks == 2 and measure_copy_bandwidth(kv, max_blocks=16) > 0
