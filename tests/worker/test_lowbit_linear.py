"""The GGUF Q4 / Q8 kernel (csrc/lowbit_linear.cpp) against float64 products with the
dequantized weight: every row-count path (1 row, the paired-row path for few tokens, the
tiled path for many, the one-token bfloat16-dot path), output counts that leave a tail,
Q4_0 / Q4_1 / Q8_0 as loaded from GGUF bytes, bias, and the errors for shapes it cannot
run."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from worker.cpu_kernels import available
from worker.linear import GGUFLinear, make_linear, pack_nibbles
from worker.quant import from_gguf, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not available()[0], reason=f"CPU kernels unavailable: {available()[1]}")


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == torch.float32 and y.shape == ref.shape
    # float32 accumulation over K products: relative to the size of the terms summed
    scale = ref.abs().max().item() + 1e-6
    assert (y.double() - ref).abs().max().item() <= 2e-5 * scale


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 64])
@pytest.mark.parametrize("n", [48, 49, 7])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_kernel_matches_dequantized_product(kind: str, n: int, m: int) -> None:
    gen = torch.Generator().manual_seed(n * 100 + m)
    k = 192
    w = torch.randn(n, k, generator=gen)
    q = quantize_int4(w) if kind == "int4" else quantize_int8(w, 32)
    layer = GGUFLinear.from_quantized(q)
    x = torch.randn(m, k, generator=gen)
    _check(layer(x), _reference(x, q.dequantize()))


def test_bias_and_non_contiguous_input() -> None:
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    q = quantize_int4(w)
    layer = make_linear(q, torch.float32, bias)
    assert isinstance(layer, GGUFLinear)
    x = torch.randn(96, 6, generator=gen).T  # [6, 96], a transposed view
    assert not x.is_contiguous()
    _check(layer(x), _reference(x, q.dequantize(), bias))


def _gguf_bytes(kind: str, n: int, k: int, gen: np.random.Generator) -> np.ndarray:
    """Random blocks laid out as GGUF stores them (f16 scales, packed nibbles / int8 codes)."""
    blocks = n * k // 32
    d = gen.uniform(0.001, 0.05, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    if kind == "Q8_0":
        return np.concatenate([d, gen.integers(0, 256, (blocks, 32), dtype=np.uint8)], axis=1)
    nibbles = gen.integers(0, 256, (blocks, 16), dtype=np.uint8)
    if kind == "Q4_0":
        return np.concatenate([d, nibbles], axis=1)
    mins = gen.uniform(-0.3, 0.1, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return np.concatenate([d, mins, nibbles], axis=1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_as_stored(kind: str) -> None:
    gen = np.random.default_rng(7)
    n, k = 33, 128
    weight = from_gguf(kind, _gguf_bytes(kind, n, k, gen), n, k)
    layer = GGUFLinear.from_quantized(weight)
    if weight.kind == "int4":  # the kernel reads the nibbles exactly as the file packs them
        raw = _gguf_bytes(kind, n, k, np.random.default_rng(7)).reshape(n, k // 32, -1)[..., -16:]
        assert torch.equal(layer.codes, torch.from_numpy(raw.reshape(n, k // 2)))
    x = torch.from_numpy(gen.standard_normal((3, k)).astype(np.float32))
    _check(layer(x), _reference(x, weight.dequantize()))


def test_pack_nibbles_layout() -> None:
    q = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    packed = pack_nibbles(q)
    assert packed.shape == (1, 16)
    assert [int(b) & 0x0F for b in packed[0]] == list(range(16))
    assert [int(b) >> 4 for b in packed[0]] == list(range(16))


def test_rejects_shapes_it_cannot_run() -> None:
    q = quantize_int8(torch.randn(8, 64), 32)
    layer = GGUFLinear.from_quantized(q)
    with pytest.raises(RuntimeError, match="must be"):
        layer(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.stepserve_cpu.lowbit_linear(torch.randn(2, 48), layer.codes, layer.scales, layer.offsets, 8)
    with pytest.raises(ValueError, match="blocks of 32"):
        GGUFLinear.from_quantized(quantize_int8(torch.randn(8, 64), 64))


@pytest.fixture
def exact_products() -> Iterator[None]:
    """Every product in float32 (the switch batch-invariant mode sets), reset after."""
    torch.ops.stepserve_cpu.set_lowbit_exact(True)
    yield
    torch.ops.stepserve_cpu.set_lowbit_exact(False)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_rows_are_independent_of_the_batch(kind: str, exact_products: None) -> None:
    """With exact products, a row's output is bitwise the same whatever else is in x (every
    path sums in one order): what batch-invariant mode rests on."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(51, 576, generator=gen)
    layer = GGUFLinear.from_quantized(quantize_int4(w) if kind == "int4" else quantize_int8(w, 32))
    x = torch.randn(64, 576, generator=gen)
    alone = layer(x[:1])
    for m in (2, 3, 4, 5, 8, 9, 17, 64):
        assert torch.equal(layer(x[:m])[:1], alone), m


@pytest.mark.parametrize("k", [576, 192, 96])  # 4-block groups with and without a tail
def test_one_token_q4_takes_bfloat16_dots_where_the_cpu_has_them(k: int) -> None:
    """By default a one-token Q4 product multiplies 16-bit activations (two bfloat16 parts)
    where AVX512_BF16 exists: close to the float32 path, not equal to it; Q4_0 (no mins),
    Q8 and two tokens stay float32."""
    ops = torch.ops.stepserve_cpu
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(37, k, generator=gen)
    q4 = quantize_int4(w)
    layers = {"q4_1": GGUFLinear.from_quantized(q4), "q8": GGUFLinear.from_quantized(quantize_int8(w, 32))}
    q4_0 = GGUFLinear.from_quantized(q4)
    q4_0.offsets = torch.empty(0)  # Q4_0's form: no mins (w = d * q)
    x = torch.randn(2, k, generator=gen) * 3
    try:
        has_path = ops.set_lowbit_exact(True)
        exact = {name: layer(x[:1]) for name, layer in layers.items()} | {"q4_0": q4_0(x[:1])}
        two = layers["q4_1"](x)
        ops.set_lowbit_exact(False)
        fast = {name: layer(x[:1]) for name, layer in layers.items()} | {"q4_0": q4_0(x[:1])}
        assert torch.equal(layers["q4_1"](x), two)
    finally:
        ops.set_lowbit_exact(False)
    assert torch.equal(fast["q8"], exact["q8"])
    ref = _reference(x[:1], q4.dequantize())
    _check(fast["q4_1"], ref)
    _check(exact["q4_1"], ref)
    codes_only = q4_0.codes.view(37, k // 32, 16)
    q = torch.stack([codes_only & 15, codes_only >> 4], 2).reshape(37, k // 32, 32).double()
    _check(fast["q4_0"], _reference(x[:1], (q * q4_0.scales.double()[..., None]).reshape(37, k)))
    for name in ("q4_1", "q4_0"):
        assert torch.equal(fast[name], exact[name]) is not has_path, name
