"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar) as the
grammar text llguidance reads, and `GrammarCompiler`, which compiles that text against the
model's vocabulary into a token matcher, cached by text.

Both processes compile: the service to answer a grammar that cannot be compiled with a 400
before anything is scheduled (and to hold the request until its grammar is ready), the
worker to mask each step's logits. The text is the contract between them. llguidance was
chosen by measuring it against xgrammar on this project's model (compile time, mask time,
coverage; the figures are in bench/RESULTS.md's history). It imports no torch.

JSON comes out compact (no whitespace between tokens) unless the request asks for any
whitespace: a small model free to add whitespace can spend its whole budget on newlines.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

GrammarFormat = Literal["json", "json_object", "regex", "choice", "grammar"]


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class Constraint:
    """One request's constraint, as the request gave it."""

    format: GrammarFormat
    spec: Any = None  # a JSON schema (dict or JSON text), a regex, a list of strings, a grammar
    any_whitespace: bool = False  # JSON only: whitespace allowed between tokens

    def grammar_text(self) -> str:
        """The llguidance grammar for this constraint; `GrammarError` if it is malformed."""
        try:
            return self._grammar_text()
        except (ValueError, TypeError) as exc:  # llguidance raises ValueError with its reason
            raise GrammarError(str(exc)) from None

    def _grammar_text(self) -> str:
        ws = {"whitespace_flexible": self.any_whitespace}
        if self.format == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=ws)
        if self.format == "json":
            schema = json.loads(self.spec) if isinstance(self.spec, str) else self.spec
            if not isinstance(schema, dict | bool):
                raise GrammarError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=ws)
        if self.format == "regex":
            return llguidance.LLMatcher.grammar_from_regex(str(self.spec))
        if self.format == "choice":
            if not self.spec or not all(isinstance(c, str) and c for c in self.spec):
                raise GrammarError("choice must be a non-empty list of non-empty strings")
            return llguidance.grammar_from("choice", json.dumps(list(self.spec)))
        return llguidance.grammar_from("grammar", str(self.spec))  # Lark/EBNF or GBNF


class GrammarCompiler:
    """Compiles grammar texts against one vocabulary into `llguidance.LLMatcher`s.

    The tokenizer's llguidance form is built on first use (about half a second for a 49k
    vocabulary), so a server that never sees a constraint never pays for it. Compiled
    grammars are kept by text (least recently used out past `capacity`); each request gets
    a copy of the compiled matcher, which is a fraction of a millisecond. Thread-safe:
    compiles run in worker threads (llguidance releases the GIL while it compiles).
    """

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_token_id: int,
        capacity: int = 256,
    ) -> None:
        """`tokenizer_json` gives the tokenizer as JSON (`tokenizer_json` below), on first
        use."""
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._capacity = capacity
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses), for tests and benchmarks

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def is_cached(self, text: str) -> bool:
        with self._lock:
            return text in self._compiled

    def compile(self, text: str) -> llguidance.LLMatcher:
        """The compiled matcher for `text` (from the cache when there); `GrammarError` if it
        does not compile. Do not advance it: `matcher` hands out copies to advance."""
        with self._lock:
            if text in self._compiled:
                self._compiled.move_to_end(text)
                return self._compiled[text]
        tokenizer = self.tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, text)  # compiles, outside the lock
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        with self._lock:
            self.compiles += 1
            self._compiled[text] = matcher
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, text: str) -> llguidance.LLMatcher:
        """A fresh matcher for `text`, at the start of the grammar."""
        return self.compile(text).deep_copy()


def _first_line(error: str) -> str:
    """llguidance's error, without the parser state dump it appends."""
    return error.split("\n<state>", 1)[0].strip()


def tokenizer_json(backend: Any) -> str:
    """A `tokenizers.Tokenizer` as JSON, without padding or truncation (which would change
    how llguidance reads its vocabulary)."""
    from copy import copy

    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return str(backend.to_str())
