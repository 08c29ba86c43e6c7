"""Shared by the GGUF kernel tests: random blocks as GGUF stores them, and the float64
product they are checked against."""

from __future__ import annotations

import numpy as np
import torch


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def gguf_bytes(kind: str, n: int, k: int, gen: np.random.Generator) -> np.ndarray:
    """Random blocks laid out as GGUF stores them (f16 scales, packed nibbles / int8 codes)."""
    blocks = n * k // 32
    d = gen.uniform(0.001, 0.05, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    if kind == "Q8_0":
        return np.concatenate([d, gen.integers(0, 256, (blocks, 32), dtype=np.uint8)], axis=1)
    nibbles = gen.integers(0, 256, (blocks, 16), dtype=np.uint8)
    if kind == "Q4_0":
        return np.concatenate([d, nibbles], axis=1)
    mins = gen.uniform(-0.3, 0.1, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return np.concatenate([d, mins, nibbles], axis=1)
