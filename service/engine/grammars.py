"""The service's side of structured outputs: each request's grammar compiled before the
request reaches the scheduler, off the event loop and cached by text, so a grammar that does
not compile is a 400 before anything is scheduled and a request whose grammar is compiling
waits outside the scheduler (counted in `/metrics` as waiting for its grammar).

When a compile starts here the worker is told to compile the same text (`PrepareGrammar`), so
by the time the request is scheduled the worker's copy is usually ready too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common.grammar import GrammarCompiler, tokenizer_json
from service.engine.metrics import ServiceMetrics


class ServiceGrammars:
    """Compiles grammars in one background thread and counts the requests waiting on them."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_id: int,
        prepare_in_worker: Callable[[str], None] | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        backend = tokenizer.backend_tokenizer
        self.compiler = GrammarCompiler(
            lambda: tokenizer_json(backend), vocab_size, eos_token_id
        )
        self._prepare_in_worker = prepare_in_worker
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.num_waiting = 0  # requests whose grammar is compiling

    async def compile(self, text: str) -> None:
        """Return once `text` is compiled; `GrammarError` if it does not compile."""
        if self.compiler.is_cached(text):
            return
        if self._prepare_in_worker is not None:
            self._prepare_in_worker(text)
        self._set_waiting(+1)
        start = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._pool, self.compiler.compile, text
            )
        finally:
            self._set_waiting(-1)
            if self._metrics is not None:
                self._metrics.grammar_compile_seconds.observe(time.perf_counter() - start)

    def _set_waiting(self, change: int) -> None:
        self.num_waiting += change
        if self._metrics is not None:
            self._metrics.num_requests_waiting_for_grammar.set(self.num_waiting)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

