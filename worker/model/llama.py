"""The Llama-family decoder in plain torch, over one flattened batch of tokens.

A step's tokens (prefill chunks and decodes of many requests) form one sequence of T tokens;
only attention looks at request boundaries, through `AttentionMetadata` and the paged KV
cache. q/k/v and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import ModelConfig
from worker.model.quant import Weight
from worker.model.weight_form import WeightForm

# attention(q, k, v, layer index) -> [T, heads, head_dim]; the step's metadata and cache are bound
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def rope_inv_freq(config: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim/2] in float32, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    if rope_freqs is not None:  # llama.cpp ships Llama 3.1's scaling as precomputed divisors
        return inv_freq / rope_freqs.float()
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if config.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth band between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF Llama does."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP with residuals. Construction fuses the weights and pops
    the unfused ones from `w`, so peak memory stays near one copy of the model."""

    def __init__(
        self, config: ModelConfig, w: dict[str, Weight], index: int, weights: WeightForm
    ) -> None:
        super().__init__()
        c = config
        self.index = index
        prefix = f"model.layers.{index}."
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.mm_dtype = weights.dtype
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.input_norm = RMSNorm(w.pop(prefix + "input_layernorm.weight"), c.rms_norm_eps)
        self.post_norm = RMSNorm(w.pop(prefix + "post_attention_layernorm.weight"), c.rms_norm_eps)
        attn = prefix + "self_attn."
        bias = (
            torch.cat([w.pop(f"{attn}{p}_proj.bias") for p in "qkv"]) if c.attention_bias else None
        )
        self.qkv = weights.fused([w.pop(f"{attn}{p}_proj.weight") for p in "qkv"], bias)
        o_bias = w.pop(attn + "o_proj.bias", None) if c.attention_out_bias else None
        self.o_proj = weights.linear(w.pop(attn + "o_proj.weight"), o_bias)
        self.gate_up = weights.fused(
            [w.pop(prefix + "mlp.gate_proj.weight"), w.pop(prefix + "mlp.up_proj.weight")]
        )
        self.down = weights.linear(w.pop(prefix + "mlp.down_proj.weight"))

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attention: Attend,
    ) -> torch.Tensor:
        """`x` [T, hidden] float32: the residual stream stays float32 whatever the weights'
        dtype; only matmul inputs are cast to it (bf16 residuals measured 3 % lower top-1
        agreement with the float32 reference on SmolLM2)."""
        t, mm = x.shape[0], self.mm_dtype
        q, k, v = (
            self.qkv(self.input_norm(x).to(mm))
            .float()
            .split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        )
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), *cos_sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), *cos_sin)
        attn = attention(q, k, v.reshape(t, self.num_kv_heads, self.head_dim), self.index)
        x = x + self.o_proj(attn.reshape(t, self.q_size).to(mm)).float()
        gate, up = self.gate_up(self.post_norm(x).to(mm)).float().chunk(2, dim=-1)
        return x + self.down((F.silu(gate) * up).to(mm)).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation of [T, heads, D] by per-token cos/sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied or not)."""

    def __init__(
        self, config: ModelConfig, weights: dict[str, Weight], max_positions: int, form: WeightForm,
    ) -> None:
        super().__init__()
        self.config = config
        embed_weight = weights.pop("model.embed_tokens.weight")
        self.embed = form.embedding(embed_weight)
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, i, form) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(weights.pop("model.norm.weight"), config.rms_norm_eps)
        self.lm_head = form.head(self.embed, weights.pop("lm_head.weight", None), embed_weight)
        del embed_weight
        rope_freqs = weights.pop("rope_freqs", None)
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(config, rope_freqs)
        )
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a step reads, each tensor once (a tied head shares the embedding)."""
        named = [*self.named_parameters(), *self.named_buffers()]
        # rope tables are indexed, not read whole; low-bit layers' dense copies serve wide steps
        tensors = {
            t.data_ptr(): t
            for name, t in named
            if not name.startswith("rope_") and not name.endswith(".dense")
        }
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attend,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for T flattened tokens."""
        x = self.embed(input_ids).float()
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer in self.layers:
            x = layer(x, (cos, sin), attention)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab] for the selected hidden states [n, hidden]."""
        return self.lm_head(hidden.to(self.layers[0].mm_dtype)).float()
