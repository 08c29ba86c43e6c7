"""Paged attention's per-step data: the metadata every backend reads, the backends'
contract, and the KV write each of them starts with.


Token layout of one step (requests ordered decodes first, then prefill chunks)::

    flattened tokens:  | d0 | d1 | p0 p0 p0 p0 | p1 p1 |      T = query_start_loc[-1]
    query_start_loc:   0    1    2             6       8
    request p0 computes positions [num_computed, seq_len) and attends to [0, seq_len)

A token at position p of a request lives in cache slot
``block_table[p // block_size] * block_size + p % block_size`` (its `slot_mapping` entry).
Backends write the step's new K/V at those slots first, then attend over the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from worker.attention.kv_rows import quantize_rows

KVCacheLayer = tuple[
    torch.Tensor, torch.Tensor
]  # K, V: [num_blocks, block_size, kv_heads, row] (row: head_dim values; kv_rows for int8)


@dataclass(frozen=True)
class PrefillSpan:
    """One request with more than one query token (python ints, for the per-request loop)."""

    token_start: int  # first of its tokens in the flattened batch
    token_end: int
    seq_len: int  # context length after this step (positions [0, seq_len) are attended)
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64 on the device


@dataclass(eq=False)
class AttentionMetadata:
    """Everything attention needs for one step, built once per step by the input batch; the
    torch backend's extras (decode mask, prefill spans) only when it asks for them."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: token offsets per request
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with valid block ids
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first num_decodes requests have exactly one query token
    block_size: int
    starts: list[int]  # query_start_loc as Python ints
    seq_lens_list: list[int]  # seq_lens as Python ints

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @cached_property
    def decode_key_mask(self) -> torch.Tensor | None:
        """[num_decodes, 1, 1, L] bool: key slot valid, over the decodes' padded blocks."""
        n = self.num_decodes
        if not n:
            return None
        blocks = -(-max(self.seq_lens_list[:n]) // self.block_size)
        key_pos = torch.arange(blocks * self.block_size, device=self.seq_lens.device)
        return (key_pos[None, :] < self.seq_lens[:n, None]).view(n, 1, 1, -1)

    @cached_property
    def prefills(self) -> tuple[PrefillSpan, ...]:
        """The requests after the decodes."""
        bs = self.block_size
        return tuple(
            PrefillSpan(self.starts[i], self.starts[i + 1], self.seq_lens_list[i],
                        self.block_tables[i, : -(-self.seq_lens_list[i] // bs)].long())
            for i in range(self.num_decodes, len(self.seq_lens_list))
        )


class AttentionBackend(Protocol):
    """Writes this step's K/V into the cache and returns attention output [T, heads, D]."""

    name: str

    def set_cache(self, kv_layers: list[KVCacheLayer]) -> None:
        """The per-layer caches that `forward` reads and writes."""

    def bind(self, meta: AttentionMetadata) -> None:
        """The step about to run."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor: ...


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCacheLayer, slots: torch.Tensor) -> None:
    """Scatter the new tokens' K/V [T, kv_heads, D] into their cache slots (quantized into an
    int8 cache's rows)."""
    for new, cache in zip((k, v), kv_cache, strict=True):
        rows = quantize_rows(new) if cache.dtype == torch.int8 else new.to(cache.dtype)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)
