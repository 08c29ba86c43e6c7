"""`ModelConfig`: the shape of a Llama-family decoder, read from config.json or GGUF metadata.

One frozen dataclass describes every supported architecture (Llama, Mistral, Qwen2); the
differences that matter to the model code are flags (`attention_bias`, `attention_out_bias`,
tied embeddings) and the rope scaling dict. Anything we cannot run exactly raises
`ModelLoadError` naming the file and the offending setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.model_files import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# GGUF `general.architecture` -> the HF architecture it is converted from.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one Llama-family decoder (HF names)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None: plain rope; else rope_type + its parameters
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    attention_out_bias: bool = False  # bias on o_proj (Llama attention_bias=True; not Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # Mistral v0.1: the served length is capped at it

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else str(self.rope_scaling["rope_type"])

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str | Path) -> ModelConfig:
        """Build from a parsed config.json; `source` names the file in error messages."""
        arch = _hf_architecture(cfg, source)
        if cfg.get("mlp_bias"):
            raise ModelLoadError(f"{source}: mlp_bias=true is not supported")
        if cfg.get("use_sliding_window"):
            raise ModelLoadError(f"{source}: use_sliding_window=true is not supported")
        heads = int(cfg["num_attention_heads"])
        rope_theta, scaling = _hf_rope(cfg, source)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else bias,
            attention_out_bias=False if is_qwen2 else bias,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=token_id_tuple(cfg.get("eos_token_id")),
            sliding_window=cfg.get("sliding_window") if arch == "MistralForCausalLM" else None,
        )

    @classmethod
    def from_gguf_metadata(
        cls, meta: dict[str, Any], tensor_names: set[str], source: str | Path
    ) -> ModelConfig:
        """Build from GGUF key/values (llama.cpp names; `{arch}.vocab_size` must be set, the
        loader fills it from the embedding shape); `tensor_names` tells tying and biases."""
        gguf_arch = str(meta.get("general.architecture"))
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported GGUF architecture {gguf_arch!r} "
                f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
            )

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{gguf_arch}.{name}", default)
            if value is None:
                raise ModelLoadError(f"{source}: GGUF metadata lacks {gguf_arch}.{name}")
            return value

        heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        return cls(
            architecture=GGUF_ARCHITECTURES[gguf_arch],
            vocab_size=int(key("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("attention.key_length", hidden // heads)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope(meta, gguf_arch, source),
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            attention_out_bias="blk.0.attn_output.bias" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=token_id_tuple(meta.get("tokenizer.ggml.eos_token_id")),
        )


def _hf_architecture(cfg: dict[str, Any], source: str | Path) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else f"<none; model_type={cfg.get('model_type')!r}>"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def _hf_rope(cfg: dict[str, Any], source: str | Path) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and scaling from either transformers 4 (`rope_theta` + `rope_scaling`)
    or transformers 5 (`rope_parameters`) config layouts."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {}) or params
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return theta, normalize_rope_scaling(scaling, source)


def _gguf_rope(meta: dict[str, Any], arch: str, source: str | Path) -> dict[str, Any] | None:
    rope_type = meta.get(f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type}
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return normalize_rope_scaling(scaling, source)


def normalize_rope_scaling(scaling: dict[str, Any], source: str | Path) -> dict[str, Any] | None:
    """Canonical rope scaling: None for plain rope, else a dict with `rope_type`.

    Supported: default, linear (positions divided by `factor`), llama3 (Llama 3.1 frequency
    bands). dynamic NTK depends on the batch's longest sequence, so the same request would get
    different logits in different batches; yarn and longrope are not implemented either.
    """
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
    out["rope_type"] = rope_type
    needed = ["factor"]
    if rope_type == "llama3":
        needed += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    missing = [k for k in needed if k not in out]
    if missing:
        raise ModelLoadError(f"{source}: rope scaling {rope_type!r} lacks {', '.join(missing)}")
    return out


def token_id_tuple(value: Any) -> tuple[int, ...]:
    """A token id, a list of them, or None, as a tuple."""
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)
