"""Low-bit weights before packing: `QuantizedWeight`, made from GGUF blocks or from floats.

Two forms, groupwise along K (g = k // group_size):

    int4: w[n, k] = q[n, k] * scale[n, g] + offset[n, g]          q in 0..15
    int8: w[n, k] = q[n, k] * scale[n, g]                          q in -127..127

GGUF blocks map onto them exactly, with group 32: Q4_0 (w = d * (q - 8)): scale = d,
offset = -8d; Q4_1 (w = d * q + m): scale = d, offset = m; Q8_0 (w = d * q): scale = d. Kernels
that need another grouping get it from `per_row_int8` (torch's int8 kernel has one scale per row).

A `QuantizedWeight` stays unpacked (plain [N, K] codes and float32 scales) so the model can
fuse q/k/v and gate/up by concatenating rows, and undo llama.cpp's rope row permutation,
before `worker.model.linear` packs it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

QuantKind = Literal["int4", "int8"]
GGUF_GROUP = 32  # every legacy GGUF quant type packs 32 values per block


@dataclass(frozen=True)
class QuantizedWeight:
    """Codes and float32 scales of one [N, K] weight."""

    kind: QuantKind
    q: torch.Tensor  # [N, K]: uint8 0..15 (int4) or int8 (int8)
    scale: torch.Tensor  # [N, K // group_size] float32
    offset: torch.Tensor | None  # [N, K // group_size] float32 (int4); None for int8
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight these codes stand for."""
        scale = self.scale.repeat_interleave(self.group_size, dim=1)
        if self.kind == "int8":
            return (self.q.float() * scale).to(dtype)
        assert self.offset is not None
        offset = self.offset.repeat_interleave(self.group_size, dim=1)
        return (self.q.float() * scale + offset).to(dtype)

    def rows(self, index: torch.Tensor | np.ndarray) -> QuantizedWeight:
        """The same weight with its rows reordered (llama.cpp's Q/K permutation undone)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        offset = None if self.offset is None else self.offset[idx]
        return QuantizedWeight(self.kind, self.q[idx], self.scale[idx], offset, self.group_size)


Weight = torch.Tensor | QuantizedWeight  # a weight as loaded: floats, or low-bit codes


def as_dense(weight: Weight) -> torch.Tensor:
    """Floats of a weight in either form (low-bit codes dequantized to float32)."""
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight from several stacked along N (fused q/k/v, gate/up); all of one kind."""
    first = parts[0]
    if any(p.kind != first.kind or p.group_size != first.group_size for p in parts):
        raise ValueError("cannot fuse weights quantized differently")
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])  # type: ignore[misc]
    return QuantizedWeight(
        first.kind,
        torch.cat([p.q for p in parts]),
        torch.cat([p.scale for p in parts]),
        offset,
        first.group_size,
    )


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8 of a float weight, per row (torchao's int8 weight-only scheme) or per
    group of `group_size` along K (GGUF's Q8_0 with 32)."""
    w = weight.float()
    n, k = w.shape
    group = group_size or k
    groups = w.view(n, k // group, group)
    scale = (groups.abs().amax(dim=2) / 127.0).clamp_min(1e-12)
    q = torch.round(groups / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q.view(n, k), scale, None, group)


def per_row_int8(weight: QuantizedWeight) -> QuantizedWeight:
    """An int8 weight with one scale per row (requantized from its groups: exact where a
    row's groups share a scale, within half a step of its largest group elsewhere)."""
    if weight.group_size == weight.shape[1]:
        return weight
    return quantize_int8(weight.dequantize())


def quantize_int4(weight: torch.Tensor, group_size: int = GGUF_GROUP) -> QuantizedWeight:
    """Asymmetric groupwise int4 (min/max per group, as GGUF Q4_1) of a float weight."""
    w = weight.float()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 needs K ({k}) to be a multiple of the group size {group_size}")
    groups = w.view(n, k // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((high - low) / 15.0).clamp_min(1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight("int4", q.view(n, k), scale, low, group_size)


def quantize(weight: torch.Tensor | QuantizedWeight, kind: QuantKind) -> QuantizedWeight:
    """`weight` in `kind`: kept as it is when it already is, else (re)quantized from floats."""
    if isinstance(weight, QuantizedWeight):
        if weight.kind == kind:
            return weight
        weight = weight.dequantize()
    return quantize_int8(weight) if kind == "int8" else quantize_int4(weight)


# ---- GGUF blocks ---------------------------------------------------------------------------

def _blocks(data: np.ndarray, n: int, k: int, block_bytes: int) -> np.ndarray:
    """[N, K/32, block_bytes] view of a quantized tensor's raw bytes."""
    return np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // GGUF_GROUP, block_bytes)


def _f16(raw: np.ndarray) -> torch.Tensor:
    """float32 of little-endian f16 stored in two uint8 columns."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """A block's 16 bytes hold values 0..15 at low nibbles and 16..31 at high nibbles."""
    return torch.from_numpy(np.concatenate([qs & 0x0F, qs >> 4], axis=-1))


def from_gguf(kind_name: str, data: np.ndarray, n: int, k: int) -> QuantizedWeight:
    """A Q4_0, Q4_1 or Q8_0 tensor of HF shape [n, k] as codes and scales, without loss for
    any of them."""
    if kind_name == "Q4_0":
        b = _blocks(data, n, k, 18)
        d = _f16(b[..., 0:2])
        q = _nibbles(b[..., 2:18]).reshape(n, k)
        return QuantizedWeight("int4", q, d, -8.0 * d, GGUF_GROUP)
    if kind_name == "Q4_1":
        b = _blocks(data, n, k, 20)
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        q = _nibbles(b[..., 4:20]).reshape(n, k)
        return QuantizedWeight("int4", q, d, m, GGUF_GROUP)
    if kind_name == "Q8_0":
        b = _blocks(data, n, k, 34)
        d = _f16(b[..., 0:2])
        codes = torch.from_numpy(np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(n, k))
        return QuantizedWeight("int8", codes, d, None, GGUF_GROUP)
    raise ValueError(
        f"GGML type {kind_name} has no native low-bit form here (Q4_0, Q4_1 and Q8_0 do)"
    )
