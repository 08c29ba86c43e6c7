"""Reading a GGUF file: metadata, and tensors renamed to HF names, dequantized or kept low-bit.

llama.cpp's converter renames tensors (blk.N.attn_q ...) and, for the `llama` architecture,
permutes the rows of Q and K so that rope pairs adjacent dimensions (GPT-J style). We undo
that permutation exactly as transformers' GGUF loader does, so the weights are the HF ones
and the model applies rope NeoX-style (rotate_half) like every HF checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from common.gguf_file import GGUFFile, GGUFTensor
from common.model_files import ModelLoadError
from worker.model.config import ModelConfig
from worker.model.quant import QuantizedWeight, from_gguf

# GGUF tensor kinds we can dequantize (gguf.quants handles each in numpy).
SUPPORTED_GGML_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
# Kept as low-bit codes under --quantization gguf (worker.model.quant maps each onto a kernel).
NATIVE_GGML_TYPES = ("Q4_0", "Q4_1", "Q8_0")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama.cpp's Llama 3.1 rope: per-frequency divisors
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def read_gguf_config(path: Path) -> tuple[ModelConfig, GGUFFile]:
    """The model config of a GGUF file, and the open file for `read_gguf_tensors`."""
    gguf = GGUFFile(path)
    shapes = {t.name: t.shape for t in gguf.tensors}
    meta = {k: v for k, v in gguf.metadata.items() if not isinstance(v, list)}
    if (
        f"{meta.get('general.architecture')}.vocab_size" not in meta
        and "token_embd.weight" in shapes
    ):
        meta[f"{meta.get('general.architecture')}.vocab_size"] = shapes["token_embd.weight"][0]
    return ModelConfig.from_gguf_metadata(meta, set(shapes), path), gguf


def read_gguf_tensors(
    gguf: GGUFFile, config: ModelConfig, path: Path, dtype: torch.dtype, native: bool = False,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor the model uses under HF names: dequantized to `dtype`, or, with
    `native`, Q4_0/Q4_1/Q8_0 matrices kept as `QuantizedWeight` codes and scales."""
    permute = gguf.metadata.get("general.architecture") == "llama"
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for tensor in gguf.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        kind = tensor.kind
        if kind not in SUPPORTED_GGML_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} has GGML type {kind}, not supported "
                f"(supported: {', '.join(SUPPORTED_GGML_TYPES)})"
            )
        shape = tensor.shape
        heads = _rope_heads(config, name) if permute else None
        if native and kind in NATIVE_GGML_TYPES:
            quantized = from_gguf(kind, tensor.data, *shape)
            weights[name] = (
                quantized if heads is None else quantized.rows(unpermute_index(shape[0], heads))
            )
            continue
        array = _dequantized(tensor, shape)
        if heads is not None:
            array = unpermute_rope_rows(array, heads)
        weights[name] = torch.from_numpy(array).to(dtype)
    return weights


def _rope_heads(config: ModelConfig, name: str) -> int | None:
    """Heads of a Q or K projection, whose rows llama.cpp permuted; None for other tensors."""
    if ".q_proj." in name:
        return config.num_attention_heads
    if ".k_proj." in name:
        return config.num_key_value_heads
    return None


def _dequantized(tensor: GGUFTensor, shape: tuple[int, ...]) -> np.ndarray:
    from gguf.quants import dequantize

    array = dequantize(tensor.data, tensor.ggml_type)
    array = np.ascontiguousarray(array.reshape(shape), dtype=np.float32)
    if not array.flags.writeable:  # F32 tensors come back as views of the memory map
        array = array.copy()
    return array


def unpermute_index(rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation: out[i] = in[index[i]]."""
    return unpermute_rope_rows(np.arange(rows)[:, None], num_heads)[:, 0]


def unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K (its `permute` in convert_hf_to_gguf).

    llama.cpp stores each head's rows as (pair, 2) = [r0, r_{d/2}, r1, r_{d/2+1}, ...];
    HF keeps (2, pair) = [r0, r1, ..., r_{d/2}, ...]. Swapping the two axes restores HF order.
    """
    half = weights.shape[0] // num_heads // 2
    grouped = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(2, 1).reshape(weights.shape))
