"""Loading weights (HF directory or GGUF file) with validation.

`load_weights` returns HF-named tensors that `worker.model.LlamaForCausalLM` takes as they
are. Every problem (bad path, unsupported architecture, missing tensor, wrong shape) raises
`ModelLoadError` at load time with the file and the tensor in the message.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from common.model_files import ModelLoadError, resolve_model_path
from worker.model.config import ModelConfig, token_id_tuple
from worker.model.gguf_weights import read_gguf_config, read_gguf_tensors
from worker.model.quant import Weight, as_dense


def load_config(path: Path) -> ModelConfig:
    """Only the config of a model (HF dir or GGUF file), without reading tensors."""
    path = resolve_model_path(str(path))
    if path.is_dir():
        return _hf_config(path)
    return read_gguf_config(path)[0]


def gguf_native_kinds(path: Path) -> tuple[set[str], set[str]]:
    """The low-bit forms ("int4", "int8") a GGUF file's matrices map onto natively: of all
    of them, and of the decoder layers' linear products alone (not the embedding table and
    head), from one read of the header."""
    from worker.model.gguf_weights import NATIVE_GGML_TYPES, hf_name

    _, gguf = read_gguf_config(path)
    native = set(NATIVE_GGML_TYPES)
    names = [(hf_name(t.name), t.kind) for t in gguf.tensors if t.kind in native]

    def forms(kinds: set[str]) -> set[str]:
        return {"int8" if kind == "Q8_0" else "int4" for kind in kinds}

    return (
        forms({kind for name, kind in names if name is not None}),
        forms({kind for name, kind in names if name is not None and name.endswith("proj.weight")}),
    )


def load_weights(
    path: str | Path, dtype: torch.dtype = torch.float32, native: bool = False,
) -> tuple[ModelConfig, dict[str, Weight]]:
    """Config and validated HF-named weights (on CPU, in `dtype`) from a dir or a GGUF file;
    with `native`, a GGUF file's low-bit matrices stay low-bit (`QuantizedWeight`)."""
    path = resolve_model_path(str(path))
    weights: dict[str, Weight]
    if path.is_dir():
        config = _hf_config(path)
        weights = dict(_read_safetensors(path, dtype))
    elif path.suffix == ".gguf":
        config, gguf = read_gguf_config(path)
        weights = read_gguf_tensors(gguf, config, path, dtype, native)
    else:
        raise ModelLoadError(f"{path}: expected a .gguf file or a directory with config.json")
    return config, validate_weights(config, weights, path)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model needs, with its HF shape."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (c.q_size, c.hidden_size),
            p + "self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, c.q_size),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        if c.attention_bias:
            for proj, size in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
                shapes[p + f"self_attn.{proj}_proj.bias"] = (size,)
        if c.attention_out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
    return shapes


def validate_weights(
    config: ModelConfig, weights: dict[str, Weight], path: Path
) -> dict[str, Weight]:
    """Keep exactly the expected tensors (plus `rope_freqs`); raise on missing or misshapen."""
    out: dict[str, Weight] = {}
    for name, shape in expected_shapes(config).items():
        if name not in weights:
            raise ModelLoadError(f"{path}: missing tensor {name} (expected shape {list(shape)})")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {list(weights[name].shape)}, "
                f"expected {list(shape)}"
            )
        out[name] = weights[name]
    if "rope_freqs" in weights:
        if tuple(weights["rope_freqs"].shape) != (config.head_dim // 2,):
            raise ModelLoadError(
                f"{path}: tensor rope_freqs has shape {list(weights['rope_freqs'].shape)}"
            )
        out["rope_freqs"] = as_dense(weights["rope_freqs"]).float()
    return out


def _hf_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{config_file}: not found (an HF model directory needs config.json)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file}: invalid JSON ({exc})") from exc
    config = ModelConfig.from_hf_dict(raw, config_file)
    generation = path / "generation_config.json"
    if generation.is_file():
        extra = token_id_tuple(json.loads(generation.read_text()).get("eos_token_id"))
        config = replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))
    return config


def _read_safetensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files in the model directory")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a dict)
                weights[name] = shard.get_tensor(name).to(dtype)
    return weights
