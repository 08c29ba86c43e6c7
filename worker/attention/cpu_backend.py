"""The CPU attention backend: `csrc/paged_attention.cpp` through `worker.kernels.build`.

The portable torch backend gathers every request's blocks into a padded copy per layer (a
skewed batch pays its longest context for every request) and loops over prefill chunks in
Python. The C++ op reads the cache in place: decodes and short chunks one work item per
(query token, span of keys), long chunks one per (request, kv head, block of query tokens),
all requests' items in one parallel loop (see the source's header).
"""

from __future__ import annotations

import torch

from worker.attention.metadata import AttentionMetadata, KVCacheLayer
from worker.kernels.build import available

# A request with at most this many query tokens attends through the per-token kernel (each
# token its own work items); longer chunks through the chunk kernel (32-token blocks of
# queries against 32-key tiles; float32 queries of head size 64 or 128, else torch's SDPA;
# its products in bfloat16 in the steps whose linear products run on the wide steps' bf16
# copy, see `use_bf16_chunks`).
# The crossover measured 12-17 tokens (bench/RESULTS.md). The chunk kernel sums in another
# order than the per-token one, so a chunk's output then depends on how the prompt was
# chunked: batch-invariant mode sends every chunk through the per-token kernel.
SMALL_QUERY = 16
ALL_QUERIES = 1 << 62
_registered: CpuPagedAttention | None = None  # whose caches the op's registry holds


def paged_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
) -> torch.Tensor:
    return torch.ops.stepserve_cpu.paged_attention(q, k, v, layer)


class CpuPagedAttention:
    """Attention through the C++ op; the caches and each step's metadata live in its registry."""

    name = "cpu"
    op = staticmethod(paged_attention_op)

    def __init__(self, batch_invariant: bool = False) -> None:
        ok, why = available()
        if not ok:
            raise RuntimeError(f"the cpu attention backend is unavailable: {why}")
        self.small_query = ALL_QUERIES if batch_invariant else SMALL_QUERY
        self.bf16_above = ALL_QUERIES  # steps of more tokens than this attend in bf16

    @property
    def bf16_chunks(self) -> bool:
        """Whether any step's long chunks attend in bfloat16."""
        return self.bf16_above != ALL_QUERIES

    def use_bf16_chunks(self, above: int | None) -> bool:
        """Long chunks' two products (Q K^T, P V) as AVX512-BF16 dot products, their operands
        rounded to bfloat16 (sums and softmax in float32), where this build has them, in
        steps of more than `above` tokens (None: never): the worker passes the wide steps'
        cut-over, so attention rounds to bf16 exactly in the steps whose linear products
        run on the bf16 weight copy. Whether they are on at all."""
        supported = bool(torch.ops.stepserve_cpu.chunk_bf16_supported())
        self.bf16_above = above if above is not None and supported else ALL_QUERIES
        return self.bf16_chunks

    def set_cache(self, kv_layers: list[KVCacheLayer]) -> None:
        self._caches = ([k for k, _ in kv_layers], [v for _, v in kv_layers])
        self._register()

    def _register(self) -> None:
        global _registered
        torch.ops.stepserve_cpu.set_kv_cache(*self._caches)
        _registered = self

    def bind(self, meta: AttentionMetadata) -> None:
        if _registered is not self:
            # the op's registry holds one set of caches per process: another runner's (a test
            # session, a bench comparing two) would be read and written in their place
            self._register()
        torch.ops.stepserve_cpu.bind_step(meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                          meta.block_tables, self.small_query,
                                          meta.num_tokens > self.bf16_above)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        return torch.ops.stepserve_cpu.paged_attention(q, k, v, layer)
