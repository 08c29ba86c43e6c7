"""Incremental detokenization and stop-string handling for one output stream.

`IncrementalDetokenizer` turns token ids into text deltas without ever emitting half a
character: a multi-byte character (or a BPE piece) split across tokens decodes to U+FFFD
until its last byte arrives, so text is only released once the decode of a small window
of recent tokens ends cleanly. `finish()` reconciles with a decode of the whole output,
so the concatenated deltas always equal ``decode(all_ids)``.

For a tokenizer with a Rust backend (`common.tokenizer.Tokenizer`, or a transformers fast
tokenizer) the window lives in Rust (`tokenizers.decoders.DecodeStream`, as vLLM v1's fast
detokenizer does): one call per token instead of two decodes. It is also cheaper per token
than one batched decode of every stream's windows, so the engine does not batch. Other
tokenizers (and a stream the Rust state gives up on) use the same window
algorithm in Python::

    ids:    [ ... emitted ... | prefix window | new ids ]
                              ^prefix_offset  ^read_offset
    delta = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

`DetokenizeOptions` carry a request's `skip_special_tokens` and
`spaces_between_special_tokens` (vLLM's names, defaults and meaning: the second only matters
when special tokens are kept, and then writes consecutive added tokens back to back, without
the space some decoders, WordPiece's for one, put between them).

`StopStringMatcher` trims stop strings from the text. A stop string may span tokens, so
text that could be the start of one is held back until it is known not to be. Its work
per delta is bounded by the stop strings' lengths, never by the length of the output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
_BACKWARD_SCAN = 16  # ids a fall-back from DecodeStream looks back for a clean restart

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the Python window only
    DecodeStream = None


class Tokenizer(Protocol):
    """What the service needs from a tokenizer (`common.tokenizer.Tokenizer`; a transformers
    tokenizer fits too). One with a `backend_tokenizer` (the Rust `tokenizers.Tokenizer`)
    is decoded through it."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(
        self,
        token_ids: Sequence[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool | None = ...,
    ) -> str: ...


def decode(tokenizer: Tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The one decode used for output text (special tokens skipped, spacing left alone).

    A tokenizer with a Rust backend is decoded through it directly: the same text as
    ``tokenizer.decode(..., clean_up_tokenization_spaces=False)`` at a quarter of the cost
    of a transformers decode, which matters when every stream decodes at every step.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return str(backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))
    return tokenizer.decode(
        list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


@dataclass(frozen=True, slots=True)
class DetokenizeOptions:
    """How one request's output ids become text."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @property
    def joins_added_tokens(self) -> bool:
        """Whether consecutive added tokens are written back to back (special tokens kept,
        no spaces between them)."""
        return not self.skip_special_tokens and not self.spaces_between_special_tokens


DEFAULT_DETOKENIZE = DetokenizeOptions()


def added_token_texts(tokenizer: Any) -> dict[int, str]:
    """Each added token's id and text (the special tokens and any other whole-matched ones)."""
    table = getattr(tokenizer, "added_tokens_decoder", None)
    if table is None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        table = {} if backend is None else backend.get_added_tokens_decoder()
    return {int(i): str(getattr(t, "content", t)) for i, t in table.items()}


def decode_output(
    tokenizer: Tokenizer, token_ids: Sequence[int], options: DetokenizeOptions = DEFAULT_DETOKENIZE
) -> str:
    """A request's output text under its options: what its deltas add up to."""
    if not options.joins_added_tokens:
        return decode(tokenizer, token_ids, options.skip_special_tokens)
    return _decode_joined(tokenizer, token_ids, added_token_texts(tokenizer))


def _decode_joined(tokenizer: Tokenizer, token_ids: Sequence[int], added: Mapping[int, str]) -> str:
    """Decode with special tokens kept, cut between every two consecutive added tokens, so
    the decoder puts nothing between them."""
    ids = list(token_ids)
    parts, start = [], 0
    for i in range(1, len(ids)):
        if ids[i] in added and ids[i - 1] in added:
            parts.append(decode(tokenizer, ids[start:i], skip_special_tokens=False))
            start = i
    parts.append(decode(tokenizer, ids[start:], skip_special_tokens=False))
    return "".join(parts)


class TokenTexts:
    """Each token id's own text (special tokens kept), as logprobs show it; cached, so a
    token is decoded once per server, and the cache never outgrows the vocabulary."""

    __slots__ = ("_tokenizer", "_cache")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = decode(
                self._tokenizer, (token_id,), skip_special_tokens=False
            )
        return text


class IncrementalDetokenizer:
    """Text deltas for a growing list of output token ids."""

    __slots__ = (
        "_tokenizer",
        "_options",
        "_added",
        "_last_added",
        "_backend",
        "_stream",
        "_ids",
        "_prefix_offset",
        "_read_offset",
        "_emitted",
    )

    def __init__(
        self, tokenizer: Tokenizer, options: DetokenizeOptions = DEFAULT_DETOKENIZE
    ) -> None:
        self._tokenizer = tokenizer
        self._options = options
        # the added tokens' texts, only when consecutive ones are written back to back
        self._added = added_token_texts(tokenizer) if options.joins_added_tokens else None
        self._last_added = False
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: Any = None
        if self._backend is not None and DecodeStream is not None:
            self._stream = DecodeStream(skip_special_tokens=options.skip_special_tokens)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now certain (possibly empty)."""
        if not token_ids:
            return ""
        start = len(self._ids)
        self._ids.extend(token_ids)
        if self._stream is not None:
            delta = self._add_rust(token_ids, start)
            if delta is not None:
                return delta
        return self._add_window()

    def _add_rust(self, token_ids: Sequence[int], start: int) -> str | None:
        """DecodeStream steps; None when it gave up (the Python window takes over)."""
        pieces = []
        try:
            for token in token_ids:
                piece = self._stream.step(self._backend, token)
                if self._added is not None:
                    added = self._added.get(token)
                    if added is not None and self._last_added:
                        piece = added  # its own text, without a space the decoder put before it
                    self._last_added = added is not None
                if piece:
                    pieces.append(piece)
        except Exception:
            # It refuses sequences whose decode is not monotonic (odd byte runs). Drop this
            # call's pieces and let the window re-derive them, starting where the text
            # emitted so far ends.
            self._stream = None
            self._prefix_offset = self._read_offset = self._covering_prefix(len(self.text), start)
            return None
        delta = "".join(pieces)
        if delta:
            self._emitted.append(delta)
        self._read_offset = len(self._ids)
        return delta

    def _covering_prefix(self, num_chars: int, hi: int) -> int:
        """Where the window restarts: the most leading ids (at most `hi`) that decode to
        exactly the text emitted so far. DecodeStream emits text for a prefix of the ids and
        holds back only its last few, so a short backward scan finds it; failing that, the
        fewest ids whose decode is at least that long (a binary search)."""
        emitted = self.text
        for end in range(hi, max(hi - _BACKWARD_SCAN, -1), -1):
            if self._decode(self._ids[:end]) == emitted:
                return end
        lo = 0
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(self._ids[:mid])) >= num_chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _decode(self, token_ids: Sequence[int]) -> str:
        if self._added is None:
            return decode(self._tokenizer, token_ids, self._options.skip_special_tokens)
        return _decode_joined(self._tokenizer, token_ids, self._added)

    def _add_window(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character (or a token that decodes to nothing yet)
        if not new_text.startswith(prefix_text):
            return ""  # the window re-merged across the boundary; wait for a clean cut
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted.append(delta)
        return delta

    def finish(self) -> str:
        """The rest of the text, so that all deltas together equal a decode of every id."""
        full = self._decode(self._ids)
        emitted = self.text
        rest = full[len(emitted) :] if full.startswith(emitted) else ""
        self._emitted.append(rest)
        return rest


class StopStringMatcher:
    """Cuts the text at the first stop string, holding back possible stop-string prefixes."""

    __slots__ = ("_stops", "_include", "_held", "matched")

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop_str_in_output
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text, once one did

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, delta: str) -> str:
        """Return the part of held + delta that is safe to emit; sets `matched` on a stop."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return delta
        buf = self._held + delta
        hit = self._first_match(buf)
        if hit is not None:
            pos, stop = hit
            self.matched = stop
            self._held = ""
            return buf[: pos + len(stop)] if self._include else buf[:pos]
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The generation ended without a stop string: release what was held back."""
        held, self._held = self._held, ""
        return held if self.matched is None else ""

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = buf.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string.

        Only positions holding a stop's first character can start one, so each stop costs
        a `find` per candidate over its last len(stop) - 1 characters."""
        longest = 0
        n = len(buf)
        for stop in self._stops:
            first = stop[0]
            # a start at pos gives a suffix of n - pos characters: shorter than the stop,
            # longer than the best so far
            lo, hi = max(n - len(stop) + 1, 0), n - longest
            pos = buf.find(first, lo, hi)
            while pos >= 0:
                if stop.startswith(buf[pos:]):
                    longest = n - pos  # the earliest start is the longest suffix
                    break
                pos = buf.find(first, pos + 1, hi)
        return longest
