"""Paged attention: per-step metadata and the backends that read and write the KV cache.

Token layout of one step (requests ordered decodes first, then prefill chunks)::

    flattened tokens:  | d0 | d1 | p0 p0 p0 p0 | p1 p1 |      T = query_start_loc[-1]
    query_start_loc:   0    1    2             6       8
    request p0 computes positions [num_computed, seq_len) and attends to [0, seq_len)

A token at position p of a request lives in cache slot
``block_table[p // block_size] * block_size + p % block_size`` (its `slot_mapping` entry).
Backends write the step's new K/V at those slots first, then attend over the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger("stepserve.worker")

KVCacheLayer = tuple[torch.Tensor, torch.Tensor]  # K, V: [num_blocks, block_size, kv_heads, head_dim]


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor: ...


class StepAttention:
    """The model's attention: a backend over the per-layer KV cache, bound to each step's
    metadata by the runner before the forward.

    A compiled forward calls `compiled` instead: an op opaque to the compiler that takes the
    layer's index rather than its cache tensors (an op that mutated its inputs would be
    functionalized, its whole cache cloned per call), so the cache is written in place and
    the per-step metadata never becomes a guard or a recompilation.
    """

    def __init__(self, backend: AttentionBackend, kv_layers: list[KVCacheLayer]) -> None:
        self.backend = backend
        backend.set_cache(kv_layers)

    def bind(self, meta: AttentionMetadata) -> StepAttention:
        global _ACTIVE
        self.backend.bind(meta)
        _ACTIVE = self
        return self

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return self.backend.forward(q, k, v, layer)

    @property
    def compiled(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]:
        """The attention a compiled forward calls: the backend's own op when it has one (C++,
        no Python per layer), else the `stepserve::paged_attention` Python op."""
        return getattr(self.backend, "op", None) or compiled_attend


_ACTIVE: StepAttention | None = None


@torch.library.custom_op("stepserve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Write this step's K/V into layer `layer`'s cache and attend (the bound step's metadata).
    The cache write is invisible to the compiler on purpose (see `StepAttention`)."""
    assert _ACTIVE is not None, "stepserve::paged_attention called outside a step"
    return _ACTIVE.backend.forward(q, k, v, layer)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


def compiled_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The attention a compiled forward calls: one opaque op per layer."""
    return torch.ops.stepserve.paged_attention(q, k, v, layer)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCacheLayer, slots: torch.Tensor) -> None:
    """Scatter the new tokens' K/V [T, kv_heads, D] into their cache slots."""
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks of one layer's K or V, concatenated: [len(block_ids) * block_size, heads, D],
    written into `out` (a flat buffer with room for them) when given.

    index_select over whole flattened blocks copies contiguous rows; advanced indexing with
    the same ids runs element-wise and measured 4x slower on CPU.
    """
    flat = cache.view(cache.shape[0], -1)
    if out is None:
        rows = flat.index_select(0, block_ids)
    else:
        rows = torch.index_select(flat, 0, block_ids, out=out[: block_ids.numel() * flat.shape[1]].view(-1, flat.shape[1]))
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
        if buf is None or buf.numel() < need or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = self._buffers[which] = torch.empty(need, dtype=cache.dtype, device=cache.device)
        return gather_blocks(cache, block_ids, out=buf)


class _PythonBackend:
    """What the backends driven from Python share: the caches, the bound step, and the KV
    write each layer starts with."""

    def __init__(self) -> None:
        self.kv_layers: list[KVCacheLayer] = []
        self.meta: AttentionMetadata | None = None

    def set_cache(self, kv_layers: list[KVCacheLayer]) -> None:
        self.kv_layers = kv_layers

    def bind(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def _write(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[AttentionMetadata, KVCacheLayer]:
        """Write this layer's new K/V into the cache; the step's metadata and the layer's cache."""
        meta, kv_cache = self.meta, self.kv_layers[layer]
        assert meta is not None, "attention called outside a step"
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return meta, kv_cache


class TorchAttention(_PythonBackend):
    """Portable backend on torch SDPA: decodes batched over a padded gather of their blocks,
    each prefill chunk attended on its own with a bottom-right causal mask."""

    name = "torch"

    def __init__(self) -> None:
        super().__init__()
        # Shared by all layers: each layer's attention is done with its gathered K/V
        # before the next layer gathers.
        self.workspace = GatherWorkspace()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        meta, kv_cache = self._write(k, v, layer)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], kv_cache, meta)
        for span in meta.prefills:
            out[span.token_start : span.token_end] = self._prefill(q, k, v, kv_cache, span)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: KVCacheLayer, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.decode_key_mask is not None
        n, length = meta.num_decodes, meta.decode_key_mask.shape[-1]
        tables = meta.block_tables[:n, : length // meta.block_size].flatten()
        keys = self.workspace.gather(kv_cache[0], tables, 0).view(n, length, *kv_cache[0].shape[2:]).transpose(1, 2)
        values = self.workspace.gather(kv_cache[1], tables, 1).view(n, length, *kv_cache[1].shape[2:]).transpose(1, 2)
        # The q heads sharing a kv head become that head's "query rows": one single-token
        # query each, same keys, so no GQA expansion (copy) of K/V is needed.
        kv_heads = keys.shape[1]
        grouped = q.view(n, kv_heads, q.shape[1] // kv_heads, q.shape[2])
        out = F.scaled_dot_product_attention(grouped, keys.to(q.dtype), values.to(q.dtype), attn_mask=meta.decode_key_mask)
        return out.reshape(q.shape)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCacheLayer, span: PrefillSpan
    ) -> torch.Tensor:
        n = span.token_end - span.token_start
        query = q[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)
        if span.seq_len == n:  # nothing cached before this chunk: use the fresh K/V directly
            keys, values = k[span.token_start : span.token_end], v[span.token_start : span.token_end]
            mask, causal = None, True
        else:
            keys = self.workspace.gather(kv_cache[0], span.block_ids, 0)[: span.seq_len]
            values = self.workspace.gather(kv_cache[1], span.block_ids, 1)[: span.seq_len]
            # query i sits at position seq_len - n + i and sees keys at positions <= its own
            key_pos = torch.arange(span.seq_len, device=q.device)
            mask, causal = key_pos <= (key_pos[-n:, None]), False
        out = F.scaled_dot_product_attention(
            query, keys.to(q.dtype).transpose(0, 1).unsqueeze(0), values.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)


class FlashAttention(_PythonBackend):
    """flash-attn 2 varlen kernel. Paged directly when the block size is a multiple of 256
    (flash-attn's page-size rule); otherwise each request's context is gathered first."""

    name = "flash_attn"

    def __init__(self, block_size: int) -> None:
        from flash_attn import flash_attn_varlen_func

        super().__init__()
        self._varlen = flash_attn_varlen_func
        self.paged = block_size % 256 == 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        meta, kv_cache = self._write(k, v, layer)
        cu_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        if self.paged:
            keys, values, table = kv_cache[0], kv_cache[1], meta.block_tables
        else:
            slots = context_slots(meta)
            keys = kv_cache[0].flatten(0, 1).index_select(0, slots)
            values = kv_cache[1].flatten(0, 1).index_select(0, slots)
            table = None
        return self._varlen(
            q, keys, values, meta.query_start_loc, cu_k, meta.max_query_len, meta.max_seq_len,
            causal=True, block_table=table,
        )


def context_slots(meta: AttentionMetadata) -> torch.Tensor:
    """Cache slots of every context position of every request, requests concatenated."""
    seq_lens = meta.seq_lens.long()
    req = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=seq_lens.device), seq_lens)
    starts = F.pad(seq_lens.cumsum(0), (1, 0))[:-1]
    pos = torch.arange(req.numel(), device=seq_lens.device) - starts[req]
    blocks = meta.block_tables.long()[req, pos // meta.block_size]
    return blocks * meta.block_size + pos % meta.block_size


def flash_attn_available() -> bool:
    """Whether the flash-attn package can be imported (it needs CUDA)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA build raising at import
        return False
    return True


def make_attention_backend(
    name: str, device: torch.device, block_size: int, dtype: torch.dtype = torch.bfloat16,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """`auto`: flash_attn on CUDA (in fp16/bf16) when importable; on CPU the C++ `cpu`
    backend when it builds here, else torch. Asking for an unavailable backend raises a
    clear error instead of silently falling back. `batch_invariant`: the C++ kernel for
    every chunk (see `worker.cpu_attention`)."""
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        name = _auto_backend(device, half)
    if name == "torch":
        return TorchAttention()
    if name == "cpu":
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"attention_backend=cpu needs the CPU and float32/bfloat16, got {device} {dtype}")
        from worker.cpu_attention import CpuPagedAttention

        return CpuPagedAttention(batch_invariant)
    if name == "flash_attn":
        if device.type != "cuda" or not half:
            raise ValueError(f"attention_backend=flash_attn needs a CUDA device and float16/bfloat16, got {device} {dtype}")
        if not flash_attn_available():
            raise ValueError("attention_backend=flash_attn, but the flash_attn package cannot be imported (pip install flash-attn)")
        return FlashAttention(block_size)
    raise ValueError(f"unknown attention backend {name!r} (expected auto, torch, cpu or flash_attn)")


def _auto_backend(device: torch.device, half: bool) -> str:
    if device.type == "cuda":
        return "flash_attn" if half and flash_attn_available() else "torch"
    if device.type == "cpu":
        from worker.cpu_kernels import available

        ok, why = available()
        if ok:
            return "cpu"
        log.warning("attention: the C++ cpu backend is unavailable (%s); using the torch backend", why)
    return "torch"
