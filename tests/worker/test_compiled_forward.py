"""`worker.model.compiled_forward` with two models of one class in one process (a test session, a
bench comparing two forms): each compiled forward must run its own graph and its own frozen
weights. The stance the first compile leaves (guards skipped unless they tell graphs apart)
once made dynamo hand the second model the first one's graph."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn

from worker.model import compiled_forward
from worker.model.compiled_forward import compile_forward

pytestmark = pytest.mark.skipif(compiled_forward.compiler_missing() is not None, reason="no C++ compiler")


class Tiny(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(seed)), requires_grad=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attention: Callable[..., torch.Tensor]) -> torch.Tensor:
        return attention(self.table[ids] * (positions[:, None] + 1))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _run(forward: compiled_forward.Forward, tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return forward(torch.arange(tokens) % 16, torch.arange(tokens), _identity)


def test_two_models_of_one_class_keep_their_own_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    # the timing that decides whether to keep the compiled forward is not under test: say faster
    timings = itertools.cycle([2.0, 1.0])  # eager, then compiled
    monkeypatch.setattr(compiled_forward, "one_token_ms", lambda fn, warm_up: next(timings))
    models = [Tiny(1), Tiny(2)]
    results = []
    try:
        for model in models:
            result = compile_forward(model.forward, _identity, lambda fn, t: _run(fn, t), [1, 2])
            assert result.compiled, result.note
            results.append(result)
        for model, result in zip(models * 2, results * 2, strict=True):  # each, after both compiled
            for tokens in (1, 2, 5):
                torch.testing.assert_close(_run(result.forward, tokens), _run(model.forward, tokens))
    finally:
        torch.compiler.set_stance("default")
