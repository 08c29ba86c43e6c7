"""Incremental detokenization (multi-byte characters, BPE merges) and stop-string trimming."""

from __future__ import annotations

import random
from typing import Any

import pytest

from service.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStringMatcher, decode

TEXTS = [
    "Hello wörld! 你好，世界 🎉🎉 emoji and naïve café — “quotes”",
    "def f(x):\n    return x ** 2  # ünïcödé\n\n\n",
    "🇫🇷🇩🇪 flags, 👩‍👩‍👧 family, Ελληνικά, русский, עברית, 日本語のテキスト",
    "   leading spaces and trailing   ",
]


def _stream(tokenizer: Any, ids: list[int], chunk: int = 1) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return deltas, "".join(deltas)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_full_decode(tokenizer: Any, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, joined = _stream(tokenizer, ids, chunk)
    assert joined == decode(tokenizer, ids) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas), "a partial character leaked"


def test_random_token_sequences_match_full_decode(tokenizer: Any) -> None:
    """Arbitrary ids (invalid byte sequences included) still end equal to one decode."""
    rng = random.Random(7)
    for _ in range(30):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        _, joined = _stream(tokenizer, ids)
        assert joined == decode(tokenizer, ids)
        assert joined == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_multibyte_character_is_held_until_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🎉"
    assert detok.finish() == ""


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    _, joined = _stream(tokenizer, ids)
    assert joined == "Hi"


def _feed(matcher: StopStringMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush()


@pytest.mark.parametrize(
    ("stops", "include", "pieces", "expected", "matched"),
    [
        (["STOP"], False, ["abc", "ST", "OP", "xyz"], "abc", "STOP"),
        (["STOP"], True, ["abc", "ST", "OP", "xyz"], "abcSTOP", "STOP"),
        (["STOP"], False, ["abc", "ST", "ep"], "abcSTep", None),  # a false start is released
        (["\n\n"], False, ["line\n", "\nnext"], "line", "\n\n"),
        (["aab"], False, ["a", "a", "a", "b", "c"], "a", "aab"),  # overlapping prefixes
        (["world", "lo"], False, ["hello world"], "hel", "lo"),  # earliest match wins
        ([], False, ["no", " stops"], "no stops", None),
        (["x"], False, ["", "ab", "cx", "d"], "abc", "x"),
    ],
)
def test_stop_strings(stops: list[str], include: bool, pieces: list[str], expected: str, matched: str | None) -> None:
    matcher = StopStringMatcher(stops, include)
    assert _feed(matcher, pieces) == expected
    assert matcher.matched == matched


def test_stop_prefix_is_held_back_not_emitted() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("text</e") == "text"
    assert matcher.feed("nd>") == ""
    assert matcher.matched == "</end>"
