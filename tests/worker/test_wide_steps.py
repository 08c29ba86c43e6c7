"""Wide steps of a GGUF model on a bfloat16 copy of its weights: the layer takes the copy only
above its cut-over (and equals the block kernel below it), the copy's products stay within
bfloat16's rounding of the dequantized weight, the probe's cut-over rule on injected timings,
`--gguf-wide-steps` from the flag to the layers, the probe's choice remembered across starts,
and, on a CPU with AMX, oneDNN running the copy on AMX tiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from worker_modes import chunk_logits as _logits

from worker.kernels.build import available
from worker.model import kernel_probe
from worker.model.kernel_probe import KernelChoice, _cut_over, choose_kernels, remembered
from worker.model.linear import GGUFLinear, make_linear
from worker.model.quant import QuantizedWeight, quantize_int4

needs_kernels = pytest.mark.skipif(not available()[0], reason="the CPU kernels did not build here")


def _weight(n: int = 48, k: int = 256, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = quantize_int4(torch.randn(n, k, generator=gen) * 0.05)
    assert q.offset is not None  # scales as GGUF stores them, exact in float16
    return QuantizedWeight(q.kind, q.q, q.scale.half().float(), q.offset.half().float(), q.group_size)


@needs_kernels
def test_the_copy_serves_only_steps_above_the_cut_over() -> None:
    w = _weight()
    blocks = make_linear(w, torch.float32)
    copy = make_linear(w, torch.float32, dense_above=8)
    assert isinstance(copy, GGUFLinear) and copy.dense is not None and blocks.dense is None
    assert copy.dense.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    narrow, wide = torch.randn(8, 256, generator=gen), torch.randn(9, 256, generator=gen)
    with torch.inference_mode():
        assert torch.equal(copy(narrow), blocks(narrow))  # at the cut-over: the blocks
        y = copy(wide)
        assert y.dtype == torch.float32
        assert torch.equal(y, F.linear(wide.bfloat16(), copy.dense).float())
        assert not torch.equal(y, blocks(wide))


@needs_kernels
def test_the_copy_is_within_bfloat16_rounding_of_the_weight() -> None:
    w = _weight(n=64, k=512, seed=3)
    layer = make_linear(w, torch.float32, dense_above=0)
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(4))
    ref = x.double() @ w.dequantize().double().T
    with torch.inference_mode():
        err = (layer(x).double() - ref).abs()
    # inputs, weights and output each rounded to 8 significant bits: a few 2^-9 of |x| |w|
    bound = 4 * 2.0**-8 * (x.abs().double() @ w.dequantize().abs().double().T)
    assert bool((err <= bound).all()), float((err / bound).max())


class _Timings:
    """A probe whose timings are given: {form: {width: ms}}."""

    def __init__(self, table: dict[str, dict[int, float]]) -> None:
        self.table = table
        self.asked: list[tuple[str, int]] = []

    def ms(self, form: str, tokens: int) -> float:
        self.asked.append((form, tokens))
        return self.table[form][tokens]


def test_the_cut_over_is_below_the_first_width_where_the_copy_beats_every_form() -> None:
    widths = kernel_probe.CUT_OVER_WIDTHS
    probe = _Timings({
        "gguf-dense": dict.fromkeys(widths, 1.0),
        "gguf-int4": {w: w / 8 for w in widths},  # beaten from 16 on
        "gguf-int8": {w: w / 16 for w in widths},  # beaten from 32 on
    })
    assert _cut_over(probe, 512, "gguf-dense", ["gguf-int4", "gguf-int8"]) == 16  # type: ignore[arg-type]
    assert _cut_over(probe, 512, "gguf-dense", ["gguf-int4"]) == 8  # type: ignore[arg-type]
    assert _cut_over(probe, 16, "gguf-dense", ["gguf-int8"]) is None  # type: ignore[arg-type]
    never = _Timings({"gguf-dense": dict.fromkeys(widths, 9.0), "gguf-int4": dict.fromkeys(widths, 1.0)})
    assert _cut_over(never, 512, "gguf-dense", ["gguf-int4"]) is None  # type: ignore[arg-type]


# a small model's shapes: hidden 64, 4 heads of 16 (2 for keys and values), MLP 128
_SMALL: Any = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("int8_activations", [True, False])
def test_the_probe_times_the_gguf_kernel_the_layers_run(int8_activations: bool) -> None:
    """A GGUF file stores its scales in float16, so its layers take the tiled int8 kernel
    where the CPU runs it; the probe's own quantized weights must take the same form (with
    float32 scales they fell back to the float32-activation kernel, 2-4x slower at many
    tokens, and the cut-over to the bf16 copy came far too early)."""
    from worker.model.linear import int8_supported

    probe = kernel_probe._Probe(_SMALL, int8_activations)
    for form in ("gguf-int4", "gguf-int8"):
        layers = probe.layers(form)
        assert len(layers) == 4 * probe.copies
        for layer, weight in zip(layers, probe.weights, strict=False):
            assert isinstance(layer, GGUFLinear)
            assert layer.tiled == (int8_activations and int8_supported())
            # the product of the probe's weight, within its 4- or 8-bit rounding
            x = torch.randn(3, weight.shape[1])
            expected = x @ weight.T
            assert (layer(x) - expected).norm() < 0.2 * expected.norm()


def test_the_probe_times_one_layers_products_in_the_models_shapes() -> None:
    probe = kernel_probe._Probe(_SMALL)
    # q/k/v fused, o, gate/up fused, down
    assert [tuple(w.shape) for w in probe.weights] == [(64 + 2 * 32, 64), (64, 64), (256, 64), (64, 128)]
    assert probe.ms("gguf-dense", 4) > 0 and set(probe.timings) == {"gguf-dense@4"}


def test_an_explicit_setting_measures_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_probe(*args: Any) -> None:
        raise AssertionError("the probe ran")

    monkeypatch.setattr(kernel_probe._Probe, "ms", no_probe)
    config: Any = _SMALL
    args: dict[str, Any] = {"native_kinds": {"int4"}, "max_tokens": 256, "dense_copy_bytes": 1,
                            "gguf_kernels": True}
    fixed = choose_kernels(config, "float32", "gguf", gguf_wide_steps="32", **args)
    assert (fixed.quantization, fixed.dense_above, fixed.timings_ms) == ("gguf", 32, {})
    assert choose_kernels(config, "float32", "gguf", gguf_wide_steps="blocks", **args).dense_above is None


def test_the_cut_over_weighs_only_the_kinds_a_copy_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's file: Q4_1 products, a Q8_0 embedding table that is also the head. The head
    keeps no bf16 copy, so how fast its kind runs wide steps does not move the cut-over."""
    widths = kernel_probe.CUT_OVER_WIDTHS
    table = {"gguf-dense": dict.fromkeys(widths, 1.0),
             "gguf-int4": {w: w / 100 for w in widths},  # beaten from 128 on
             "gguf-int8": dict.fromkeys(widths, 0.5)}  # never beaten
    monkeypatch.setattr(kernel_probe._Probe, "ms", lambda self, form, tokens: table[form][tokens])
    args: dict[str, Any] = {"native_kinds": {"int4", "int8"}, "max_tokens": 512,
                            "dense_copy_bytes": 1, "gguf_kernels": True}
    assert choose_kernels(_SMALL, "float32", "gguf", copied_kinds={"int4"}, **args).dense_above == 64
    assert choose_kernels(_SMALL, "float32", "gguf", **args).dense_above is None
    assert choose_kernels(_SMALL, "float32", "gguf", copied_kinds=set(), **args).dense_above is None


def test_the_choice_is_remembered_per_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSERVE_AOT_CACHE", str(tmp_path))
    calls: list[int] = []

    def measured(cut: int) -> KernelChoice:
        calls.append(cut)
        return KernelChoice(torch.float32, "gguf", cut, {"gguf-int4@1": 0.1})

    first = remembered({"model": "a"}, lambda: measured(8))
    again = remembered({"model": "a"}, lambda: measured(16))  # a noisier start: not measured
    other = remembered({"model": "b"}, lambda: measured(16))
    assert calls == [8, 16]
    assert (first.dense_above, again.dense_above, other.dense_above) == (8, 8, 16)
    assert again.dtype == torch.float32 and again.timings_ms == {"gguf-int4@1": 0.1}
    kept = list((tmp_path / "probe").glob("*.json"))
    assert len(kept) == 2 and json.loads(kept[0].read_text())["quantization"] == "gguf"
    # nothing measured: nothing kept
    remembered({"model": "c"}, lambda: KernelChoice(torch.float32, "gguf", None))
    assert len(list((tmp_path / "probe").glob("*.json"))) == 2
    # a damaged file is measured again
    for path in kept:
        path.write_text("{")
    assert remembered({"model": "a"}, lambda: measured(4)).dense_above == 4


def test_the_flag_reaches_the_worker_and_bad_values_are_refused() -> None:
    from service.cli.serve import worker_config
    from service.cli.serve_args import build_parser
    from worker.config import WorkerConfig

    assert worker_config(build_parser().parse_args([])).gguf_wide_steps == "auto"
    for value in ("blocks", "64"):
        assert worker_config(build_parser().parse_args(["--gguf-wide-steps", value])).gguf_wide_steps == value
    for bad in ("fast", "-1", "1.5"):
        with pytest.raises(ValueError, match="gguf_wide_steps must be"):
            WorkerConfig(gguf_wide_steps=bad)


@needs_kernels
@pytest.mark.slow
def test_a_runner_keeps_copies_as_asked(smol_runner: Any) -> None:
    """On the default model: "blocks" keeps no copy and attends in float32; "4" keeps one in
    every fused layer (and attends in bfloat16 where the build can) and a 12-token chunk
    through it picks the same tokens as the float32 reference."""
    from worker.config import WorkerConfig
    from worker.execution.model_runner import ModelRunner

    def runner(wide: str) -> Any:
        return ModelRunner(WorkerConfig(device="cpu", kv_cache_memory=16 << 20, max_model_len=256,
                                        num_threads=1, enforce_eager=True, gguf_wide_steps=wide))

    blocks = runner("blocks")
    assert blocks.kernels.dense_above is None and blocks.info.extra["wide_steps"] == "low-bit"
    assert not blocks.attention.backend.bf16_chunks  # float32 attention with the blocks' numerics
    assert not any(isinstance(m, GGUFLinear) and m.dense is not None for m in blocks.model.modules())
    del blocks
    wide = runner("4")
    copies = [m for m in wide.model.modules() if isinstance(m, GGUFLinear) and m.dense is not None]
    assert copies and all(m.dense_above == 4 for m in copies)
    # long chunks attend in bfloat16 with the copy, where the build has AVX512-BF16
    bf16_attention = bool(torch.ops.stepserve_cpu.chunk_bf16_supported())
    assert wide.attention.backend.bf16_chunks == bf16_attention
    assert wide.attention.backend.bf16_above == (4 if bf16_attention else 1 << 62)
    amx = torch.cpu._is_amx_tile_supported()
    assert wide.info.extra["wide_steps"] == f"bf16-{'amx' if amx else 'avx'} above 4" + (
        " with bf16 attention" if bf16_attention else "")
    tokens = list(range(100, 112))
    try:
        ours = _logits(wide, tokens, 0, 12).argmax(-1)
    finally:
        wide.batch.remove("tf")
    try:
        ref = _logits(smol_runner, tokens, 0, 12).argmax(-1)
    finally:
        smol_runner.batch.remove("tf")
    assert (ours == ref).float().mean() >= 0.9


@needs_kernels
@pytest.mark.slow
def test_chunks_attend_in_bf16_only_in_steps_on_the_copy() -> None:
    """With the cut-over at 24 tokens, a 20-token chunk (the chunk kernel's, above 16, but
    its products on the blocks) attends in float32, and a 40-token one (on the copy) in
    bfloat16 where the build has AVX512-BF16."""
    from worker.attention.cpu_backend import ALL_QUERIES
    from worker.config import WorkerConfig
    from worker.execution.model_runner import ModelRunner

    runner = ModelRunner(WorkerConfig(device="cpu", kv_cache_memory=16 << 20, max_model_len=256,
                                      num_threads=1, enforce_eager=True, gguf_wide_steps="24"))
    backend = runner.attention.backend
    bf16 = bool(torch.ops.stepserve_cpu.chunk_bf16_supported())
    assert backend.bf16_chunks == bf16
    tokens = list(range(100, 140))

    def logits(n: int, float32_attention: bool) -> torch.Tensor:
        above = backend.bf16_above
        backend.bf16_above = ALL_QUERIES if float32_attention else above
        try:
            return _logits(runner, tokens, 0, n)
        finally:
            backend.bf16_above = above
            runner.batch.remove("tf")

    assert torch.equal(logits(20, False), logits(20, True))
    assert torch.equal(logits(40, False), logits(40, True)) != bf16


@needs_kernels
@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX tiles")
def test_on_amx_the_copy_runs_on_tiles() -> None:
    """oneDNN's own log of the wide step's matmul names an AMX implementation."""
    code = (
        "import torch\n"
        "from worker.model.linear import make_linear\n"
        "from worker.model.quant import quantize_int4\n"
        "layer = make_linear(quantize_int4(torch.randn(256, 512) * 0.05), torch.float32, dense_above=0)\n"
        "with torch.inference_mode():\n"
        "    layer(torch.randn(64, 512))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ONEDNN_VERBOSE": "1"}, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    matmuls = [line for line in done.stdout.splitlines() if ",exec," in line and ",matmul," in line]
    assert matmuls, done.stdout[-2000:]
    assert any("amx" in line for line in matmuls), matmuls
