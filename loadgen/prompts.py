"""Prompts of an exact token length, with or without a tokenizer.

With a tokenizer, prompts are made of "word tokens": vocabulary entries that decode to a
space followed by lowercase letters and encode back to exactly themselves. Because
byte-level BPE pre-tokenizers split text before each space, a run of such tokens
re-tokenizes to the very same ids, so the decoded text has exactly the requested length
(this is checked for every prompt). Without a tokenizer, prompts are random token ids in
a range every realistic vocabulary covers; they can be sent as a token-id prompt to
`/v1/completions`, and the simulator only needs their length.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

_WORD = re.compile(r" [a-z]{3,}")
_ATTEMPTS = 5


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without special tokens (works for HF tokenizers and plain ones)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return list(ids)


def vocab_size(tokenizer: Any) -> int:
    """The number of token ids of `tokenizer`."""
    size = getattr(tokenizer, "vocab_size", None)
    return int(size) if size else len(tokenizer)


class PromptBuilder:
    """Draws prompt token ids (and text, given a tokenizer) of an exact length."""

    def __init__(
        self,
        tokenizer: Any | None = None,
        *,
        id_range: tuple[int, int] = (100, 10_000),
        pool_size: int = 2_000,
        seed: int = 0,
    ) -> None:
        """`id_range` bounds synthetic ids (no tokenizer); `pool_size` caps the word pool."""
        self.tokenizer = tokenizer
        self.id_range = id_range
        self._pool = (
            np.asarray(self._word_pool(tokenizer, pool_size, seed), dtype=np.int64)
            if tokenizer is not None
            else None
        )

    @staticmethod
    def _word_pool(tokenizer: Any, pool_size: int, seed: int) -> list[int]:
        """Word tokens of the vocabulary, scanned in a seeded random order."""
        order = np.random.default_rng(seed).permutation(vocab_size(tokenizer))
        pool: list[int] = []
        for token_id in order:
            text = tokenizer.decode([int(token_id)])
            if _WORD.fullmatch(text) and encode(tokenizer, text) == [int(token_id)]:
                pool.append(int(token_id))
                if len(pool) >= pool_size:
                    break
        if len(pool) < 10:
            raise ValueError(
                "tokenizer has too few plain word tokens to build exact-length prompts"
            )
        return pool

    def ids(self, rng: np.random.Generator, n: int) -> list[int]:
        """`n` token ids: word tokens with a tokenizer, synthetic ids without."""
        if self._pool is None:
            lo, hi = self.id_range
            return [int(x) for x in rng.integers(lo, hi, size=n)]
        return [int(x) for x in rng.choice(self._pool, size=n)]

    def text(self, ids: list[int]) -> str | None:
        """The text of `ids` (None without a tokenizer)."""
        return None if self.tokenizer is None else str(self.tokenizer.decode(ids))

    def prompt(
        self, rng: np.random.Generator, n: int, prefix: list[int] | None = None
    ) -> tuple[list[int], str | None]:
        """A prompt of exactly `len(prefix) + n` tokens: ids and (with a tokenizer) checked text.

        `prefix` (ids from this builder) starts the prompt, e.g. a shared system prompt.
        """
        for _ in range(_ATTEMPTS):
            ids = [*(prefix or []), *self.ids(rng, n)]
            text = self.text(ids)
            if text is None or encode(self.tokenizer, text) == ids:
                return ids, text
        raise ValueError(f"could not build a prompt that re-tokenizes to its {n} new tokens")

    def count(self, text: str) -> int:
        """Tokens in `text`: exact with a tokenizer, else about 4 characters per token."""
        if self.tokenizer is not None:
            return len(encode(self.tokenizer, text))
        return max(1, round(len(text) / 4))
