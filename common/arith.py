"""Integer helpers every layer uses (block counts, padded sizes)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: how many blocks of `b` hold `a` items."""
    return -(-a // b)
