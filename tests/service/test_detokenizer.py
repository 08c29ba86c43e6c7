"""Incremental detokenization (multi-byte characters, BPE merges; the Rust DecodeStream path,
the Python window path and the fall-back between them; the same deltas as with a transformers
tokenizer) and stop-string trimming."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from service.engine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringMatcher,
    TokenTexts,
    decode,
)

TEXTS = [
    "Hello wörld! 你好，世界 🎉🎉 emoji and naïve café — “quotes”",
    "def f(x):\n    return x ** 2  # ünïcödé\n\n\n",
    "🇫🇷🇩🇪 flags, 👩‍👩‍👧 family, Ελληνικά, русский, עברית, 日本語のテキスト",
    "   leading spaces and trailing   ",
]


class PythonOnly:
    """The default tokenizer without its Rust backend: the Python window path."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                          clean_up_tokenization_spaces=clean_up_tokenization_spaces))


class GivesUpAfter:
    """A DecodeStream stand-in that works for `n` tokens, then raises as the real one does
    on a non-monotonic decode."""

    def __init__(self, real: Any, n: int) -> None:
        self.real, self.n = real, n

    def step(self, backend: Any, token: int) -> str | None:
        self.n -= 1
        if self.n < 0:
            raise Exception("Invalid prefix encountered")
        return self.real.step(backend, token)


def _stream(tokenizer: Any, ids: list[int], chunk: int = 1, give_up_after: int | None = None) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer)
    if give_up_after is not None:
        detok._stream = GivesUpAfter(detok._stream, give_up_after)
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


@pytest.mark.parametrize("text", TEXTS)
def test_python_window_path_matches_full_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, joined = _stream(PythonOnly(tokenizer), ids)
    assert joined == text and not any(REPLACEMENT_CHAR in d for d in deltas)


@pytest.mark.parametrize("give_up_after", [0, 3, 9])
def test_falling_back_from_decode_stream_loses_nothing(tokenizer: Any, give_up_after: int) -> None:
    text = TEXTS[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    for chunk in (1, 4):
        deltas, joined = _stream(tokenizer, ids, chunk, give_up_after)
        assert joined == text and not any(REPLACEMENT_CHAR in d for d in deltas)


def test_token_texts_are_each_tokens_own_decode(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("Hello wörld", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert [texts(t) for t in ids] == [decode(tokenizer, [t], skip_special_tokens=False) for t in ids]
    assert texts(ids[-1]) == tokenizer.eos_token  # special tokens are shown, not skipped


def test_random_token_sequences_match_full_decode(tokenizer: Any) -> None:
    """Arbitrary ids (invalid byte sequences included) still end equal to one decode."""
    rng = random.Random(7)
    for _ in range(30):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        _, joined = _stream(tokenizer, ids)
        assert joined == decode(tokenizer, ids)
        assert joined == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_deltas_equal_a_transformers_tokenizer(tokenizer: Any, tmp_path: Path) -> None:
    """The torch-free tokenizer streams the very deltas a transformers fast tokenizer of the
    same files does, on both paths (DecodeStream and the Python window)."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    rng = random.Random(11)
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(30)] for _ in range(10)]
    for ids in sequences:
        for chunk in (1, 3):
            assert _stream(tokenizer, ids, chunk) == _stream(reference, ids, chunk)
        assert _stream(PythonOnly(tokenizer), ids) == _stream(PythonOnly(reference), ids)


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


def _naive_partial_suffix(buf: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(buf)) + 1) if buf.endswith(s[:k])), default=0)


def test_held_back_suffix_is_the_longest_stop_prefix() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        buf = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 10)))
        matcher = StopStringMatcher(stops)
        if matcher._first_match(buf) is None:
            assert matcher._partial_suffix_len(buf) == _naive_partial_suffix(buf, stops), (buf, stops)


def test_stop_prefix_is_held_back_not_emitted() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("text</e") == "text"
    assert matcher.feed("nd>") == ""
    assert matcher.matched == "</end>"
