"""The GGUF Q4 / Q8 kernel over the blocks as stored, float32 activations
(csrc/lowbit_linear.cpp), against float64 products with the dequantized weight: every
row-count path (1 row, the paired-row path for few tokens, the tiled path for many), output
counts that leave a tail, Q4_0 / Q4_1 / Q8_0 as loaded from GGUF bytes, bias, and the errors
for shapes it cannot run. (The int8-activation kernel: test_int8_linear.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks import gguf_bytes, reference

from worker.kernels.build import available
from worker.model.linear import GGUFLinear, make_linear, pack_nibbles
from worker.model.quant import QuantizedWeight, from_gguf, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not available()[0], reason=f"CPU kernels unavailable: {available()[1]}")


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
    layer = GGUFLinear.from_quantized(q, int8_activations=False)
    x = torch.randn(m, k, generator=gen)
    _check(layer(x), reference(x, q.dequantize()))


def test_bias_and_non_contiguous_input() -> None:
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    q = quantize_int4(w)
    layer = make_linear(q, torch.float32, bias)
    assert isinstance(layer, GGUFLinear)
    x = torch.randn(96, 6, generator=gen).T  # [6, 96], a transposed view
    assert not x.is_contiguous()
    _check(layer(x), reference(x, q.dequantize(), bias))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_as_stored(kind: str) -> None:
    gen = np.random.default_rng(7)
    n, k = 33, 128
    weight = from_gguf(kind, gguf_bytes(kind, n, k, gen), n, k)
    layer = GGUFLinear.from_quantized(weight, int8_activations=False)
    assert not layer.tiled
    if weight.kind == "int4":  # the kernel reads the nibbles exactly as the file packs them
        raw = gguf_bytes(kind, n, k, np.random.default_rng(7)).reshape(n, k // 32, -1)[..., -16:]
        assert torch.equal(layer.codes, torch.from_numpy(raw.reshape(n, k // 2)))
    x = torch.from_numpy(gen.standard_normal((3, k)).astype(np.float32))
    _check(layer(x), reference(x, weight.dequantize()))


def test_pack_nibbles_layout() -> None:
    q = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    packed = pack_nibbles(q)
    assert packed.shape == (1, 16)
    assert [int(b) & 0x0F for b in packed[0]] == list(range(16))
    assert [int(b) >> 4 for b in packed[0]] == list(range(16))


def test_rejects_shapes_it_cannot_run() -> None:
    q = quantize_int8(torch.randn(8, 64), 32)
    layer = GGUFLinear.from_quantized(q, int8_activations=False)
    with pytest.raises(RuntimeError, match="must be"):
        layer(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.stepserve_cpu.lowbit_linear(torch.randn(2, 48), layer.codes, layer.scales, layer.offsets, 8)
    with pytest.raises(ValueError, match="blocks of 32"):
        GGUFLinear.from_quantized(quantize_int8(torch.randn(8, 64), 64))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_rows_are_independent_of_the_batch(kind: str) -> None:
    """A row's output is bitwise the same whatever else is in x (every path sums in one
    order): what batch-invariant mode rests on."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(51, 576, generator=gen)
    layer = GGUFLinear.from_quantized(quantize_int4(w) if kind == "int4" else quantize_int8(w, 32), int8_activations=False)
    assert not layer.tiled
    x = torch.randn(64, 576, generator=gen)
    alone = layer(x[:1])
    for m in (2, 3, 4, 5, 8, 9, 17, 64):
        assert torch.equal(layer(x[:m])[:1], alone), m


def test_the_int8_activation_kernel_is_built_wherever_the_cpu_has_avx2() -> None:
    """Every CPU the project runs on lists AVX2 with FMA and F16C (AVX-512 ones too), and the
    int8-activation kernel has a path for each: the stored form is left for CPUs without."""
    from pathlib import Path

    from worker.kernels.build import isa_flags
    from worker.model.linear import int8_supported

    if isa_flags(Path("/proc/cpuinfo").read_text())[0] == "-DCPU_CAPABILITY=DEFAULT":
        pytest.skip("this CPU lacks AVX2, FMA or F16C")
    assert int8_supported()
    weight = QuantizedWeight("int4", torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2), 32)
    assert GGUFLinear.from_quantized(weight).tiled
