"""Worker settings the tests share."""

from __future__ import annotations

from typing import Any

# Reference mode: float32 weights, no quantization, no compiler: exactly the numerics the
# parity tests compare with transformers (the fast defaults are checked by their own gates).
REFERENCE: dict[str, Any] = {"dtype": "float32", "quantization": "none", "enforce_eager": True}
REFERENCE_FLAGS: tuple[str, ...] = ("--dtype", "float32", "--quantization", "none", "--enforce-eager")
