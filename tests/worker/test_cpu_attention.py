"""The C++ CPU attention backend against the portable torch backend: same outputs and the
same cache writes over mixed steps (decodes of skewed lengths, short and long prefill
chunks, with and without cached context), in float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scheduler.sampling import SamplingParams
from worker.attention import StepAttention, TorchAttention
from worker.cpu_attention import SMALL_QUERY
from worker.cpu_kernels import available, isa_flags
from worker.input_batch import InputBatch, RequestState

pytestmark = pytest.mark.skipif(not available()[0], reason=f"cpu attention unavailable: {available()[1]}")

HEADS, KV_HEADS, BS, BLOCKS = 6, 2, 4, 96


def _step(batch: InputBatch, counts: dict[str, tuple[int, int]]) -> tuple[list[tuple[RequestState, int]], int]:
    """Requests with (already computed, this step) tokens and shuffled block tables."""
    gen = np.random.default_rng(1)
    free = list(gen.permutation(BLOCKS))
    scheduled = []
    for rid, (computed, n) in counts.items():
        state = RequestState(rid, list(range(computed + n)), SamplingParams(), None)
        batch.add(state)
        batch.set_blocks(state, [int(free.pop()) for _ in range(-(-(computed + n) // BS))])
        state.num_computed_tokens = computed
        scheduled.append((state, n))
    return scheduled, sum(n for _, n in scheduled)


@pytest.mark.parametrize("dim", [64, 128, 16])  # the two vectorized head sizes, and the generic loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_matches_torch_backend(dtype: torch.dtype, dim: int) -> None:
    from worker.cpu_attention import CpuPagedAttention

    # decodes at 1, 9 and 37 keys; a short chunk with context; a long one with and without
    counts = {"d1": (0, 1), "d2": (8, 1), "d3": (36, 1), "s": (5, 3), "long0": (0, SMALL_QUERY + 7),
              "long": (10, SMALL_QUERY + 2)}
    batch = InputBatch(128, BS, torch.device("cpu"), num_blocks=BLOCKS)
    scheduled, tokens = _step(batch, counts)
    meta = batch.attention_metadata(batch.prepare(scheduled))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, HEADS, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, KV_HEADS, dim, generator=gen).to(dtype)
    v = torch.randn(tokens, KV_HEADS, dim, generator=gen).to(dtype)
    base = torch.randn(2, BLOCKS, BS, KV_HEADS, dim, generator=gen).to(dtype)  # context already cached
    outs, caches = [], []
    for backend in (TorchAttention(), CpuPagedAttention()):
        cache = base.clone()
        attention = StepAttention(backend, [(cache[0], cache[1])]).bind(meta)
        outs.append(attention(q, k, v, 0))
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])  # the same slots written with the same K/V
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)


def test_isa_flags_follow_cpuinfo_and_never_ask_for_native() -> None:
    avx512 = "processor: 0\nflags\t\t: fpu avx2 fma f16c avx512f avx512bw avx512vl avx512dq amx_tile amx_int8\n"
    assert isa_flags(avx512)[:2] == ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    assert isa_flags(avx512.replace(" avx512dq", ""))[:2] == ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    assert isa_flags("no flags here") == ["-DCPU_CAPABILITY=DEFAULT"]
    assert not any("native" in f or "amx" in f for f in isa_flags(avx512))
