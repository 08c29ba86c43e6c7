"""The flash-attn 2 backend (CUDA, when the package is importable)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention.metadata import AttentionMetadata
from worker.attention.torch_backend import PythonBackend


class FlashAttention(PythonBackend):
    """flash-attn 2 varlen kernel. Paged directly when the block size is a multiple of 256
    (flash-attn's page-size rule); otherwise each request's context is gathered first."""

    name = "flash_attn"

    def __init__(self, block_size: int) -> None:
        from flash_attn import flash_attn_varlen_func

        super().__init__()
        self._varlen = flash_attn_varlen_func
        self.paged = block_size % 256 == 0

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
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
