"""`WeightForm`: the form every weight of the model takes (dtype and quantization), in one place.

    quantization  dtype     linear layers                       embedding     LM head
    none          any       dense in dtype                      dense         dense (tied: shared)
    gguf          float32   the file's Q4_0/Q4_1/Q8_0 blocks    Q8_0 blocks   the file's form
                            (stepserve's kernels: tiled, int8   or dense      (tied: shared, or
                            activations where AVX2 or VNNI)                   a tiled copy)
    int8          bfloat16  int8 per row (torch's kernel)       int8          int8 (tied: shared)
    int4          bfloat16  int4 group 32 (torch's kernel)      int8          int4

The layers built here are `worker.model.linear`'s; fused q/k/v and gate/up are concatenated before
packing, in their common form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from worker.model.linear import Embedding, Linear, make_linear
from worker.model.quant import (
    GGUF_GROUP,
    QuantizedWeight,
    Weight,
    as_dense,
    concat_rows,
    quantize,
    quantize_int8,
)

Quantization = Literal["none", "gguf", "int8", "int4"]
QUANTIZATIONS: tuple[str, ...] = ("none", "gguf", "int8", "int4")


@dataclass(frozen=True)
class WeightForm:
    """How weights are held: activation/dense dtype, quantization, and the low-bit layers'
    dense cut-over."""

    dtype: torch.dtype
    quantization: Quantization = "none"
    # int4 / gguf layers keep a bf16 copy for steps above this many tokens
    dense_above: int | None = None
    int8_activations: bool = True  # gguf: the tiled int8-activation kernel where the CPU runs it

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        need = {"gguf": torch.float32, "int8": torch.bfloat16, "int4": torch.bfloat16}.get(
            self.quantization
        )
        if need is not None and self.dtype != need:
            raise ValueError(
                f"quantization={self.quantization} runs with {str(need)[6:]} activations, "
                f"got {self.dtype}"
            )

    def prepare(self, weight: Weight) -> Weight:
        """One linear weight in this form, before fusion and packing."""
        if self.quantization == "none":
            return weight.dequantize(self.dtype) if isinstance(weight, QuantizedWeight) else weight
        if self.quantization == "gguf":
            return weight
        return quantize(weight, self.quantization)

    def linear(self, weight: Weight, bias: torch.Tensor | None = None) -> Linear:
        return make_linear(
            self.prepare(weight), self.dtype, bias, self.dense_above, self.int8_activations
        )

    def fused(self, parts: list[Weight], bias: torch.Tensor | None = None) -> Linear:
        """One layer for weights stacked along their outputs (q/k/v, gate/up)."""
        prepared = [self.prepare(p) for p in parts]
        kinds = {p.kind if isinstance(p, QuantizedWeight) else "dense" for p in prepared}
        if kinds == {"dense"}:
            return make_linear(torch.cat([p.to(self.dtype) for p in prepared]), self.dtype, bias)  # type: ignore[union-attr]
        if (
            len(kinds) > 1
        ):  # a file that mixes types within one fused layer: int8 (blocks of 32) loses least
            prepared = [quantize_int8(as_dense(p), GGUF_GROUP) for p in prepared]
        return make_linear(concat_rows(prepared), self.dtype, bias, self.dense_above,  # type: ignore[arg-type]
                           self.int8_activations)

    def embedding(self, table: Weight) -> Embedding:
        if self.quantization == "none":
            return Embedding(self.prepare(table), self.dtype)
        if self.quantization == "gguf":
            keep = isinstance(table, QuantizedWeight) and table.kind == "int8"
            return Embedding(table if keep else as_dense(table), self.dtype)
        return Embedding(quantize(table, "int8"), self.dtype)

    def head(
        self, embedding: Embedding, head_weight: Weight | None, embed_weight: Weight
    ) -> Linear:
        """The LM head: its own weight; or, tied, the embedding's table, shared with the
        embedding unless this form holds the head in int4 (the embedding cannot be int4)."""
        if head_weight is not None:
            return self.linear(head_weight)
        prepared = self.prepare(embed_weight)
        if isinstance(prepared, QuantizedWeight) and prepared.kind == "int4":
            return make_linear(prepared, self.dtype, None, self.dense_above)
        return embedding.tied_head(self.dtype, self.int8_activations)
