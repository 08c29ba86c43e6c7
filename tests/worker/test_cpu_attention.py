"""The C++ CPU attention backend against the portable torch backend: same outputs and the
same cache writes over mixed steps (decodes of skewed lengths, short and long prefill
chunks, with and without cached context), in float32 and bfloat16, over caches of float32,
bfloat16, float16 and int8 rows (`worker.attention.kv_rows`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scheduler.sampling import SamplingParams
from worker.attention.cpu_backend import SMALL_QUERY
from worker.attention.kv_rows import SCALE_BYTES, cache_values, dequantize_rows, quantize_rows
from worker.attention.step import StepAttention
from worker.attention.torch_backend import TorchAttention
from worker.execution.input_batch import InputBatch, RequestState
from worker.kernels.build import available, isa_flags

pytestmark = pytest.mark.skipif(not available()[0], reason=f"cpu attention unavailable: {available()[1]}")

HEADS, KV_HEADS, BS, BLOCKS = 6, 2, 4, 96
CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def _cache(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float values [..., D] as a cache of `dtype` (int8: quantized rows [..., D + 4])."""
    return quantize_rows(values) if dtype == torch.int8 else values.to(dtype)


def _values(cache: torch.Tensor) -> torch.Tensor:
    """A cache's values in float64, [..., D]."""
    return cache_values(cache, torch.float64)


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
@pytest.mark.parametrize(("dtype", "cache_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.int8),
    (torch.bfloat16, torch.int8),
])
def test_cpu_backend_matches_torch_backend(dtype: torch.dtype, cache_dtype: torch.dtype, dim: int) -> None:
    from worker.attention.cpu_backend import CpuPagedAttention

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
    base = _cache(torch.randn(2, BLOCKS, BS, KV_HEADS, dim, generator=gen), cache_dtype)  # context already cached
    outs, caches = [], []
    for backend in (TorchAttention(), CpuPagedAttention()):
        cache = base.clone()
        attention = StepAttention(backend, [(cache[0], cache[1])]).bind(meta)
        outs.append(attention(q, k, v, 0))
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])  # the same slots written with the same K/V (same int8 rows)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)


def test_isa_flags_follow_cpuinfo_and_never_ask_for_native() -> None:
    avx512 = "processor: 0\nflags\t\t: fpu avx2 fma f16c avx512f avx512bw avx512vl avx512dq amx_tile amx_int8\n"
    assert isa_flags(avx512)[:2] == ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    assert isa_flags(avx512.replace(" avx512dq", ""))[:2] == ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    assert isa_flags("no flags here") == ["-DCPU_CAPABILITY=DEFAULT"]
    assert not any("native" in f or "amx" in f for f in isa_flags(avx512))


def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               lens: list[int]) -> torch.Tensor:
    """The op over one decode token per request (request r at context lens[r]); this step's own
    K/V are the cache's values at the last position, so nothing new is written."""
    ops = torch.ops.stepserve_cpu
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    seq = torch.tensor(lens)
    slots = torch.stack([tables[r, (n - 1) // bs] * bs + (n - 1) % bs for r, n in enumerate(lens)])
    flat_k, flat_v = k_cache.view(-1, kvh, k_cache.shape[3]), v_cache.view(-1, kvh, v_cache.shape[3])
    new_k, new_v = cache_values(flat_k[slots], torch.float32), cache_values(flat_v[slots], torch.float32)
    ops.set_kv_cache([k_cache], [v_cache])
    ops.bind_step(slots, torch.arange(len(lens) + 1), seq, tables, SMALL_QUERY)
    return ops.paged_attention(q, new_k, new_v, 0)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"), [
    (9, 3, 64, 16),   # SmolLM2: 3 query heads a kv head; rows in vector-wide groups
    (16, 2, 64, 16),  # 8 heads a kv head: more than one register pass (at most 4 heads with AVX-512)
    (4, 4, 128, 8),   # no grouping, head size 128, blocks narrower than a vector
    (6, 2, 64, 3),    # a block size that does not divide the span: the plain-loop path
])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_decode_kernel_matches_float64_over_spans(heads: int, kv_heads: int, dim: int, bs: int,
                                                  cache_dtype: torch.dtype) -> None:
    """Decodes at contexts around the 256-key spans the kernel cuts a context into (one key,
    a partial block, exactly one span, one key over, several spans) against float64 attention
    over the same cached values, for each cache element type."""
    gen = torch.Generator().manual_seed(3)
    lens = [1, 7, 16, 255, 256, 257, 600, 1029]
    width = -(-max(lens) // bs)
    blocks = len(lens) * width
    tables = torch.randperm(blocks, generator=gen).view(len(lens), width)
    k_cache = _cache(torch.randn(blocks, bs, kv_heads, dim, generator=gen), cache_dtype)
    v_cache = _cache(torch.randn(blocks, bs, kv_heads, dim, generator=gen), cache_dtype)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    out = _decode_op(q, k_cache, v_cache, tables, lens)
    group = heads // kv_heads
    for r, n in enumerate(lens):
        keys = _values(k_cache[tables[r]].flatten(0, 1)[:n]).repeat_interleave(group, dim=1)  # [n, heads, dim]
        values = _values(v_cache[tables[r]].flatten(0, 1)[:n]).repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[r].double(), keys) / dim**0.5).softmax(-1)
        want = torch.einsum("hn,nhd->hd", weights, values)
        torch.testing.assert_close(out[r].double(), want, atol=2e-6, rtol=2e-6)


def _chunk_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              context: list[int], chunks: list[int], bf16: bool = False) -> torch.Tensor:
    """The op over one chunk per request (request r: context[r] cached tokens, then chunks[r]
    new ones); the chunks' K/V are the cache's values at their slots, so nothing changes.
    `bf16`: the chunk kernel's products in bfloat16."""
    ops = torch.ops.stepserve_cpu
    bs, kvh, row = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    slots = torch.tensor([int(tables[r, p // bs]) * bs + p % bs
                          for r, (c, n) in enumerate(zip(context, chunks, strict=True)) for p in range(c, c + n)])
    starts = torch.tensor([0, *np.cumsum(chunks)])
    lens = torch.tensor([c + n for c, n in zip(context, chunks, strict=True)])
    flat_k, flat_v = k_cache.view(-1, kvh, row), v_cache.view(-1, kvh, row)
    new_k, new_v = cache_values(flat_k[slots], torch.float32), cache_values(flat_v[slots], torch.float32)
    ops.set_kv_cache([k_cache], [v_cache])
    ops.bind_step(slots, starts, lens, tables, SMALL_QUERY, bf16)
    return ops.paged_attention(q, new_k, new_v, 0)


def _chunk_case(seed: int, context: list[int], chunks: list[int], heads: int, kv_heads: int, dim: int, bs: int,
                cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shuffled block tables, random K/V caches and queries for one chunk per request."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(c + n for c, n in zip(context, chunks, strict=True)) // bs)
    tables = torch.randperm(len(chunks) * width, generator=gen).view(len(chunks), width)
    k_cache = _cache(torch.randn(len(chunks) * width, bs, kv_heads, dim, generator=gen), cache_dtype)
    v_cache = _cache(torch.randn(len(chunks) * width, bs, kv_heads, dim, generator=gen), cache_dtype)
    q = torch.randn(sum(chunks), heads, dim, generator=gen)
    return tables, k_cache, v_cache, q


def _assert_each_chunk_close(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             tables: torch.Tensor, context: list[int], chunks: list[int], tol: float) -> None:
    """Each request's chunk of `out` within `tol` of float64 causal attention over its cache."""
    start = 0
    for r, (c, n) in enumerate(zip(context, chunks, strict=True)):
        want = _causal_reference(q[start : start + n], k_cache, v_cache, tables[r], c, n)
        torch.testing.assert_close(out[start : start + n].double(), want, atol=tol, rtol=tol)
        start += n


def _causal_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                      context: int, n: int) -> torch.Tensor:
    """float64 attention of one chunk's queries [n, heads, dim] over its request's cache."""
    group = q.shape[1] // k_cache.shape[2]
    keys = _values(k_cache[table].flatten(0, 1)[: context + n]).repeat_interleave(group, dim=1)
    values = _values(v_cache[table].flatten(0, 1)[: context + n]).repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,nhd->htn", q.double(), keys) / q.shape[2] ** 0.5
    future = torch.arange(context + n)[None, :] > (context + torch.arange(n))[:, None]
    return torch.einsum("htn,nhd->thd", scores.masked_fill(future, float("-inf")).softmax(-1), values)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"), [
    (9, 3, 64, 16),   # SmolLM2
    (16, 2, 64, 16),  # 8 heads a kv head
    (4, 4, 128, 8),   # no grouping, head size 128
    (8, 2, 128, 3),   # a block size that divides neither a key tile nor a vector
])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_chunk_kernel_matches_float64(heads: int, kv_heads: int, dim: int, bs: int, cache_dtype: torch.dtype) -> None:
    """Long chunks (more than SMALL_QUERY tokens) in one step, with and without cached context,
    of lengths around the kernel's 32-token items and 32-key tiles, against float64 causal
    attention over the same cached values; and the same step through SDPA."""
    context = [0, 0, 5, 300, 33, 0, 31]
    chunks = [SMALL_QUERY + 1, 64, 40, 97, 256, 31, 33]
    tables, k_cache, v_cache, q = _chunk_case(6, context, chunks, heads, kv_heads, dim, bs, cache_dtype)
    out = _chunk_op(q, k_cache, v_cache, tables, context, chunks)
    try:
        torch.ops.stepserve_cpu.set_chunk_kernel(False)
        sdpa = _chunk_op(q, k_cache, v_cache, tables, context, chunks)
    finally:
        torch.ops.stepserve_cpu.set_chunk_kernel(True)
    _assert_each_chunk_close(out, q, k_cache, v_cache, tables, context, chunks, 5e-6)
    torch.testing.assert_close(out, sdpa, atol=5e-6, rtol=5e-6)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"), [(9, 3, 64, 16), (8, 2, 128, 3)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
def test_bf16_chunk_products_match_float64_to_bfloat16_precision(heads: int, kv_heads: int, dim: int, bs: int,
                                                                 cache_dtype: torch.dtype) -> None:
    """The chunk kernel with its two products as AVX512-BF16 dot products (queries, keys,
    values and weights rounded to bfloat16, sums in float32): within bfloat16's precision of
    float64 attention, over odd key counts (a weight pair with one key past the end) and
    cached context; and not the float32 kernel's output (the bfloat16 path ran)."""
    if not torch.ops.stepserve_cpu.chunk_bf16_supported():
        pytest.skip("this build has no AVX512-BF16 (the CPU does not list avx512_bf16)")
    context = [0, 5, 300, 33, 0]
    chunks = [SMALL_QUERY + 1, 40, 97, 256, 33]
    tables, k_cache, v_cache, q = _chunk_case(7, context, chunks, heads, kv_heads, dim, bs, cache_dtype)
    exact = _chunk_op(q, k_cache, v_cache, tables, context, chunks)
    out = _chunk_op(q, k_cache, v_cache, tables, context, chunks, bf16=True)
    _assert_each_chunk_close(out, q, k_cache, v_cache, tables, context, chunks, 2e-2)
    assert not torch.equal(out, exact)
    assert (out - exact).abs().max() < 2e-2


def test_bf16_chunks_over_more_converted_keys_than_one_batch_holds() -> None:
    """Many long chunks over long cached contexts (33 x 2,720 keys of 3 kv heads: 69 MB of
    bfloat16 keys and values, over the 64 MiB the kernel converts at once) go through in
    batches: each chunk's output is what it is alone, and within bfloat16's precision of
    float64 attention."""
    if not torch.ops.stepserve_cpu.chunk_bf16_supported():
        pytest.skip("this build has no AVX512-BF16 (the CPU does not list avx512_bf16)")
    context, chunks = [2700] * 33, [SMALL_QUERY + 1] * 33
    tables, k_cache, v_cache, q = _chunk_case(8, context, chunks, 9, 3, 64, 16, torch.float16)
    out = _chunk_op(q, k_cache, v_cache, tables, context, chunks, bf16=True)
    n = chunks[0]
    for r in (0, 16, 32):  # the first batch's first chunk, one in the middle, the last batch's
        alone = _chunk_op(q[r * n : (r + 1) * n], k_cache, v_cache, tables[r : r + 1], context[:1], chunks[:1], bf16=True)
        assert torch.equal(out[r * n : (r + 1) * n], alone)
        want = _causal_reference(q[r * n : (r + 1) * n], k_cache, v_cache, tables[r], context[r], n)
        torch.testing.assert_close(out[r * n : (r + 1) * n].double(), want, atol=2e-2, rtol=2e-2)


def test_decode_kernel_output_depends_on_its_request_alone() -> None:
    """A request's output is bitwise the same alone and batched with others of other lengths
    (the spans a context is cut into depend on its length alone)."""
    gen = torch.Generator().manual_seed(4)
    lens, bs, width = [700, 5, 300, 1200, 256], 16, 80
    tables = torch.randperm(len(lens) * width, generator=gen).view(len(lens), width)
    k_cache = torch.randn(len(lens) * width, bs, 3, 64, generator=gen).to(torch.float16)
    v_cache = torch.randn(len(lens) * width, bs, 3, 64, generator=gen).to(torch.float16)
    q = torch.randn(len(lens), 9, 64, generator=gen)
    batched = _decode_op(q, k_cache, v_cache, tables, lens)
    for r in range(len(lens)):
        alone = _decode_op(q[r : r + 1], k_cache, v_cache, tables[r : r + 1], lens[r : r + 1])
        assert torch.equal(alone[0], batched[r]), r


def test_two_backends_in_one_process_each_use_their_own_cache() -> None:
    """The op keeps one set of caches per process; a backend bound after another's step must
    get its own back (two runners in one process: a test session, a bench comparing two)."""
    from worker.attention.cpu_backend import CpuPagedAttention

    batch = InputBatch(128, BS, torch.device("cpu"), num_blocks=BLOCKS)
    scheduled, tokens = _step(batch, {"a": (5, 1), "b": (0, 3)})
    meta = batch.attention_metadata(batch.prepare(scheduled))
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(tokens, h, 64, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    caches = [torch.zeros(2, BLOCKS, BS, KV_HEADS, 64), torch.zeros(2, BLOCKS, BS, KV_HEADS, 64, dtype=torch.float16)]
    attentions = [StepAttention(CpuPagedAttention(), [(c[0], c[1])]) for c in caches]  # the second registers last
    first = attentions[0].bind(meta)(q, k, v, 0)
    assert caches[0].abs().sum() > 0 and caches[1].abs().sum() == 0  # written into its own cache only
    second = attentions[1].bind(meta)(q, k, v, 0)
    assert caches[1].abs().sum() > 0
    torch.testing.assert_close(second, first, atol=2e-3, rtol=2e-3)


def test_int8_rows_hold_each_row_within_half_a_step_of_its_scale() -> None:
    """An int8 row: its values within scale / 2 of the input, the largest magnitude exact
    (+-127 steps), a row of zeros all zeros with scale 0, and its scale in the last 4 bytes."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 3, 64, generator=gen) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    x[4, 1] = 0.0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 64 + SCALE_BYTES)
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert torch.equal(rows[..., 64:].contiguous().view(torch.float32), scale)
    back = dequantize_rows(rows)
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert (rows[..., :64].abs().amax(-1)[scale.squeeze(-1) > 0] == 127).all()
    assert torch.equal(back[4, 1], torch.zeros(64))


def test_int8_cache_write_in_cpp_matches_the_torch_rows_bitwise() -> None:
    """The op's write of float32 and bfloat16 K/V into an int8 cache (several threads' worth of
    tokens) is `quantize_rows` of the same values, bit for bit, halves rounded to even."""
    ops = torch.ops.stepserve_cpu
    gen = torch.Generator().manual_seed(9)
    tokens, kvh, dim, bs = 600, 3, 64, 16
    blocks = -(-tokens // bs)
    for dtype in (torch.float32, torch.bfloat16):
        k = torch.randn(tokens, kvh, dim, generator=gen).to(dtype)
        v = (torch.randint(-254, 255, (tokens, kvh, dim), generator=gen) / 2).to(dtype)  # exact halves
        k_cache = torch.zeros(blocks, bs, kvh, dim + SCALE_BYTES, dtype=torch.int8)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
        ops.set_kv_cache([k_cache], [v_cache])
        ops.bind_step(slots, torch.tensor([0, tokens]), torch.tensor([tokens]),
                      torch.arange(blocks).view(1, -1), SMALL_QUERY)
        ops.paged_attention(torch.randn(tokens, 9, dim, generator=gen).to(dtype), k, v, 0)
        assert torch.equal(k_cache.view(-1, kvh, dim + SCALE_BYTES)[slots], quantize_rows(k))
        assert torch.equal(v_cache.view(-1, kvh, dim + SCALE_BYTES)[slots], quantize_rows(v))
