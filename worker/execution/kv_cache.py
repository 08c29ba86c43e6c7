"""The paged KV cache on the device, its host swap pool, and how many blocks fit.

One tensor holds every layer: [layers, 2 (K, V), num_blocks, block_size, kv_heads, row] (a
row: head_dim values, or for int8 head_dim values and their scale, `kv_rows`),
so a swap moves a block of all layers with one indexed copy, and `layers()` hands the model
per-layer (K, V) views in the layout paged kernels expect.
"""

from __future__ import annotations

import torch

from worker.attention.kv_rows import row_width
from worker.execution.input_batch import PlanError
from worker.model.config import ModelConfig

GIB = 1 << 30


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for `block_size` tokens across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return (
        2
        * config.num_hidden_layers
        * block_size
        * config.num_key_value_heads
        * row_width(config.head_dim, dtype)
        * elem
    )


class KVCache:
    """Device KV blocks plus an optional host pool for swapped-out blocks."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
        device: torch.device, swap_space_gib: float = 0.0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache has room for no block of {block_size} tokens; give it more memory"
            )
        self.block_size = block_size
        self.block_bytes = bytes_per_block(config, block_size, dtype)
        shape = (
            config.num_hidden_layers, 2, num_blocks, block_size, config.num_key_value_heads,
            row_width(config.head_dim, dtype),
        )
        # zeros, not empty: padded attention reads masked slots, and NaN garbage would leak through
        self.device_cache = torch.zeros(shape, dtype=dtype, device=device)
        num_host = int(swap_space_gib * GIB) // self.block_bytes
        pin = device.type == "cuda"
        self.host_cache = (
            torch.zeros((*shape[:2], num_host, *shape[3:]), dtype=dtype, pin_memory=pin)
            if num_host
            else None
        )

    @property
    def num_blocks(self) -> int:
        return int(self.device_cache.shape[2])

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host_cache is None else int(self.host_cache.shape[2])

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) views, each [num_blocks, block_size, kv_heads, row]."""
        return [(layer[0], layer[1]) for layer in self.device_cache]

    def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy (device block, host block) pairs to the host pool."""
        if not pairs:
            return
        host = self._host("swap_out")
        check_swap_pairs(pairs, (), self.num_blocks, self.num_host_blocks)
        src, dst = self._indices(pairs, self.device_cache.device, host.device)
        host.index_copy_(2, dst, self.device_cache.index_select(2, src).to(host.device))

    def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy (host block, device block) pairs back to the device."""
        if not pairs:
            return
        host = self._host("swap_in")
        check_swap_pairs((), pairs, self.num_blocks, self.num_host_blocks)
        src, dst = self._indices(pairs, host.device, self.device_cache.device)
        blocks = host.index_select(2, src).to(self.device_cache.device, non_blocking=True)
        self.device_cache.index_copy_(2, dst, blocks)

    def _host(self, op: str) -> torch.Tensor:
        if self.host_cache is None:
            raise RuntimeError(f"{op} asked, but the worker has no swap space (swap_space=0)")
        return self.host_cache

    @staticmethod
    def _indices(
        pairs: tuple[tuple[int, int], ...], src_device: torch.device, dst_device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=src_device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=dst_device)
        return src, dst


def check_swap_pairs(swap_out: tuple[tuple[int, int], ...], swap_in: tuple[tuple[int, int], ...],
                     num_device: int, num_host: int) -> None:
    """Raise `PlanError` for a swap naming a device or host block that does not exist."""
    device = [d for d, _ in swap_out] + [d for _, d in swap_in]
    host = [h for _, h in swap_out] + [h for h, _ in swap_in]
    bad = [b for b in device if not 0 <= b < num_device]
    if bad:
        raise PlanError(f"swap names device block ids {bad} outside [0, {num_device})")
    bad = [h for h in host if not 0 <= h < num_host]
    if bad:
        raise PlanError(f"swap names host block ids {bad} outside [0, {num_host})")


def num_cpu_blocks(kv_cache_memory: int, block_bytes: int) -> int:
    """Blocks that fit in the configured CPU KV budget."""
    return kv_cache_memory // block_bytes


def num_gpu_blocks(
    device: torch.device, utilization: float, peak_bytes: int, block_bytes: int
) -> int:
    """Blocks that fit in `utilization` of the GPU after the profiled peak (weights +
    activations of the largest step)."""
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, int(total * utilization) - peak_bytes) // block_bytes
