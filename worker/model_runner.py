"""`ModelRunner`: loads the model and KV cache, and executes step plans as diffs.

Per plan, in this order: drop finished/aborted requests; take preempted ones out of the batch
(keeping tokens and rng); swap out, then swap in; add new requests; extend (or, on resume,
replace) block tables; then one forward over the flattened batch, logits for the requests
whose chunk reaches their last known token, and the sampler. A sampled token is appended to
the request at once, so the next plan can be executed before the scheduler has seen it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from scheduler.kv_manager import cdiv
from scheduler.output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from worker.attention import make_attention_backend
from worker.config import WorkerConfig, WorkerInfo
from worker.copy_probe import measure_copy_bandwidth
from worker.input_batch import InputBatch, RequestState, StepInputs
from worker.kv_cache import KVCache, bytes_per_block, num_cpu_blocks, num_gpu_blocks
from worker.loader import load_weights, resolve_model_path
from worker.model import LlamaForCausalLM
from worker.model_config import ModelConfig
from worker.sampler import Sampler, SamplingMetadata

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


class ModelRunner:
    """The worker's model side: `.info` at start-up, `.execute(plan)` every step."""

    def __init__(
        self, config: WorkerConfig, *,
        loaded: tuple[ModelConfig, dict[str, torch.Tensor]] | None = None,
        sampler: Sampler | None = None,
    ) -> None:
        """`loaded` (config, weights) skips reading `config.model` (benchmarks, tests); its
        weight dict is consumed (emptied), so unfused copies do not outlive the model."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        path = Path("<in-memory>") if loaded is not None else resolve_model_path(config.model)
        model_config, weights = loaded if loaded is not None else load_weights(path, self.dtype)
        self.model_config = model_config
        self.max_model_len = resolve_max_model_len(config, model_config)
        self.attention = make_attention_backend(config.attention_backend, self.device, config.block_size, self.dtype)
        self.model = self._build_model(weights)
        self.kv_cache = self._make_kv_cache()
        self.kv_layers = self.kv_cache.layers()
        self.batch = InputBatch(self.max_model_len, config.block_size, self.device)
        self.sampler = sampler if sampler is not None else Sampler(seed=config.seed)
        self.info = self._info(path)

    def _build_model(self, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
        on_device = {k: weights.pop(k).to(self.device, torch.float32 if k == "rope_freqs" else self.dtype) for k in list(weights)}
        return LlamaForCausalLM(self.model_config, on_device, self.attention, self.max_model_len).to(self.device)

    def _make_kv_cache(self) -> KVCache:
        block_bytes = bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            peak = self._profile_peak_bytes()
            blocks = num_gpu_blocks(self.device, self.config.gpu_memory_utilization, peak, block_bytes)
        else:
            blocks = num_cpu_blocks(self.config.kv_cache_memory, block_bytes)
        return KVCache(self.model_config, blocks, self.config.block_size, self.dtype, self.device, self.config.swap_space)

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak CUDA memory of a forward over max_num_batched_tokens (one long prefill)."""
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        bs = self.config.block_size
        scratch = KVCache(self.model_config, cdiv(tokens, bs), bs, self.dtype, self.device)
        batch = InputBatch(self.max_model_len, bs, self.device, rows=1)
        state = RequestState("profile", [0] * tokens, None, None)  # type: ignore[arg-type]
        batch.add(state)
        batch.set_blocks(state, list(range(scratch.num_blocks)))
        torch.cuda.reset_peak_memory_stats(self.device)
        step = batch.prepare([(state, tokens)])
        hidden = self.model(step.input_ids, step.positions, step.attn_metadata, scratch.layers())
        self.model.compute_logits(hidden[step.logits_indices])
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
            attention_backend=self.attention.name,
            vocab_size=c.vocab_size,
            eos_token_ids=c.eos_token_ids,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            num_gpu_blocks=self.kv_cache.num_blocks,
            num_cpu_blocks=self.kv_cache.num_host_blocks,
            kv_bytes_per_token=self.kv_cache.block_bytes // self.config.block_size,
            num_params=self.model.num_params,
            copy_bandwidth=measure_copy_bandwidth(self.kv_cache),
        )

    @property
    def requests(self) -> dict[str, RequestState]:
        """Every request the worker holds state for (active or preempted)."""
        return self.batch.requests

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Apply `plan` and run its forward; returns the sampled token of each request."""
        self._apply_plan(plan)
        if plan.is_empty:
            return ModelRunnerOutput(step_id=plan.step_id, sampled_token_ids={})
        scheduled = [(self._state(req_id), n) for req_id, n in plan.num_scheduled_tokens.items()]
        step = self.batch.prepare(scheduled)
        hidden = self.model(step.input_ids, step.positions, step.attn_metadata, self.kv_layers)
        for state, n in scheduled:
            state.num_computed_tokens += n
        return self._sample(plan.step_id, step, hidden)

    def _apply_plan(self, plan: SchedulerOutput) -> None:
        for req_id in plan.finished_req_ids | plan.aborted_req_ids:
            self.batch.remove(req_id)
        for req_id in plan.preempted_req_ids:
            if req_id in self.batch.requests:
                self.batch.deactivate(self.batch.requests[req_id])
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.swap_in(plan.swap_in)
        for new in plan.scheduled_new_reqs:
            self._add(new)
        for cached in plan.scheduled_cached_reqs:
            self._update(cached)

    def _add(self, new: NewRequestData) -> None:
        seed = new.sampling_params.seed
        generator = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        state = RequestState(
            req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids),
            sampling_params=new.sampling_params, generator=generator,
            block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
        )
        self.batch.add(state)

    def _update(self, cached: CachedRequestData) -> None:
        state = self.batch.requests.get(cached.req_id)
        if state is None:
            raise RuntimeError(f"plan updates request {cached.req_id!r}, which the worker does not hold")
        if cached.resumed_from_preemption:
            self.batch.deactivate(state)  # a resume always brings a whole new block table
            state.block_ids = list(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            self.batch.activate(state)
            return
        if state.row < 0:
            raise RuntimeError(f"request {cached.req_id!r} is preempted but the plan does not resume it")
        if cached.num_computed_tokens != state.num_computed_tokens:
            raise RuntimeError(
                f"request {cached.req_id!r}: plan says {cached.num_computed_tokens} computed tokens, "
                f"the worker has {state.num_computed_tokens}"
            )
        if cached.new_block_ids:
            self.batch.set_blocks(state, state.block_ids + list(cached.new_block_ids))

    def _state(self, req_id: str) -> RequestState:
        state = self.batch.requests.get(req_id)
        if state is None or state.row < 0:
            raise RuntimeError(f"plan schedules request {req_id!r}, which the worker does not hold in its batch")
        return state

    def _sample(self, step_id: int, step: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        states = step.sampling_states
        if not states:
            return ModelRunnerOutput(step_id=step_id, sampled_token_ids={})
        logits = self.model.compute_logits(hidden[step.logits_indices])
        meta = SamplingMetadata(
            params=[s.sampling_params for s in states],
            generators=[s.generator for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            eos_token_ids=self.info.eos_token_ids,
        )
        out = self.sampler.sample(logits, meta)
        for state, token in zip(states, out.token_ids, strict=True):
            self.batch.append_token(state, token)
        logprobs = {s.req_id: lp for s, lp in zip(states, out.logprobs, strict=True) if lp is not None}
        return ModelRunnerOutput(
            step_id=step_id,
            sampled_token_ids={s.req_id: t for s, t in zip(states, out.token_ids, strict=True)},
            logprobs=logprobs,
        )
