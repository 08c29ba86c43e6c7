"""The portable attention backend on torch SDPA, and the Python-driven backends' base."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention.kv_rows import cache_values
from worker.attention.metadata import AttentionMetadata, KVCacheLayer, PrefillSpan, write_kv


def gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Blocks of one layer's K or V, concatenated: [len(block_ids) * block_size, heads, D],
    written into `out` (a flat buffer with room for them) when given.

    index_select over whole flattened blocks copies contiguous rows; advanced indexing with
    the same ids runs element-wise and measured 4x slower on CPU.
    """
    flat = cache.view(cache.shape[0], -1)
    if out is None:
        rows = flat.index_select(0, block_ids)
    else:
        rows = torch.index_select(
            flat, 0, block_ids, out=out[: block_ids.numel() * flat.shape[1]].view(-1, flat.shape[1])
        )
    return rows.view(-1, *cache.shape[2:])


class GatherWorkspace:
    """Two flat buffers (K and V) that every layer's gather reuses, grown to the largest
    step seen. Without them each layer allocates its gathered K/V afresh: at 128 decodes x
    256 tokens that is 25 MB per tensor, above glibc's mmap threshold, so every layer
    mapped and faulted in fresh pages: bench/gather_workspace.py measured decode attention
    1.4-1.7x slower that way at 128 x 256 (SmolLM2 shape, 2 threads)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def gather(self, cache: torch.Tensor, block_ids: torch.Tensor, which: int) -> torch.Tensor:
        need = block_ids.numel() * cache[0].numel()
        buf = self._buffers[which]
        if (
            buf is None
            or buf.numel() < need
            or buf.dtype != cache.dtype
            or buf.device != cache.device
        ):
            buf = self._buffers[which] = torch.empty(need, dtype=cache.dtype, device=cache.device)
        return gather_blocks(cache, block_ids, out=buf)


class PythonBackend:
    """What the backends driven from Python share: the caches, the bound step, and the KV
    write each layer starts with."""

    def __init__(self) -> None:
        self.kv_layers: list[KVCacheLayer] = []
        self.meta: AttentionMetadata | None = None

    def set_cache(self, kv_layers: list[KVCacheLayer]) -> None:
        self.kv_layers = kv_layers

    def bind(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def _write(
        self, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> tuple[AttentionMetadata, KVCacheLayer]:
        """Write this layer's new K/V into the cache; the step's metadata and the layer's cache."""
        meta, kv_cache = self.meta, self.kv_layers[layer]
        assert meta is not None, "attention called outside a step"
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return meta, kv_cache


class TorchAttention(PythonBackend):
    """Portable backend on torch SDPA: decodes batched over a padded gather of their blocks,
    each prefill chunk attended on its own with a bottom-right causal mask."""

    name = "torch"

    def __init__(self) -> None:
        super().__init__()
        # Shared by all layers: each layer's attention is done with its gathered K/V
        # before the next layer gathers.
        self.workspace = GatherWorkspace()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        meta, kv_cache = self._write(k, v, layer)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], kv_cache, meta)
        for span in meta.prefills:
            out[span.token_start : span.token_end] = self._prefill(q, k, v, kv_cache, span)
        return out

    def _decode(
        self, q: torch.Tensor, kv_cache: KVCacheLayer, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert meta.decode_key_mask is not None
        n, length = meta.num_decodes, meta.decode_key_mask.shape[-1]
        tables = meta.block_tables[:n, : length // meta.block_size].flatten()
        keys = (
            self.workspace.gather(kv_cache[0], tables, 0)
            .view(n, length, *kv_cache[0].shape[2:])
            .transpose(1, 2)
        )
        values = (
            self.workspace.gather(kv_cache[1], tables, 1)
            .view(n, length, *kv_cache[1].shape[2:])
            .transpose(1, 2)
        )
        # The q heads sharing a kv head become that head's "query rows": one single-token
        # query each, same keys, so no GQA expansion (copy) of K/V is needed.
        kv_heads = keys.shape[1]
        grouped = q.view(n, kv_heads, q.shape[1] // kv_heads, q.shape[2])
        out = F.scaled_dot_product_attention(
            grouped, cache_values(keys, q.dtype), cache_values(values, q.dtype),
            attn_mask=meta.decode_key_mask,
        )
        return out.reshape(q.shape)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheLayer,
        span: PrefillSpan,
    ) -> torch.Tensor:
        n = span.token_end - span.token_start
        query = q[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)
        # nothing cached before this chunk: the fresh K/V directly, unless the cache rounds
        # them to int8 (then every chunk reads the cache, as the C++ chunk kernel does)
        if span.seq_len == n and kv_cache[0].dtype != torch.int8:
            keys, values = (
                k[span.token_start : span.token_end],
                v[span.token_start : span.token_end],
            )
            mask, causal = None, True
        else:
            keys = self.workspace.gather(kv_cache[0], span.block_ids, 0)[: span.seq_len]
            values = self.workspace.gather(kv_cache[1], span.block_ids, 1)[: span.seq_len]
            # query i sits at position seq_len - n + i and sees keys at positions <= its own
            key_pos = torch.arange(span.seq_len, device=q.device)
            mask, causal = key_pos <= (key_pos[-n:, None]), False
        out = F.scaled_dot_product_attention(
            query,
            cache_values(keys, q.dtype).transpose(0, 1).unsqueeze(0),
            cache_values(values, q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)
