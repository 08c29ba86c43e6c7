"""The GGUF kernel with int8 activations (csrc/int8_linear.cpp, AVX512-VNNI or AVX2 CPUs): the
tiled layout `worker.model.linear.tile_gguf` builds, products against float64 within the bound
the two-level quantization allows (and no tighter path could fail), Q4_0 / Q4_1 / Q8_0 from
GGUF bytes, row counts around the kernel's passes of 4 rows and outputs that leave a partial
tile, bitwise batch invariance, and the errors for inputs it cannot run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks import gguf_bytes, reference

from worker.kernels.build import available
from worker.model.linear import GGUFLinear, int8_supported, make_linear, tile_gguf
from worker.model.quant import QuantizedWeight, from_gguf, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not (available()[0] and int8_supported()),
                                reason="the int8 kernel needs the CPU kernels built with AVX512-VNNI or AVX2")


def _gguf_like(weight: QuantizedWeight) -> QuantizedWeight:
    """The same codes with scales and offsets rounded to float16, as GGUF stores them."""
    offset = None if weight.offset is None else weight.offset.half().float()
    return QuantizedWeight(weight.kind, weight.q, weight.scale.half().float(), offset, weight.group_size)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|error| each output may have: every activation is off by at most half a step of its
    block's second level, amax / (127 * 128 * 2) (plus float32 rounding of the sums)."""
    m, k = x.shape
    amax = x.abs().view(m, k // 32, 32).amax(-1).double()
    step = (amax / (127 * 128 * 2)).repeat_interleave(32, 1)
    return step @ w.abs().double().T * 1.001 + 2e-6 * (x.abs().double() @ w.abs().double().T)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = reference(x, w)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs()
    assert bool((err <= _bound(x, w)).all()), float((err / _bound(x, w)).max())
    # and it is not the float32 path's answer: two int8 levels leave ~1e-5 of the scale
    assert err.max().item() > 1e-8 * ref.abs().max().item()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 64])
@pytest.mark.parametrize("n", [48, 49, 7])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_kernel_within_the_quantization_bound(kind: str, n: int, m: int) -> None:
    gen = torch.Generator().manual_seed(n * 100 + m)
    k = 192
    w = torch.randn(n, k, generator=gen)
    q = _gguf_like(quantize_int4(w) if kind == "int4" else quantize_int8(w, 32))
    layer = GGUFLinear.from_quantized(q)
    assert layer.tiled and layer.out_features == n
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)  # blocks of unlike ranges
    _check(layer(x), x, q.dequantize())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks(kind: str) -> None:
    gen = np.random.default_rng(7)
    n, k = 33, 128
    weight = from_gguf(kind, gguf_bytes(kind, n, k, gen), n, k)
    layer = GGUFLinear.from_quantized(weight)
    assert layer.tiled
    x = torch.from_numpy(gen.standard_normal((6, k)).astype(np.float32))
    _check(layer(x), x, weight.dequantize())


def test_tiled_layout() -> None:
    """Byte 4r + i of a block's vector j: row r's weights 4j + i (low nibble) and 16 + 4j + i
    (high nibble) for Q4; vector p holds weights 4p + i as q + 128 for Q8; rows padded to 16."""
    n, k = 18, 64
    q4 = torch.arange(n * k).remainder(16).to(torch.uint8).view(n, k)
    scale = torch.full((n, 2), 0.5)
    codes, d, m = tile_gguf(QuantizedWeight("int4", q4, scale, -scale, 32))  # type: ignore[misc]
    assert codes.shape == (2, 2, 256) and d.shape == m.shape == (2, 2, 16) and d.dtype == torch.float16
    for t, g, j, r, i in ((0, 0, 0, 0, 0), (0, 1, 3, 5, 2), (1, 0, 2, 1, 3)):
        row, byte = 16 * t + r, int(codes[t, g, 64 * j + 4 * r + i])
        assert byte & 15 == q4[row, 32 * g + 4 * j + i] and byte >> 4 == q4[row, 32 * g + 16 + 4 * j + i]
    assert int(codes[1, 0, 4 * 5]) == 0 and float(d[1, 0, 5]) == 0.0  # padded rows: zero weights
    q8 = (torch.arange(n * k).remainder(255) - 127).to(torch.int8).view(n, k)
    codes8, _, m8 = tile_gguf(QuantizedWeight("int8", q8, scale, None, 32))  # type: ignore[misc]
    assert codes8.shape == (2, 2, 512) and m8.numel() == 0
    assert int(codes8[0, 1, 64 * 7 + 4 * 3 + 1]) == int(q8[3, 32 + 28 + 1]) + 128


def test_scales_not_exact_in_float16_keep_the_stored_form() -> None:
    q = quantize_int4(torch.randn(16, 64))
    assert tile_gguf(q) is None or torch.equal(q.scale.half().float(), q.scale)
    assert not GGUFLinear.from_quantized(QuantizedWeight(q.kind, q.q, q.scale + 1e-7, q.offset, 32)).tiled
    assert not GGUFLinear.from_quantized(_gguf_like(q), int8_activations=False).tiled


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_rows_are_independent_of_the_batch(kind: str) -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(51, 576, generator=gen)
    layer = GGUFLinear.from_quantized(_gguf_like(quantize_int4(w) if kind == "int4" else quantize_int8(w, 32)))
    x = torch.randn(64, 576, generator=gen)
    alone = [layer(x[i : i + 1]) for i in range(6)]
    for m in (2, 3, 4, 5, 6, 7, 9, 17, 64):
        y = layer(x[:m])
        for i in range(min(m, 6)):
            assert torch.equal(y[i : i + 1], alone[i]), (m, i)


def test_bias_zero_rows_and_a_transposed_input() -> None:
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    q = _gguf_like(quantize_int4(w))
    layer = make_linear(q, torch.float32, bias)
    assert isinstance(layer, GGUFLinear) and layer.tiled
    x = torch.randn(96, 6, generator=gen).T
    x[2] = 0.0  # a row of zeros: a zero step, no division by it
    y = layer(x)
    _check(y - bias, x, q.dequantize())
    assert torch.equal(y[2], bias)
    assert layer(x[:0]).shape == (0, 40)


def test_rejects_inputs_it_cannot_run() -> None:
    layer = GGUFLinear.from_quantized(_gguf_like(quantize_int8(torch.randn(16, 64), 32)))
    ops = torch.ops.stepserve_cpu
    with pytest.raises(RuntimeError, match="float32"):
        layer(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="do not match"):
        ops.int8_linear(torch.randn(2, 96), layer.codes, layer.scales, layer.offsets, 8, 16)
    with pytest.raises(RuntimeError, match="n must be"):
        ops.int8_linear(torch.randn(2, 64), layer.codes, layer.scales, layer.offsets, 8, 17)
    with pytest.raises(RuntimeError, match="empty for Q8"):
        ops.int8_linear(torch.randn(2, 64), layer.codes, layer.scales, layer.scales, 8, 16)


def test_the_flag_reaches_the_worker_and_bad_values_are_refused() -> None:
    from service.cli.serve import worker_config
    from service.cli.serve_args import build_parser
    from worker.config import WorkerConfig

    assert worker_config(build_parser().parse_args([])).gguf_activations == "auto"
    args = build_parser().parse_args(["--gguf-activations", "float32"])
    assert worker_config(args).gguf_activations == "float32"
    with pytest.raises(ValueError, match="gguf_activations must be"):
        WorkerConfig(gguf_activations="fp8")
