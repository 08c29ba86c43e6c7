"""Tokenizer loading (HF directory or GGUF file), chat templates and end-of-sequence ids.

Building a fast tokenizer from GGUF metadata is slow (the gguf reader walks ~100k strings), so
the first load of a GGUF file saves the tokenizer as an HF directory in the model cache and
later loads read that. The cache key includes the file's size and mtime.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from common.model_files import ModelLoadError, model_cache_dir, resolve_model_path

Tokenizer = Any  # a transformers PreTrainedTokenizerBase; kept loose to avoid the import cost


def load_tokenizer(path: str | Path | None = None, cache: bool = True) -> Tokenizer:
    """The tokenizer of a model dir or GGUF file (None: the default model)."""
    from transformers import AutoTokenizer

    model = resolve_model_path(None if path is None else str(path))
    if model.is_dir():
        return AutoTokenizer.from_pretrained(str(model))
    cached = _cache_dir(model) if cache else None
    if cached is not None and (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    except Exception as exc:
        raise ModelLoadError(
            f"{model}: cannot build a tokenizer from the GGUF metadata ({exc})"
        ) from exc
    if cached is not None:
        _save_atomically(tokenizer, cached)
    return tokenizer


def apply_chat_template(
    tokenizer: Tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's own chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use the completions API")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    # the template already contains any BOS token, so no special tokens are added again
    return list(tokenizer.encode(text, add_special_tokens=False))


def _cache_dir(model: Path) -> Path:
    stat = model.stat()
    key = hashlib.sha256(
        f"{model.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    return model_cache_dir() / "tokenizers" / f"{model.stem}-{key}"


def _save_atomically(tokenizer: Tokenizer, target: Path) -> None:
    """Save to a temporary sibling and rename, so concurrent loaders never see half a dir."""
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(target)
    except OSError:  # read-only or raced by another process: the cache is only an optimisation
        shutil.rmtree(tmp, ignore_errors=True)
