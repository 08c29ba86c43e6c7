"""`ModelRunner`: loads the model and KV cache, and executes step plans as diffs.

Plans are applied by `worker.execution.step_executor` (the one plan consumer); this runner is
the model behind it: swaps between the KV cache and its host pool, then one forward over the
flattened batch, logits for the requests whose chunk reaches their last known token, and the
sampler.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from common.arith import cdiv
from common.grammar import GrammarCompiler, tokenizer_json
from common.model_files import resolve_model_path
from scheduler.output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from scheduler.sampling import SamplingParams
from worker.attention.cpu_backend import CpuPagedAttention
from worker.attention.registry import make_attention_backend
from worker.attention.step import StepAttention
from worker.config import BUILDING_NOTE, WorkerConfig, WorkerConfigError, WorkerInfo
from worker.execution.copy_probe import measure_copy_bandwidth
from worker.execution.grammar_masks import GrammarMasks
from worker.execution.input_batch import InputBatch, RequestState, StepInputs, SwapPairs
from worker.execution.kv_cache import KVCache, bytes_per_block, num_cpu_blocks, num_gpu_blocks
from worker.execution.logprobs import token_logprobs
from worker.execution.sampler import Sampler, SamplingMetadata
from worker.execution.step_executor import PlanRunner, StepExecutor
from worker.model.aot_forward import AotForward, BackgroundBuild, token_ranges
from worker.model.compiled_forward import Forward, compile_forward, compiler_missing, one_token_ms
from worker.model.config import ModelConfig
from worker.model.kernel_probe import KernelChoice, choose_kernels, remembered
from worker.model.linear import int8_supported
from worker.model.llama import LlamaForCausalLM
from worker.model.loader import (
    expected_shapes,
    gguf_native_kinds,
    load_config,
    load_weights,
)
from worker.model.quant import Weight
from worker.model.weight_form import WeightForm

log = logging.getLogger("stepserve.worker")

MAX_DEFAULT_MODEL_LEN = 8192
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def resolve_kv_dtype(
    name: str, dtype: torch.dtype, device: torch.device, quantization: str, backend: str
) -> torch.dtype:
    """The KV cache's element type (int8: the rows of `worker.attention.kv_rows`). auto:
    float16 where the C++ CPU attention reads the cache for the GGUF kernel's float32
    activations (a decode at long contexts reads its cache more than its weights: half the
    bytes measured ~0.66x the attention time, and float16 keeps 11 bits, within the fast
    mode's accuracy gate); else the model's dtype, so the reference mode (float32, no
    quantization) stays exactly float32. On CUDA only the model's dtype."""
    if name == "auto":
        fast_cpu = (
            device.type == "cpu"
            and backend == "cpu"
            and quantization == "gguf"
            and dtype == torch.float32
        )
        return torch.float16 if fast_cpu else dtype
    wanted = torch.int8 if name == "int8" else DTYPES[name]
    if device.type != "cpu" and wanted != dtype:
        raise ValueError(
            f"kv_cache_dtype={name}: on {device.type} the KV cache takes "
            f"the model's dtype ({dtype})"
        )
    return wanted


def resolve_max_model_len(config: WorkerConfig, model: ModelConfig) -> int:
    limit = model.max_position_embeddings
    if model.sliding_window is not None:
        limit = min(limit, model.sliding_window)  # no sliding-window attention: stay inside it
    if config.max_model_len is None:
        return min(limit, MAX_DEFAULT_MODEL_LEN)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {limit}")
    return config.max_model_len


def served_model_name(path: Path) -> str:
    """Directory name, or GGUF file stem without its quantization tag (".Q4_1", "-Q4_K_M")."""
    if path.suffix != ".gguf":
        return path.name
    return re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", path.stem, flags=re.IGNORECASE)


class ModelRunner(PlanRunner):
    """The worker's model side: `.info` at start-up, `.execute(plan)` every step."""

    def __init__(
        self, config: WorkerConfig, *,
        loaded: tuple[ModelConfig, dict[str, Weight]] | None = None,
        sampler: Sampler | None = None,
    ) -> None:
        """`loaded` (config, weights) skips reading `config.model` (benchmarks, tests); its
        weight dict is consumed (emptied), so unfused copies do not outlive the model."""
        self.config = config
        self.device = resolve_device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        path = Path("<in-memory>") if loaded is not None else resolve_model_path(config.model)
        self._path = path
        model_config = loaded[0] if loaded is not None else load_config(path)
        self.max_model_len = resolve_max_model_len(config, model_config)
        self.kernels = self._choose_kernels(model_config, path)
        self.dtype = self.kernels.dtype
        log.info("kernels: %s", self.kernels.describe())
        native = self.kernels.quantization != "none" and path.suffix == ".gguf"
        model_config, weights = (
            loaded if loaded is not None else load_weights(path, self.dtype, native)
        )
        self.model_config = model_config
        backend = make_attention_backend(
            config.attention_backend, self.device, config.block_size, self.dtype,
            config.batch_invariant,
        )
        if isinstance(backend, CpuPagedAttention):
            # long chunks' attention in bfloat16 in the steps whose linear products already are
            backend.use_bf16_chunks(self.kernels.dense_above)
        if config.batch_invariant and (
            self.kernels.quantization != "gguf" or backend.name != "cpu"
        ):
            raise ValueError(
                "batch-invariant mode needs the GGUF kernel (a GGUF model with Q4_0/Q4_1/Q8_0 "
                "weights, float32) and "
                "the C++ CPU attention; this worker chose quantization "
                f"{self.kernels.quantization} and "
                f"{backend.name} attention"
            )
        self.gguf_activations = self._gguf_activations()
        self.kv_dtype = resolve_kv_dtype(
            config.kv_cache_dtype, self.dtype, self.device, self.kernels.quantization, backend.name
        )
        self.model = self._build_model(weights)
        self.kv_cache = self._make_kv_cache()
        self.attention = StepAttention(backend, self.kv_cache.layers())
        self.batch = InputBatch(
            self.max_model_len, config.block_size, self.device, num_blocks=self.kv_cache.num_blocks
        )
        self.executor = StepExecutor(self.batch, self)
        self.sampler = sampler if sampler is not None else Sampler(seed=config.seed)
        self.grammars = GrammarMasks(self._grammar_compiler)
        self._building: tuple[BackgroundBuild, AotForward] | None = None
        self.forward, self.compiled, self.compile_note = self._forward()
        log.info("forward: %s", self.compile_note)
        self.info = self._info(path)

    def _choose_kernels(self, model_config: ModelConfig, path: Path) -> KernelChoice:
        config = self.config
        if self.device.type != "cpu":
            if config.quantization not in ("auto", "none"):
                raise ValueError(
                    f"quantization={config.quantization} runs on CPU only (torch's CPU kernels)"
                )
            return KernelChoice(resolve_dtype(config.dtype, self.device), "none", None)
        if config.quantization == "gguf" and path.suffix != ".gguf":
            raise ValueError(f"quantization=gguf needs a GGUF model file, got {path}")
        native, copied = gguf_native_kinds(path) if path.suffix == ".gguf" else (set(), set())
        linear_params = sum(
            math.prod(shape)
            for name, shape in expected_shapes(model_config).items()
            if name.endswith("proj.weight")
        )
        from worker.kernels.build import available

        # a row's product on the bf16 copy would depend on how many rows share its step
        wide = "blocks" if config.batch_invariant else config.gguf_wide_steps
        int8_activations = config.gguf_activations != "float32"
        inputs = {
            "model": dataclasses.asdict(model_config), "dtype": config.dtype,
            "quantization": config.quantization, "native": sorted(native),
            "max_tokens": config.max_num_batched_tokens, "copy_bytes": 2 * linear_params,
            "gguf_kernels": available()[0], "gguf_wide_steps": wide,
            "gguf_int8_activations": int8_activations, "copied": sorted(copied),
        }
        return remembered(inputs, lambda: choose_kernels(
            model_config, config.dtype, config.quantization, native,
            config.max_num_batched_tokens, dense_copy_bytes=2 * linear_params,
            gguf_kernels=available()[0], gguf_wide_steps=wide,
            gguf_int8_activations=int8_activations, copied_kinds=copied,
        ))

    def _forward(self) -> tuple[Forward, bool, str]:
        """The forward the steps start with: compiled where that measures faster (see
        `worker.model.aot_forward`), else eager, maybe while the compiled one is built."""
        if self.config.enforce_eager:
            return self.model.forward, False, "eager (--enforce-eager)"
        if self.device.type != "cpu":
            return (
                self.model.forward,
                False,
                "eager (the compiled forward is built for the CPU only)",
            )
        missing = compiler_missing()
        if missing is not None:
            return self.model.forward, False, f"eager: {missing}"
        cut = self.kernels.dense_above
        if getattr(self.attention.backend, "op", None) is None:
            return self._jit_forward(cut)
        top = max(self.config.max_num_batched_tokens, 2)
        blocks = self.kv_cache.num_blocks  # the start-up check runs each range's first width
        ranges = [
            r for r in token_ranges(top, cut) if cdiv(r[0], self.config.block_size) <= blocks
        ]
        aot = AotForward(self.model, self.attention.compiled, ranges)
        if not aot.built():
            if not self.config.compile_wait:
                self._building = (BackgroundBuild(aot, self._settings()), aot)
                return self.model.forward, False, BUILDING_NOTE
            try:
                seconds = aot.build()
                built = aot.load()
            except Exception as exc:  # an export or compiler failure: run eagerly, say why
                log.exception("building the compiled forward failed; running eagerly")
                return self.model.forward, False, f"eager: compilation failed ({exc!s:.200})"
            return self._keep_if_faster(built, f"compiled in {seconds:.0f} s", ranges)
        start = time.perf_counter()
        try:
            forward = aot.load()
        except Exception as exc:  # a damaged or stale package: rebuild it next time
            log.exception("loading the compiled forward failed; running eagerly")
            shutil.rmtree(aot.directory, ignore_errors=True)
            return self.model.forward, False, f"eager: loading failed ({exc!s:.200})"
        loaded = f"loaded from {aot.directory} in {time.perf_counter() - start:.2f} s"
        return self._keep_if_faster(forward, loaded, ranges)

    def _keep_if_faster(
        self, forward: Forward, how: str, ranges: list[tuple[int, int]]
    ) -> tuple[Forward, bool, str]:
        """`forward` if it agrees with the eager one at each range's first width and is faster
        at one token; else the eager forward, and why."""
        with torch.inference_mode():
            for lo, _ in ranges:
                want = self._hidden(self.model.forward, lo)
                got = self._hidden(forward, lo)
                error = float((got - want).norm() / want.norm().clamp_min(1e-12))
                if not error < 1e-2:
                    return self.model.forward, False, (
                        f"eager: the compiled forward disagrees at {lo} tokens "
                        f"(relative error {error:.2g}; {how})"
                    )
            eager_ms, compiled_ms = (
                one_token_ms(fn, self._dummy_forward) for fn in (self.model.forward, forward)
            )
        timing = f"1-token forward {compiled_ms:.2f} ms compiled vs {eager_ms:.2f} ms eager; {how}"
        if compiled_ms >= eager_ms:
            return self.model.forward, False, f"eager: the compiled one is not faster ({timing})"
        return forward, True, f"compiled ({timing})"

    def _hidden(self, forward: Forward, tokens: int) -> torch.Tensor:
        out: list[torch.Tensor] = []

        def keep(ids: torch.Tensor, positions: torch.Tensor, attention: Any) -> torch.Tensor:
            out.append(forward(ids, positions, attention).clone())
            return out[-1]

        self._dummy_forward(keep, tokens)
        return out[0]

    def _jit_forward(self, cut: int | None) -> tuple[Forward, bool, str]:
        """torch.compile, for attention through the Python op (a package cannot call it)."""
        widths = [w for w in (1, 2, None if cut is None else cut + 1) if w is not None]
        widths = [w for w in widths if cdiv(w, self.config.block_size) <= self.kv_cache.num_blocks]
        with torch.inference_mode():
            result = compile_forward(
                self.model.forward, self.attention.compiled, self._dummy_forward, widths
            )
        return result.forward, result.compiled, result.note

    def wide_steps(self) -> str:
        """How steps of many tokens run: "bf16-amx above 8" (a bf16 copy of the low-bit
        weights, on AMX tiles where the CPU has them and oneDNN will use them; " with bf16
        attention" where long chunks also attend in bfloat16), or the weights' own form
        ("low-bit")."""
        if self.kernels.dense_above is None:
            return "low-bit" if self.kernels.quantization != "none" else "dense"
        amx = bool(torch.cpu._is_amx_tile_supported())
        bf16_chunks = getattr(self.attention.backend, "bf16_chunks", False)
        attention = " with bf16 attention" if bf16_chunks else ""
        return f"bf16-{'amx' if amx else 'avx'} above {self.kernels.dense_above}{attention}"

    def _settings(self) -> dict[str, object]:
        """This worker's settings with the start-up probe's choices fixed, so that a child
        process builds the same module."""
        return {
            **dataclasses.asdict(self.config),
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": self.kernels.quantization,
            "gguf_activations": self.gguf_activations if self.gguf_activations != "none"
            else "auto",
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "gguf_wide_steps": "blocks" if self.kernels.dense_above is None
            else str(self.kernels.dense_above),
        }

    def forward_pending(self) -> bool:
        """A compiled forward is being built in the background (`poll_forward` swaps it in)."""
        return self._building is not None

    def poll_forward(self) -> str | None:
        """Between steps (the worker process calls it): swap in the forward a background
        build finished, and say what runs now; None while it is still building."""
        if self._building is None:
            return None
        build, aot = self._building
        if not build.done():
            return None
        self._building = None
        if build.error is None:
            try:
                self.forward, self.compiled = aot.load(), True
                self.compile_note = f"compiled (built in {build.seconds:.0f} s, swapped in)"
            except Exception as exc:  # noqa: BLE001  a package that does not load: stay eager
                build.error = f"loading failed ({type(exc).__name__}: {exc!s:.200})"
        if build.error is not None:
            self.compile_note = f"eager: building the compiled forward failed ({build.error})"
        log.info("forward: %s", self.compile_note)
        extra = {**self.info.extra, "forward": self.compile_note}
        self.info = replace(self.info, compiled=self.compiled, extra=extra)
        return self.compile_note

    def _dummy_forward(self, forward: Forward, tokens: int) -> None:
        """One forward of `tokens` placeholder tokens over the first KV blocks (free at
        start-up; whatever it writes there is overwritten before any request reads it)."""
        state = RequestState("__warm_up__", [0] * tokens, SamplingParams(), None)
        self.batch.add(state)
        try:
            self.batch.set_blocks(state, list(range(cdiv(tokens, self.config.block_size))))
            step = self.batch.prepare([(state, tokens)])
            to_device = self.batch.to_device
            forward(to_device(step.input_ids), to_device(step.positions),
                    self.attention.bind(self.batch.attention_metadata(step)))
        finally:
            self.batch.remove(state.req_id)

    def _gguf_activations(self) -> str:
        """The activations of the GGUF products: int8 (two levels, csrc/int8_linear.cpp) or
        float32 (csrc/lowbit_linear.cpp); "none" without the GGUF kernel."""
        wanted = self.config.gguf_activations
        if self.kernels.quantization != "gguf":
            return "none"
        if wanted == "float32":
            return wanted
        if int8_supported():
            log.info(
                "GGUF products: activations as two int8 levels per block, integer dot products"
            )
            return "int8"
        if wanted == "int8":
            raise ValueError("gguf_activations=int8 needs the CPU kernels built with AVX512-VNNI "
                             "or AVX2 (this CPU or build lacks both); use auto or float32")
        return "float32"

    def _build_model(self, weights: dict[str, Weight]) -> LlamaForCausalLM:
        form = WeightForm(self.dtype, self.kernels.quantization, self.kernels.dense_above,  # type: ignore[arg-type]
                          self.gguf_activations != "float32")
        for name in list(weights):
            w = weights[name]
            if isinstance(w, torch.Tensor):
                # norms and rope stay float32, as the float32 residual stream they act on
                keep32 = name == "rope_freqs" or name.endswith("norm.weight")
                weights[name] = w.to(self.device, torch.float32 if keep32 else self.dtype)
        return LlamaForCausalLM(self.model_config, weights, self.max_model_len, form).to(
            self.device
        )

    def _make_kv_cache(self) -> KVCache:
        block_bytes = bytes_per_block(self.model_config, self.config.block_size, self.kv_dtype)
        if self.device.type == "cuda":
            peak = self._profile_peak_bytes()
            blocks = num_gpu_blocks(
                self.device, self.config.gpu_memory_utilization, peak, block_bytes
            )
        else:
            blocks = num_cpu_blocks(self.config.kv_cache_memory, block_bytes)
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if self.config.kv_cache_memory > memory:
                raise WorkerConfigError(
                    "kv_cache_memory", f"kv_cache_memory asks for {self.config.kv_cache_memory} "
                    f"bytes, more than this machine's {memory / (1 << 30):.1f} GiB of memory "
                    "(a plain number means GiB)"
                )
            if blocks < 1:
                raise WorkerConfigError(
                    "kv_cache_memory", f"kv_cache_memory holds no KV block of "
                    f"{self.config.block_size} tokens ({block_bytes} bytes); give it more memory"
                )
        return KVCache(
            self.model_config, blocks, self.config.block_size, self.kv_dtype, self.device,
            self.config.swap_space,
        )

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak CUDA memory of a forward over max_num_batched_tokens (one long prefill)."""
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        bs = self.config.block_size
        scratch = KVCache(self.model_config, cdiv(tokens, bs), bs, self.kv_dtype, self.device)
        batch = InputBatch(self.max_model_len, bs, self.device, rows=1)
        state = RequestState("profile", [0] * tokens, None, None)  # type: ignore[arg-type]
        batch.add(state)
        batch.set_blocks(state, list(range(scratch.num_blocks)))
        torch.cuda.reset_peak_memory_stats(self.device)
        step = batch.prepare([(state, tokens)])
        attention = StepAttention(self.attention.backend, scratch.layers()).bind(
            batch.attention_metadata(step)
        )
        hidden = self.model(
            batch.to_device(step.input_ids), batch.to_device(step.positions), attention
        )
        self.model.compute_logits(hidden[batch.to_device(step.logits_indices)])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch.device_cache.nbytes
        del scratch, hidden
        torch.cuda.empty_cache()
        return int(peak)

    def _info(self, path: Path) -> WorkerInfo:
        c = self.model_config
        name = served_model_name(path)
        return WorkerInfo(
            model_name=name,
            model_path=str(path),
            architecture=c.architecture,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.attention.backend.name,
            vocab_size=c.vocab_size,
            eos_token_ids=c.eos_token_ids,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            num_gpu_blocks=self.kv_cache.num_blocks,
            num_cpu_blocks=self.kv_cache.num_host_blocks,
            kv_bytes_per_token=self.kv_cache.block_bytes // self.config.block_size,
            num_params=sum(math.prod(shape) for shape in expected_shapes(c).values()),
            quantization=self.kernels.quantization,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            num_threads=torch.get_num_threads(),
            weight_bytes=self.model.weight_bytes,
            compiled=self.compiled,
            batch_invariant=self.config.batch_invariant,
            extra={
                "forward": self.compile_note,
                "gguf_activations": self.gguf_activations,
                "wide_steps": self.wide_steps(),
                **{k: f"{v:.4f}" for k, v in self.kernels.timings_ms.items()},
            },
            copy_bandwidth=measure_copy_bandwidth(self.kv_cache),
            structured_outputs=self._path.suffix == ".gguf" or self._path.is_dir(),
        )

    def _prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor) -> None:
        """Each prompt token's logprob (from the raw logits, as vLLM's prompt_logprobs) at the
        positions this step computes, for the requests that ask; a prompt split into chunks
        fills its positions chunk by chunk."""
        start = 0
        for state, count in step.scheduled:
            positions = state.prompt_positions(count)
            if positions:
                first = start + positions.start - state.num_computed_tokens
                rows = hidden[first : first + len(positions)]
                logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
                targets = torch.tensor(
                    state.prompt_token_ids[positions.start + 1 : positions.stop + 1],
                    device=logprobs.device,
                )
                counts = [state.sampling_params.prompt_logprobs or 0] * len(positions)
                store = state.prompt_logprobs
                assert store is not None
                found = token_logprobs(logprobs, targets, counts, with_rank=True)
                for pos, lp in zip(positions, found, strict=True):
                    store[pos + 1] = lp
            start += count

    def _grammar_compiler(self) -> GrammarCompiler:
        """The grammar compiler over this model's tokenizer (structured outputs)."""
        from common.tokenizer import load_tokenizer

        backend = load_tokenizer(self._path).backend_tokenizer
        return GrammarCompiler(
            lambda: tokenizer_json(backend), self.model_config.vocab_size,
            self.info.eos_token_ids[0],
        )

    def prepare_grammar(self, text: str) -> None:
        """Start compiling a grammar a request will need (off the step)."""
        self.grammars.prepare(text)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """`PlanRunner.execute` with autograd off (no version counters, no graph)."""
        return self.executor.execute(plan)

    # ---- the StepModel side (worker.execution.step_executor) ------------------------------

    def swap(self, swap_out: SwapPairs, swap_in: SwapPairs) -> None:
        self.kv_cache.swap_out(swap_out)
        self.kv_cache.swap_in(swap_in)

    def run(self, step: StepInputs) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Forward over the step, then sample the requests whose chunk reached their end."""
        to_device = self.batch.to_device
        attention = self.attention.bind(self.batch.attention_metadata(step))
        hidden = self.forward(to_device(step.input_ids), to_device(step.positions), attention)
        self._prompt_logprobs(step, hidden)
        states = step.sampling_states
        if not states:
            return [], []
        logits = self.model.compute_logits(hidden[to_device(step.logits_indices)])
        meta = SamplingMetadata(
            params=[s.sampling_params for s in states],
            generators=[s.generator for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            eos_token_ids=self.info.eos_token_ids,
            grammar_allowed=self.grammars.bitmask(states, logits.shape[-1]),
        )
        out = self.sampler.sample(logits, meta)
        self.grammars.advance(states, out.token_ids)
        return out.token_ids, out.logprobs
