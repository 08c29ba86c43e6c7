"""Our Llama forward (paged KV, mixed prefill chunks and decodes in one flattened batch)
against transformers' eager implementation with the same random weights, loaded through our
own HF-directory loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler.sampling import SamplingParams
from worker.attention.step import StepAttention
from worker.attention.torch_backend import TorchAttention
from worker.execution.input_batch import InputBatch, RequestState
from worker.execution.kv_cache import KVCache
from worker.model.llama import LlamaForCausalLM
from worker.model.loader import load_weights
from worker.model.weight_form import WeightForm

PROMPT_LENS = {"a": 23, "b": 40, "c": 5, "d": 16}
# Per step: tokens each request computes. b is chunked 7 / 16 / 17; a, c, d prefill at once
# and then decode; e arrives late as a 1-token prompt.
STEPS: list[dict[str, int]] = [
    {"a": 23, "b": 7, "c": 5, "d": 16},
    {"a": 1, "b": 16, "c": 1},
    {"b": 17, "a": 1, "c": 1, "d": 1, "e": 1},
    {"a": 1, "b": 1, "d": 1, "e": 1},
]


def run_ours(model_dir: Path, prompts: dict[str, list[int]], appended: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Logits of every computed position per request, in position order."""
    config, weights = load_weights(model_dir)
    model = LlamaForCausalLM(config, weights, max_positions=128, form=WeightForm(torch.float32))
    cache = KVCache(config, num_blocks=64, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    attention = StepAttention(TorchAttention(), cache.layers())
    batch = InputBatch(max_model_len=128, block_size=4, device=torch.device("cpu"))
    free = list(range(63, -1, -1))  # hand blocks out in descending order: tables are not contiguous
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    added = {rid: 0 for rid in prompts}
    for counts in STEPS:
        scheduled = []
        for rid, n in counts.items():
            if rid not in batch.requests:
                batch.add(RequestState(rid, list(prompts[rid]), SamplingParams(), None))
            state = batch.requests[rid]
            while state.num_computed_tokens + n > state.num_tokens:  # a decode: feed the next token
                batch.append_token(state, appended[rid][added[rid]])
                added[rid] += 1
            need = -(-(state.num_computed_tokens + n) // 4) - len(state.block_ids)
            batch.set_blocks(state, state.block_ids + [free.pop() for _ in range(need)])
            scheduled.append((state, n))
        step = batch.prepare(scheduled)
        with torch.inference_mode():
            ids, positions = torch.from_numpy(step.input_ids), torch.from_numpy(step.positions)
            hidden = model(ids, positions, attention.bind(batch.attention_metadata(step)))
            all_logits = model.compute_logits(hidden)
        offset = 0
        for state, n in step.scheduled:
            logits[state.req_id].append(all_logits[offset : offset + n])
            offset += n
            state.num_computed_tokens += n
    return {rid: torch.cat(chunks) for rid, chunks in logits.items()}


def check_parity(model_dir: Path, hf_model: Any) -> None:
    gen = torch.Generator().manual_seed(7)
    lens = PROMPT_LENS | {"e": 1}
    prompts = {rid: torch.randint(0, 256, (n,), generator=gen).tolist() for rid, n in lens.items()}
    appended = {rid: torch.randint(0, 256, (4,), generator=gen).tolist() for rid in lens}
    ours = run_ours(model_dir, prompts, appended)
    for rid, got in ours.items():
        full = prompts[rid] + appended[rid]
        with torch.no_grad():
            ref = hf_model(torch.tensor([full])).logits[0, : got.shape[0]].float()
        rel = (got - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"request {rid}: relative error {rel:.2e}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_llama_gqa_matches_transformers(tiny_hf_dir: Any) -> None:
    check_parity(*tiny_hf_dir("llama"))


def test_llama_tied_embeddings_match_transformers(tiny_hf_dir: Any) -> None:
    check_parity(*tiny_hf_dir("llama", tie_word_embeddings=True, num_key_value_heads=4))


def test_qwen2_qkv_bias_matches_transformers(tiny_hf_dir: Any) -> None:
    model_dir, hf_model = tiny_hf_dir("qwen2")
    config, _ = load_weights(model_dir)
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias
    check_parity(model_dir, hf_model)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 4.0},
    ],
    ids=["llama3", "linear"],
)
def test_rope_scaling_matches_transformers(tiny_hf_dir: Any, scaling: dict[str, Any]) -> None:
    model_dir, hf_model = tiny_hf_dir("llama", rope_parameters={"rope_theta": 10000.0, **scaling})
    config, _ = load_weights(model_dir)
    assert config.rope_type == scaling["rope_type"]
    check_parity(model_dir, hf_model)


def reference_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, causal: bool, block_table: torch.Tensor | None) -> torch.Tensor:
    """flash_attn_varlen_func's documented contract in plain torch: bottom-right causal, GQA,
    K/V either packed ([total_k, kv_heads, D] at cu_k offsets) or paged ([num_blocks,
    page_size, kv_heads, D] with request i's pages in block_table[i])."""
    assert causal
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, qe, n_k = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i + 1] - cu_k[i])
        if block_table is None:
            keys, values = k[int(cu_k[i]) : int(cu_k[i + 1])], v[int(cu_k[i]) : int(cu_k[i + 1])]
        else:
            pages = block_table[i, : -(-n_k // k.shape[1])].long()
            keys, values = k[pages].flatten(0, 1)[:n_k], v[pages].flatten(0, 1)[:n_k]
        group = q.shape[1] // keys.shape[1]
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe], keys.repeat_interleave(group, 1))
        pos_q = torch.arange(n_k - (qe - qs), n_k)
        scores = scores.masked_fill(torch.arange(n_k)[None, None, :] > pos_q[None, :, None], float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", (scores / q.shape[-1] ** 0.5).softmax(-1),
                                  values.repeat_interleave(group, 1))
    return out


@pytest.mark.parametrize(
    ("block_size", "requests"),
    [
        (4, {"d0": (9, 1), "d1": (3, 1), "p0": (0, 11), "p1": (6, 5)}),  # gathers: 4 is no page size
        (256, {"d0": (300, 1), "d1": (3, 1), "p0": (0, 11), "p1": (260, 5)}),  # pages via block_table
    ],
    ids=["gather", "paged"],
)
def test_flash_glue_matches_torch_backend(block_size: int, requests: dict[str, tuple[int, int]]) -> None:
    """The flash backend's glue (sequence offsets, gather or block tables) with a reference
    kernel gives what the torch backend gives, for decodes and chunks over a filled cache.
    This checks our side of the call; the kernel itself only runs on CUDA (bench/gpu_check.sh)."""
    from worker.attention.flash_attn_backend import FlashAttention

    torch.manual_seed(0)
    num_blocks = 40 if block_size == 4 else 8
    batch = InputBatch(max_model_len=1024, block_size=block_size, device=torch.device("cpu"))
    free = list(range(num_blocks))
    scheduled = []
    for rid, (computed, n) in requests.items():
        state = RequestState(rid, list(range(computed + n)), SamplingParams(), None, num_computed_tokens=computed)
        batch.add(state)
        batch.set_blocks(state, [free.pop(7 % len(free)) for _ in range(-(-(computed + n) // block_size))])
        scheduled.append((state, n))
    meta = batch.attention_metadata(batch.prepare(scheduled))
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, 2, 8).unbind(0)
    t = meta.num_tokens
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    want = StepAttention(TorchAttention(), [(k_cache.clone(), v_cache.clone())]).bind(meta)(q, k, v, 0)
    flash = FlashAttention.__new__(FlashAttention)
    flash._varlen, flash.paged = reference_varlen, block_size % 256 == 0
    got = StepAttention(flash, [(k_cache.clone(), v_cache.clone())]).bind(meta)(q, k, v, 0)
    assert torch.allclose(got, want, atol=1e-5)


def test_flash_attn_backend_request_is_checked() -> None:
    from worker.attention.registry import make_attention_backend

    with pytest.raises(ValueError, match="flash_attn needs a CUDA device"):
        make_attention_backend("flash_attn", torch.device("cpu"), 16, torch.float32)
    from worker.kernels.build import available

    # on CPU, auto takes the C++ backend wherever it builds, the portable one otherwise
    expected = "cpu" if available()[0] else "torch"
    assert make_attention_backend("auto", torch.device("cpu"), 16, torch.float32).name == expected
    with pytest.raises(ValueError, match="cpu needs the CPU and float32/bfloat16"):
        make_attention_backend("cpu", torch.device("cpu"), 16, torch.float16)


def test_gather_workspace_is_reused_and_matches_a_fresh_gather() -> None:
    from worker.attention.torch_backend import GatherWorkspace, gather_blocks

    cache = torch.randn(10, 4, 2, 8)
    ws = GatherWorkspace()
    big = ws.gather(cache, torch.tensor([3, 1, 4, 0, 5]), 0)
    first_ptr = big.data_ptr()
    small_ids = torch.tensor([9, 2])
    small = ws.gather(cache, small_ids, 0)  # fits in the buffer the larger gather made
    assert small.data_ptr() == first_ptr
    assert torch.equal(small, gather_blocks(cache, small_ids))
    assert torch.equal(ws.gather(cache, small_ids, 1), small) and ws.gather(cache, small_ids, 1).data_ptr() != first_ptr
