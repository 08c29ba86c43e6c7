"""Tiny random Hugging Face models for tests that need real weights without a download."""

from __future__ import annotations

from typing import Any

import torch


def make_tiny_hf_model(kind: str = "llama", **overrides: Any) -> Any:
    """A small random transformers model (2 layers, hidden 64, 4 q / 2 kv heads), weights
    scaled up so logits are far from uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="eager",
    )
    common.update(overrides)
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if kind == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(1234)
    model = model_cls(config_cls(**common)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return model
