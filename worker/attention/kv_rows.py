"""The int8 KV cache's row format (`--kv-cache-dtype int8`), in torch.

Each (token, kv head) row of `head_dim` values is stored as `head_dim` int8 values and,
after them, the row's float32 scale in 4 bytes: value = int8 * scale, scale = max |x| / 127
(symmetric, one scale per token and kv head, rounded to nearest even). The scale rides in
the row, so K and V of every layer stay one int8 tensor: blocks swap, copy and size as with
any other element type. The C++ op (`csrc/paged_attention.cpp`) writes and reads the same
format; the torch backend and the tests use these functions.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row: head_dim values, and an int8 row's scale."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., D] (any float dtype) as int8 cache rows [..., D + 4]."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    values = torch.where(scale > 0, x / scale, torch.zeros_like(x)).round().to(torch.int8)
    return torch.cat([values, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 cache rows [..., D + 4] as values [..., D] of `dtype`."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(dtype)


def cache_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as values of `dtype`, whatever the cache's element type."""
    return dequantize_rows(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)
