"""Linear layers and the embedding in each weight form the worker runs: dense, int8 and int4.

    Dense      F.linear over an fp32 / bf16 / fp16 weight
    Int8       torch's weight-only int8 CPU kernel (one scale per output row)
    Int4       torch's weight-only int4 CPU kernel (groups of 32 along K, scale and zero)
    GGUF       stepserve's own kernels over GGUF's Q4 / Q8 blocks, float32 in and out: where
               the CPU has AVX512-VNNI or AVX2, the blocks re-laid in tiles of 16 rows and the
               activations quantized to two int8 levels per block (csrc/int8_linear.cpp,
               integer dot products); elsewhere, or with float32 activations asked for, the
               blocks as stored times float32 activations (csrc/lowbit_linear.cpp)

Both of torch's low-bit kernels take bfloat16 activations (with float32 ones they fall
back to a slow path, measured 10-100x slower), so a quantized model runs in bfloat16.

Int4 and GGUF layers may also keep a dense bfloat16 copy of their weight for steps of many
tokens (`dense_above`): the low-bit kernels read 4-8x fewer bytes, which wins for decodes,
while from a few tokens on a dense bf16 GEMM's compute rate wins: oneDNN runs it on AMX
tiles where the CPU has them (11x the GGUF kernel at 512 tokens on a Xeon), on AVX512-BF16
elsewhere. The start-up probe measures where, see `worker.model.kernel_probe`. A GGUF
layer's copy takes float32 activations rounded to bfloat16 and gives float32 outputs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.quant import GGUF_GROUP, QuantizedWeight, per_row_int8

_INT4_N_MULTIPLE = 16  # the int4 packing kernel's rule for N
_TILE = 16  # output rows per tile of csrc/int8_linear.cpp


def _buffer(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    module.register_buffer(name, tensor, persistent=False)


class DenseLinear(nn.Module):
    """y = x W^T + b with a float weight [N, K]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        # an existing Parameter (a tied embedding's table) is shared, not wrapped again
        self.weight = (
            weight
            if isinstance(weight, nn.Parameter)
            else nn.Parameter(weight, requires_grad=False)
        )
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """Weight-only int8: y = (x q^T) * scale + b, with q [N, K] int8 and one scale per row."""

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        _buffer(self, "qweight", qweight)
        _buffer(self, "scales", scales)
        _buffer(self, "bias", bias)

    @classmethod
    def from_quantized(
        cls, weight: QuantizedWeight, dtype: torch.dtype, bias: torch.Tensor | None = None
    ) -> Int8Linear:
        row = per_row_int8(weight)
        return cls(
            row.q.to(torch.int8).contiguous(),
            row.scale[:, 0].to(dtype),
            None if bias is None else bias.to(dtype),
        )

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """Weight-only int4 in torch's packed CPU layout; N is padded to a multiple of 16.

    `dense_above`: steps with more tokens than this use a dense copy of the weight instead
    (None: never; the copy is then not kept)."""

    def __init__(
        self, weight: QuantizedWeight, dtype: torch.dtype, bias: torch.Tensor | None = None,
        dense_above: int | None = None,
    ) -> None:
        super().__init__()
        n, k = weight.shape
        pad = -n % _INT4_N_MULTIPLE
        assert weight.offset is not None
        # torch's kernel computes (q - 8) * scale + zero: its zero is the value at q = 8
        q, scale, zero = weight.q.to(torch.int32), weight.scale, weight.offset + 8.0 * weight.scale
        if pad:
            q = F.pad(q, (0, 0, 0, pad), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        self.n, self.group_size, self.dense_above = n, weight.group_size, dense_above
        _buffer(
            self, "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        )
        # [K / group, N, 2]: the kernel's layout of (scale, zero) per group and column
        _buffer(
            self, "scales_zeros", torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        )
        _buffer(self, "bias", None if bias is None else bias.to(dtype))
        _buffer(self, "dense", None if dense_above is None else weight.dequantize(dtype))

    @property
    def out_features(self) -> int:
        return self.n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.dense is not None
            and self.dense_above is not None
            and x.shape[0] > self.dense_above
        ):
            return F.linear(x, self.dense, self.bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scales_zeros
        )
        if y.shape[-1] != self.n:
            y = y[..., : self.n]
        return y if self.bias is None else y + self.bias


class GGUFLinear(nn.Module):
    """GGUF's Q4 / Q8 blocks (32 values each) through stepserve's C++ kernels, float32
    activations in and outputs out, in one of two forms:

    stored  codes [N, K * bits / 8] as the file packs them, float32 scales / offsets [N, K / 32]:
            csrc/lowbit_linear.cpp, float32 products;
    tiled   codes [tiles, K / 32, 256 | 512], float16 scales / offsets [tiles, K / 32, 16]
            (`tile_gguf`): csrc/int8_linear.cpp, activations as two int8 levels, integer dots."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None, tiled_rows: int | None = None) -> None:
        super().__init__()
        self.bits, self.tiled = bits, tiled_rows is not None
        self.n = int(scales.shape[0]) if tiled_rows is None else tiled_rows
        self.dense_above: int | None = None
        _buffer(self, "codes", codes)
        _buffer(self, "scales", scales)
        _buffer(self, "offsets", offsets)  # empty for Q8
        _buffer(self, "bias", bias)
        _buffer(self, "dense", None)

    @classmethod
    def from_quantized(cls, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                       int8_activations: bool = True, dense_above: int | None = None) -> GGUFLinear:
        """The tiled form where `int8_activations`, the CPU runs it and the scales are exact
        in float16 (GGUF stores them so); else the stored form. `dense_above`: keep a bf16
        copy for steps of more tokens than this."""
        if weight.group_size != GGUF_GROUP:
            raise ValueError(
                f"the GGUF kernel runs blocks of {GGUF_GROUP} values, got groups of "
                f"{weight.group_size}"
            )
        b = None if bias is None else bias.float()
        layer = cls.tiled_from(weight, b) if int8_activations else None
        if layer is None and weight.kind == "int8":
            layer = cls(
                weight.q.to(torch.int8).view(torch.uint8).contiguous(),
                weight.scale.float().contiguous(),
                torch.empty(0),
                8,
                b,
            )
        elif layer is None:
            assert weight.offset is not None
            layer = cls(
                pack_nibbles(weight.q),
                weight.scale.float().contiguous(),
                weight.offset.float().contiguous(),
                4,
                b,
            )
        if dense_above is not None:
            layer.keep_dense(weight, dense_above)
        return layer

    def keep_dense(self, weight: QuantizedWeight, above: int) -> None:
        """Serve steps of more than `above` tokens from a bf16 copy of `weight`."""
        self.dense_above = above
        self.dense = weight.dequantize(torch.bfloat16)

    @classmethod
    def tiled_from(
        cls, weight: QuantizedWeight, bias: torch.Tensor | None = None
    ) -> GGUFLinear | None:
        """The tiled form where the CPU runs it and the scales are exact in float16; else None."""
        tiled = tile_gguf(weight) if int8_supported() else None
        if tiled is None:
            return None
        return cls(*tiled, 8 if weight.kind == "int8" else 4, bias, tiled_rows=weight.shape[0])

    @property
    def out_features(self) -> int:
        return self.n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.dense is not None
            and self.dense_above is not None
            and x.shape[0] > self.dense_above
        ):
            y = F.linear(x.to(torch.bfloat16), self.dense).float()
        elif self.tiled:
            y = torch.ops.stepserve_cpu.int8_linear(
                x, self.codes, self.scales, self.offsets, self.bits, self.n
            )
        else:
            y = torch.ops.stepserve_cpu.lowbit_linear(
                x, self.codes, self.scales, self.offsets, self.bits
            )
        return y if self.bias is None else y + self.bias


@functools.cache
def int8_supported() -> bool:
    """Whether csrc/int8_linear.cpp runs here (the kernels built, the CPU lists AVX512-VNNI or
    AVX2 with FMA and F16C)."""
    from worker.kernels.build import available

    return available()[0] and bool(torch.ops.stepserve_cpu.int8_linear_supported())


def tile_gguf(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes, scales, offsets) in csrc/int8_linear.cpp's tiled layout, rows padded to a
    multiple of 16 (zero weights); None where a scale or offset is not exact in float16."""
    n, k = weight.shape
    groups, tiles = k // GGUF_GROUP, -(-n // _TILE)
    pad = tiles * _TILE - n
    parts = [weight.scale] if weight.offset is None else [weight.scale, weight.offset]
    halves = [p.to(torch.float16) for p in parts]
    if not all(torch.equal(h.float(), p.float()) for h, p in zip(halves, parts, strict=True)):
        return None

    def by_tile(v: torch.Tensor) -> torch.Tensor:  # [N, G] -> [tiles, G, 16]
        return F.pad(v, (0, 0, 0, pad)).view(tiles, _TILE, groups).transpose(1, 2).contiguous()

    if weight.kind == "int8":  # vector p of a block: byte 4r + i = code 4p + i of row r, as q + 128
        codes = (F.pad(weight.q.to(torch.int16), (0, 0, 0, pad)) + 128).to(torch.uint8)
        codes = (
            codes.view(tiles, _TILE, groups, 8, 4)
            .permute(0, 2, 3, 1, 4)
            .reshape(tiles, groups, 512)
        )
        return codes.contiguous(), by_tile(halves[0]), torch.empty(0, dtype=torch.float16)
    # vector j: quad j in the low nibbles, quad j + 4 in the high ones
    q = F.pad(weight.q.to(torch.uint8), (0, 0, 0, pad)).view(tiles, _TILE, groups, 2, 4, 4)
    codes = (
        (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 256)
    )
    return codes.contiguous(), by_tile(halves[0]), by_tile(halves[1])


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [N, K] as GGUF stores them: per block of 32, byte j holds value j in its
    low nibble and value j+16 in its high nibble."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // GGUF_GROUP, GGUF_GROUP)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(n, k // 2).contiguous()


Linear = DenseLinear | Int8Linear | Int4Linear | GGUFLinear


def make_linear(
    weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype, bias: torch.Tensor | None = None,
    dense_above: int | None = None, int8_activations: bool = True,
) -> Linear:
    """The layer for a weight as loaded: dense for floats; low-bit codes under float32
    activations through the GGUF kernels (`int8_activations`: the tiled form where the CPU
    runs it), under bfloat16 ones through torch's kernel of their kind; low-bit layers keep
    a dense bf16 copy for steps above `dense_above` tokens."""
    if not isinstance(weight, QuantizedWeight):
        return DenseLinear(weight.to(dtype), None if bias is None else bias.to(dtype))
    if dtype == torch.float32:
        return GGUFLinear.from_quantized(weight, bias, int8_activations, dense_above)
    if weight.kind == "int8":
        return Int8Linear.from_quantized(weight, dtype, bias)
    return Int4Linear(weight, dtype, bias, dense_above)


class Embedding(nn.Module):
    """Token embedding over a dense table or int8 rows (looked-up rows are dequantized,
    by row or by block of 32 as the codes were scaled)."""

    def __init__(self, table: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = None
        self.quantized = (
            table if isinstance(table, QuantizedWeight) and table.kind == "int8" else None
        )
        if self.quantized is not None:
            _buffer(self, "qweight", self.quantized.q.to(torch.int8).contiguous())
            _buffer(
                self,
                "scales",
                self.quantized.scale.to(torch.float32 if dtype == torch.float32 else dtype),
            )
        else:
            dense = (
                table.dequantize(dtype) if isinstance(table, QuantizedWeight) else table.to(dtype)
            )
            self.weight = nn.Parameter(dense, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        rows = F.embedding(ids, self.qweight).to(self.scales.dtype)
        groups = self.scales.shape[1]
        return (rows.view(ids.shape[0], groups, -1) * self.scales[ids][..., None]).view(
            ids.shape[0], -1
        )

    def tied_head(self, dtype: torch.dtype, int8_activations: bool = True) -> Linear:
        """The LM head that shares this table (tied word embeddings), without a copy except
        in the GGUF kernel's tiled form (`GGUFLinear`), whose layout the lookup cannot read."""
        if self.weight is not None:
            return DenseLinear(self.weight)
        assert self.quantized is not None
        if dtype == torch.float32:
            if int8_activations and (head := GGUFLinear.tiled_from(self.quantized)) is not None:
                return head
            return GGUFLinear(self.qweight.view(torch.uint8), self.scales, torch.empty(0), 8)
        if self.quantized.group_size == self.quantized.shape[1]:
            return Int8Linear(self.qweight, self.scales[:, 0])
        return Int8Linear.from_quantized(self.quantized, dtype)  # per-row copy for torch's kernel
