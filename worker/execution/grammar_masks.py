"""Structured outputs in the worker: one grammar matcher per constrained request, the token
mask each sampling step applies, and the matcher's advance with each sampled token.

The matcher lives in the request's `RequestState`, beside its tokens, and advances in
`advance` right after the sampler, in the same step: with two plans in flight the next plan
samples from the state this one left, as the token ids do. A preempted request keeps its
state (tokens and matcher) in the worker, whether its KV is swapped out or recomputed, so it
resumes where its grammar stood; a request the worker has not seen before starts its matcher
from its output tokens, so the matcher is always the one its accepted tokens derive.

Grammars compile off the step: `prepare` (called when the service starts compiling the same
grammar) compiles in a background thread, and a step that needs a grammar takes it from the
cache. A step waits for a compile only if the service scheduled the request before the
worker's own compile of the same text finished (both take the same few milliseconds).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from common.grammar import GrammarCompiler, GrammarError
from worker.execution.input_batch import RequestState

log = logging.getLogger("stepserve.worker")


class GrammarMasks:
    """Matchers, masks and compiles for the worker; `make_compiler` builds the compiler on
    first use (it loads the tokenizer), in the background thread when `prepare` comes first."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler]) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._pending: dict[str, Future[None]] = {}

    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def prepare(self, text: str) -> None:
        """Start compiling `text` in the background (a no-op once it is compiled)."""
        with self._lock:
            if text in self._pending:
                return
            # compiles no request came for (an aborted one's) are dropped once done
            self._pending = {t: f for t, f in self._pending.items() if not f.done()}
            self._pending[text] = self._pool.submit(self._compile_quietly, text)

    def _compile_quietly(self, text: str) -> None:
        try:
            self.compiler().compile(text)
        except GrammarError as exc:  # the service refuses it too; nothing will use it
            log.debug("grammar does not compile: %s", exc)

    def _matcher(self, state: RequestState) -> llguidance.LLMatcher:
        if state.matcher is None:
            text = state.sampling_params.grammar
            assert text is not None
            with self._lock:
                pending = self._pending.pop(text, None)
            if pending is not None:
                pending.result()  # usually done: the service waited for its own compile
            matcher = self.compiler().matcher(text)
            if state.output_token_ids and not matcher.consume_tokens(state.output_token_ids):
                raise GrammarError(f"request {state.req_id!r}: its output leaves its grammar")
            state.matcher = matcher
        return state.matcher

    def bitmask(self, states: list[RequestState], vocab_size: int) -> torch.Tensor | None:
        """[len(states), vocab] bool: the tokens each row may sample (all, for a row without
        a grammar); None when no row has one."""
        rows = [i for i, s in enumerate(states) if s.sampling_params.grammar is not None]
        if not rows:
            return None
        words = (vocab_size + 31) // 32
        packed = np.full((len(states), words), -1, dtype=np.int32)
        for i in rows:
            matcher = self._matcher(states[i])
            matcher.unsafe_compute_mask_ptr(packed[i].ctypes.data, words * 4)
            if matcher.is_error():
                log.warning("request %r: grammar error %s", states[i].req_id, matcher.get_error())
        allowed = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(allowed.astype(np.bool_))

    def advance(self, states: list[RequestState], tokens: list[int]) -> None:
        """Each constrained row's matcher takes its sampled token."""
        for state, token in zip(states, tokens, strict=True):
            if state.matcher is not None and not state.matcher.consume_token(token):
                log.warning("request %r: sampled token %d outside its grammar: %s",
                            state.req_id, token, state.matcher.get_error())

