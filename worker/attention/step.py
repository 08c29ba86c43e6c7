"""`StepAttention`: the model's attention, a backend bound to each step's metadata, and the
opaque op a compiled forward calls instead."""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.attention.metadata import AttentionBackend, AttentionMetadata, KVCacheLayer


class StepAttention:
    """The model's attention: a backend over the per-layer KV cache, bound to each step's
    metadata by the runner before the forward.

    A compiled forward calls `compiled` instead: an op opaque to the compiler that takes the
    layer's index rather than its cache tensors (an op that mutated its inputs would be
    functionalized, its whole cache cloned per call), so the cache is written in place and
    the per-step metadata never becomes a guard or a recompilation.
    """

    def __init__(self, backend: AttentionBackend, kv_layers: list[KVCacheLayer]) -> None:
        self.backend = backend
        backend.set_cache(kv_layers)

    def bind(self, meta: AttentionMetadata) -> StepAttention:
        global _ACTIVE
        self.backend.bind(meta)
        _ACTIVE = self
        return self

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        return self.backend.forward(q, k, v, layer)

    @property
    def compiled(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]:
        """The attention a compiled forward calls: the backend's own op when it has one (C++,
        no Python per layer), else the `stepserve::paged_attention` Python op."""
        return getattr(self.backend, "op", None) or compiled_attend


_ACTIVE: StepAttention | None = None


@torch.library.custom_op("stepserve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Write this step's K/V into layer `layer`'s cache and attend (the bound step's metadata).
    The cache write is invisible to the compiler on purpose (see `StepAttention`)."""
    assert _ACTIVE is not None, "stepserve::paged_attention called outside a step"
    return _ACTIVE.backend.forward(q, k, v, layer)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


def compiled_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The attention a compiled forward calls: one opaque op per layer."""
    return torch.ops.stepserve.paged_attention(q, k, v, layer)
