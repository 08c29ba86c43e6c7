"""The load generator's tokenizer: the server's own (`common.tokenizer`), loaded torch-free.

The load generator is a client: it needs token counts and exact-length prompts that the server
will count the same way, so it loads the very tokenizer the server loads (a GGUF file's
vocabulary comes from the same model cache) and nothing from `worker/`, `transformers` or torch.
"""

from __future__ import annotations

from pathlib import Path

from common.tokenizer import Tokenizer
from common.tokenizer import load_tokenizer as _load_model_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file, an HF directory or a `tokenizer.json` (None: the default
    model's)."""
    if path is not None and not Path(path).expanduser().exists():
        raise FileNotFoundError(
            f"{path}: no such tokenizer file (expected a GGUF file, an HF directory or a "
            "tokenizer.json)"
        )
    return _load_model_tokenizer(path)
