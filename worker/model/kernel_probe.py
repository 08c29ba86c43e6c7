"""The start-up probe: time this CPU's matmul kernels on the model's own shapes, then choose
the dtype, the quantization and int4's dense cut-over from the measurements.

CPU flags do not say which kernels are fast (an AVX2-only machine ran bf16 matmuls 2-6x
slower than fp32; AVX-512 BF16 machines ~2x faster; int4/int8 weight-only kernels read 4-8x
fewer bytes but compute slower at many tokens), so every choice left to `auto` is made
from timings of one decoder layer's linear products at one token (a decode step) and at
`WIDE` tokens (a batch or a prefill chunk), about a second in all.

    quantization auto   gguf for a GGUF file whose blocks, through stepserve's float32
                        kernel, beat a float32 dense matmul at one token; otherwise none (a
                        safetensors model is never quantized unasked)
    dtype auto          float32 for a GGUF file (the accuracy gate rules out bfloat16
                        there); else bfloat16 if its dense matmul beats float32's at both
                        widths, as --quantization int8/int4 (torch's kernels) require
    dense copy          (gguf, int4) a bf16 copy of the linear weights kept for steps of
                        many tokens, when dense bf16 beats the low-bit kernel from some width
                        on and the copy fits in a quarter of the memory; for gguf the copy's
                        products are timed on bf16 activations (the compiled forward fuses
                        the casts around them) against the blocks' kernel as a file's
                        layers run it (oneDNN runs the copy on AMX tiles where the CPU has
                        them)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig
from worker.model.quant import QuantizedWeight, quantize_int4, quantize_int8

log = logging.getLogger("stepserve.worker")

WIDE = 64  # tokens of the "many tokens" probe
CUT_OVER_WIDTHS = (4, 8, 16, 32, 64, 128, 256)
_PROBE_DIM_CAP = 4096  # larger models are probed on a slice of their matmul
_MAX_COPIES = 64


@dataclass(frozen=True)
class KernelChoice:
    """What the probe chose and what it measured (milliseconds per matmul)."""

    dtype: torch.dtype
    quantization: str
    dense_above: int | None
    timings_ms: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in self.timings_ms.items())
        cut = (
            ""
            if self.dense_above is None
            else f", {self.quantization} -> dense bf16 above {self.dense_above} tokens"
        )
        dtype = str(self.dtype).removeprefix("torch.")
        return f"dtype {dtype}, quantization {self.quantization}{cut} (ms: {parts})"


def median_ms(fn: Callable[[], object], repeat: int = 7) -> float:
    """Median wall time of `fn` in milliseconds, after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


class _Probe:
    """Timings of one decoder layer's linear products (q/k/v and gate/up fused, as the model
    runs them, then o and down) in every form, memoised.

    All four shapes, not one: the forms' relative speed depends on the shape (on a Zen 4,
    at 512 tokens the int8 kernel took 1.15x the bf16 copy's time on gate/up but 1.2-1.3x
    on the others; at 48 tokens 0.96x on gate/up, 0.64-0.78x on the others). Each form's
    timing runs over several copies of the layer, more bytes in float32 than twice the
    last-level cache, so one token streams its weights from memory as a decode step of the
    whole model does (one cache-resident matrix would hide the bandwidth that separates the
    forms at one token)."""

    def __init__(self, config: ModelConfig, int8_activations: bool = True) -> None:
        self.int8_activations = int8_activations  # the GGUF forms as the model will run them
        hidden, inter = config.hidden_size, config.intermediate_size
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        gen = torch.Generator().manual_seed(0)
        self.weights = [
            torch.randn(min(n, _PROBE_DIM_CAP), min(k, _PROBE_DIM_CAP) // 32 * 32 or 32,
                        generator=gen) * 0.02
            for n, k in ((q_size + 2 * kv_size, hidden), (hidden, q_size),
                         (2 * inter, hidden), (hidden, inter))
        ]
        layer_bytes = sum(w.nbytes for w in self.weights)
        self.copies = max(1, min(_MAX_COPIES, -(-2 * _llc_bytes() // layer_bytes)))
        self.timings: dict[str, float] = {}
        self._layers: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}

    def layers(self, form: str) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """`copies` x the layer's products in `form`, in the order of `weights`."""
        if form not in self._layers:
            self._layers[form] = [
                self._make(form, w) for _ in range(self.copies) for w in self.weights
            ]
        return self._layers[form]

    def _make(self, form: str, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        from worker.model.linear import make_linear

        if form in ("float32", "bfloat16"):
            dtype = getattr(torch, form)
            return make_linear(weight.to(dtype).clone(), dtype)
        if form == "gguf-dense":  # a GGUF layer's bf16 copy, bf16 in and out (see `ms`)
            copy = quantize_int4(weight).dequantize(torch.bfloat16)  # as GGUFLinear.keep_dense
            return lambda x: F.linear(x, copy)
        # "int8" / "int4": torch's kernels (bf16); "gguf-int8" / "gguf-int4": ours (fp32)
        kind, gguf = form.removeprefix("gguf-"), form.startswith("gguf-")
        q = quantize_int8(weight, 32 if gguf else None) if kind == "int8" else quantize_int4(weight)
        if gguf:
            q = as_stored_in_gguf(q)
        return make_linear(q, torch.float32 if gguf else torch.bfloat16,
                           int8_activations=self.int8_activations)

    def ms(self, form: str, tokens: int) -> float:
        """Milliseconds of one layer's products over `tokens` rows in `form` (weights from
        memory)."""
        key = f"{form}@{tokens}"
        if key not in self.timings:
            # The copy's product takes bf16 activations: the compiled forward fuses the layer's
            # float32 -> bf16 -> float32 casts into the operations around it (timed as
            # passes of their own they cost the copy 10-15 % and moved the cut-over from 64
            # to 128 tokens on a Zen 4, where whole steps of 128 tokens ran 1.12x faster on
            # the copy than on the blocks).
            low_bit = form.startswith("gguf-") and form != "gguf-dense"
            dtype = torch.float32 if form == "float32" or low_bit else torch.bfloat16
            inputs = [torch.randn(tokens, w.shape[1]).to(dtype) for w in self.weights]
            pairs = list(zip(self.layers(form), inputs * self.copies, strict=True))

            def sweep() -> None:
                for layer, x in pairs:
                    layer(x)

            with torch.inference_mode():
                self.timings[key] = median_ms(sweep, repeat=5) / self.copies
        return self.timings[key]


def as_stored_in_gguf(q: QuantizedWeight) -> QuantizedWeight:
    """`q` with its scales and offsets rounded to float16, as a GGUF file stores them: the
    layer then takes the form a file's layers take (csrc/int8_linear.cpp's tiles where the
    CPU runs them; float32 scales would leave it on the float32-activation kernel, which
    is 2-4x slower at many tokens, and the cut-over would come too early)."""
    offset = None if q.offset is None else q.offset.half().float()
    return QuantizedWeight(q.kind, q.q, q.scale.half().float(), offset, q.group_size)


def _llc_bytes() -> int:
    """The largest CPU cache's size (sysfs), or 32 MiB when it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        digits = text.rstrip("KMB")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=32 << 20)


def choose_kernels(
    config: ModelConfig, dtype: str, quantization: str, native_kinds: set[str], max_tokens: int,
    dense_copy_bytes: int, gguf_kernels: bool, gguf_wide_steps: str = "auto",
    gguf_int8_activations: bool = True, copied_kinds: set[str] | None = None,
) -> KernelChoice:
    """Resolve `auto` dtype / quantization on CPU by measurement. `native_kinds`: the low-bit
    kinds ("int4", "int8") a GGUF file stores natively (empty for other formats);
    `dense_copy_bytes`: what a bf16 copy of the linear weights would take; `gguf_kernels`:
    whether stepserve's C++ kernels built here; `gguf_wide_steps`: for gguf, "auto" (a bf16
    copy for wide steps where measured faster), "blocks" (no copy) or a cut-over in tokens;
    `gguf_int8_activations`: whether the GGUF products may take int8 activations (False:
    --gguf-activations float32), so the probe times the kernel the layers will run;
    `copied_kinds`: the kinds of the weights a bf16 copy would serve (the decoder layers'
    products; the head keeps none), `native_kinds` when not given."""
    probe = _Probe(config, gguf_int8_activations)
    if quantization == "auto":
        quantization = "none"
        # GGUF: its blocks through our float32 kernel where that beats float32 dense at one
        # token. The bfloat16 forms are never chosen for it: they miss the accuracy gate
        # (tests/worker/test_fast_mode.py; 96-98 % top-1 agreement on SmolLM2).
        eligible = bool(native_kinds) and gguf_kernels and dtype in ("auto", "float32")
        if eligible and all(
            probe.ms(f"gguf-{kind}", 1) < probe.ms("float32", 1) for kind in native_kinds
        ):
            quantization = "gguf"
        if native_kinds and dtype == "auto":
            dtype = "float32"
    if dtype == "auto":
        required = {"gguf": "float32", "int8": "bfloat16", "int4": "bfloat16"}.get(quantization)
        faster = all(probe.ms("bfloat16", n) < probe.ms("float32", n) for n in (1, WIDE))
        dtype = required or ("bfloat16" if faster else "float32")
    fits = dense_copy_bytes <= _memory_bytes() // 4
    dense_above = None
    if fits and quantization == "int4":
        dense_above = _cut_over(probe, max_tokens, "bfloat16", ["int4"])
    elif quantization == "gguf" and gguf_wide_steps.isdigit():
        dense_above = int(gguf_wide_steps)
    elif fits and quantization == "gguf" and gguf_wide_steps == "auto":
        kinds = native_kinds if copied_kinds is None else copied_kinds
        low = [f"gguf-{kind}" for kind in sorted(kinds)]
        dense_above = _cut_over(probe, max_tokens, "gguf-dense", low) if low else None
    return KernelChoice(getattr(torch, dtype), quantization, dense_above, dict(probe.timings))


def _cut_over(probe: _Probe, max_tokens: int, dense: str, low: list[str]) -> int | None:
    """The widest step the low-bit forms should still serve themselves: below the first
    width at which the `dense` form beats every one of them; None when one stays faster up
    to `max_tokens`."""
    previous = 1
    for width in CUT_OVER_WIDTHS:
        if width > max_tokens:
            break
        if all(probe.ms(dense, width) < probe.ms(form, width) for form in low):
            return previous
        previous = width
    return None


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def remembered(inputs: dict[str, object], choose: Callable[[], KernelChoice]) -> KernelChoice:
    """`choose()`'s result, measured once per model shape, request, CPU, thread count, torch
    and source, then read back: a restart neither waits for the probe again nor draws a
    different cut-over from a noisy timing (the compiled forward's packages are keyed by
    it). Kept under the compiled forward's cache directory; a choice that measured nothing
    (every setting explicit) is not kept."""
    import hashlib
    import json

    from worker.kernels.build import isa_flags
    from worker.model.aot_forward import cache_root, source_digest

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model_name = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
         if line.startswith("model name")), "",
    )
    key_text = json.dumps(
        {**inputs, "cpu": model_name, "isa": isa_flags(cpuinfo),
         "threads": torch.get_num_threads(), "torch": torch.__version__,
         "source": source_digest()},
        sort_keys=True, default=str,
    )
    path = cache_root() / "probe" / f"{hashlib.sha256(key_text.encode()).hexdigest()[:24]}.json"
    try:
        saved = json.loads(path.read_text())
        choice = KernelChoice(getattr(torch, saved["dtype"]), saved["quantization"],
                              saved["dense_above"], saved["timings_ms"])
        log.info("kernels as measured at an earlier start (%s)", path)
        return choice
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    choice = choose()
    if choice.timings_ms:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({
                "dtype": str(choice.dtype).removeprefix("torch."),
                "quantization": choice.quantization, "dense_above": choice.dense_above,
                "timings_ms": choice.timings_ms,
            }))
            tmp.replace(path)
        except OSError as exc:  # a read-only cache: measure again at the next start
            log.warning("could not keep the probe's choice in %s: %s", path, exc)
    return choice
