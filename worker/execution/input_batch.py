"""The persistent input batch: the worker's per-request state, kept across steps, and the
arrays and tensors of each step's inputs built from it.

`InputBatch` does not take plans itself: `worker.execution.step_executor.StepExecutor`
receives each plan and calls `apply` (a plan's diffs onto the state: frees, preemptions,
swaps, new requests, block tables), `prepare` (the step's flattened host arrays) and
`advance` (computed counts, sampled tokens) here; the runner's model builds its device
tensors with `attention_metadata` and `to_device`. Each live request owns a `RequestState`
(its tokens, sampling params, rng, block table). A request in the active batch also owns a
row of two persistent numpy arrays (token ids and block table), so a step's input ids,
positions and cache slots come from a few vectorized gathers instead of per-token Python.
A preempted request gives its row back and keeps its state; it gets a row again when it
resumes.

Positions of one request in one step (n = tokens scheduled)::

    tokens:   [ prompt ........ | sampled ... ]      len = num_tokens
    computed: [0, num_computed)                       KV already in the cache
    this step:            [num_computed, num_computed + n)
    samples iff num_computed + n == num_tokens (the chunk reaches the last known token)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from common.arith import cdiv
from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput, TokenLogprobs
from scheduler.sampling import SamplingParams
from worker.attention.metadata import AttentionMetadata

SwapPairs = tuple[tuple[int, int], ...]


class PlanError(RuntimeError):
    """A plan the worker cannot execute (it disagrees with what the worker holds)."""


@dataclass(eq=False)
class RequestState:
    """What the worker remembers about one request until it finishes or is aborted."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    row: int = -1  # row in the persistent arrays; -1 while preempted
    matcher: Any = None  # its grammar's llguidance matcher (structured outputs), once started
    # its prompt's logprobs by position while its prompt is computed (prompt_logprobs asked)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def prompt_positions(self, count: int) -> range:
        """Positions of a `count`-token chunk from `num_computed_tokens` whose logits give a
        prompt token's logprob (position p: token p + 1), when this request asks for them
        and has no output yet; their slots in `prompt_logprobs` exist once this is called."""
        if self.sampling_params.prompt_logprobs is None or self.output_token_ids:
            return range(0)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        start = self.num_computed_tokens
        return range(start, min(start + count, len(self.prompt_token_ids) - 1))


@dataclass(frozen=True)
class StepInputs:
    """One step's flattened batch (host arrays), and who samples."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64: cache slot of each token
    rows: np.ndarray  # [B] int64: persistent row of each scheduled request, batch order
    counts: np.ndarray  # [B] int64: tokens each computes this step
    seq_lens: np.ndarray  # [B] int64: context length after this step
    logits_indices: np.ndarray  # [n_sample] int64: last token of each sampling request
    sampling_states: list[RequestState]  # aligned with logits_indices
    scheduled: list[tuple[RequestState, int]]  # (request, tokens this step), batch order


class InputBatch:
    """Request states plus the persistent token/block arrays of the active ones."""

    def __init__(
        self, max_model_len: int, block_size: int, device: torch.device, rows: int = 64,
        num_blocks: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks  # device blocks; ids outside [0, num_blocks) are refused
        self.device = device
        self.max_model_len = max_model_len
        # +1: with overlap a request may sample one token past max_model_len before it stops
        self.token_ids = np.zeros((rows, max_model_len + 1), dtype=np.int64)
        self.block_table = np.zeros((rows, cdiv(max_model_len, block_size) + 1), dtype=np.int32)
        self.free_rows = list(range(rows - 1, -1, -1))
        self.requests: dict[str, RequestState] = {}

    @property
    def num_active(self) -> int:
        return len(self.token_ids) - len(self.free_rows)

    # ---- applying a plan ----------------------------------------------------------------

    def apply(
        self, plan: SchedulerOutput, swap: Callable[[SwapPairs, SwapPairs], None]
    ) -> list[tuple[RequestState, int]]:
        """Apply the plan's diffs in order: drop finished/aborted requests, take preempted
        ones out (keeping tokens and rng), `swap(out_pairs, in_pairs)`, add new requests,
        extend (or, on resume, replace) block tables. Returns the scheduled requests."""
        for req_id in plan.finished_req_ids | plan.aborted_req_ids:
            self.remove(req_id)
        for req_id in plan.preempted_req_ids:
            self.deactivate(self._held(req_id))
        if plan.swap_out or plan.swap_in:
            swap(plan.swap_out, plan.swap_in)
        for new in plan.scheduled_new_reqs:
            self._add_new(new)
        for cached in plan.scheduled_cached_reqs:
            self._update(cached)
        return [(self._active(req_id), n) for req_id, n in plan.num_scheduled_tokens.items()]

    def _add_new(self, new: NewRequestData) -> None:
        seed = new.sampling_params.seed
        generator = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        self.add(RequestState(
            req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids),
            sampling_params=new.sampling_params, generator=generator,
            block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
        ))

    def _update(self, cached: CachedRequestData) -> None:
        state = self._held(cached.req_id)
        if cached.resumed_from_preemption:
            self.deactivate(state)  # a resume always brings a whole new block table
            state.block_ids = list(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            self.activate(state)
            return
        if state.row < 0:
            raise PlanError(
                f"request {cached.req_id!r} is preempted but the plan does not resume it"
            )
        if cached.num_computed_tokens != state.num_computed_tokens:
            raise PlanError(
                f"request {cached.req_id!r}: plan says {cached.num_computed_tokens} computed "
                f"tokens, the worker has {state.num_computed_tokens}"
            )
        if cached.new_block_ids:
            self.set_blocks(state, state.block_ids + list(cached.new_block_ids))

    def _held(self, req_id: str) -> RequestState:
        state = self.requests.get(req_id)
        if state is None:
            raise PlanError(f"plan refers to request {req_id!r}, which the worker does not hold")
        return state

    def _active(self, req_id: str) -> RequestState:
        state = self._held(req_id)
        if state.row < 0:
            raise PlanError(f"plan schedules request {req_id!r}, which is preempted in the worker")
        return state

    def advance(self, step: StepInputs, sampled: list[int]) -> None:
        """After the forward: the step's tokens are computed, and each sampling request gets
        its token at once, so the next plan can run before the scheduler has seen it."""
        for state, n in step.scheduled:
            state.num_computed_tokens += n
        for state, token in zip(step.sampling_states, sampled, strict=True):
            self.append_token(state, token)

    # ---- request rows ---------------------------------------------------------------------

    def add(self, state: RequestState) -> None:
        """A new request: remember it and give it a row."""
        if state.req_id in self.requests:
            raise PlanError(f"request {state.req_id!r} is already in the worker")
        self.requests[state.req_id] = state
        self.activate(state)

    def remove(self, req_id: str) -> None:
        """Finished or aborted: forget everything (unknown ids are ignored)."""
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.deactivate(state)

    def activate(self, state: RequestState) -> None:
        """Give the request a row and copy its tokens and block table there."""
        if state.row >= 0:
            return
        if len(state.prompt_token_ids) > self.max_model_len:
            raise PlanError(
                f"request {state.req_id!r}: {len(state.prompt_token_ids)} prompt tokens exceed "
                f"max_model_len {self.max_model_len}"
            )
        if not self.free_rows:
            self._grow()
        state.row = self.free_rows.pop()
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[state.row, : len(tokens)] = tokens
        self.set_blocks(state, state.block_ids)

    def deactivate(self, state: RequestState) -> None:
        """Preempted: give the row back; tokens and rng stay in the state, blocks are dropped."""
        if state.row >= 0:
            self.free_rows.append(state.row)
            state.row = -1
        state.block_ids = []

    def set_blocks(self, state: RequestState, block_ids: list[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < (self.num_blocks or 1 << 62)]
        if bad:
            raise PlanError(
                f"request {state.req_id!r}: block ids {bad} outside [0, {self.num_blocks})"
            )
        if len(block_ids) > self.block_table.shape[1]:
            raise PlanError(
                f"request {state.req_id!r}: {len(block_ids)} blocks exceed the block table "
                f"width {self.block_table.shape[1]}"
            )
        state.block_ids = list(block_ids)
        self.block_table[state.row, : len(block_ids)] = block_ids

    def append_token(self, state: RequestState, token: int) -> None:
        """Record a sampled token; the next step computes it without waiting for the scheduler."""
        if state.num_tokens < self.token_ids.shape[1]:
            self.token_ids[state.row, state.num_tokens] = token
        state.output_token_ids.append(token)

    def _grow(self) -> None:
        old = len(self.token_ids)
        self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self.free_rows = list(range(2 * old - 1, old - 1, -1)) + self.free_rows

    def prepare(self, scheduled: list[tuple[RequestState, int]]) -> StepInputs:
        """Flatten the scheduled requests (decodes first) into one batch of host arrays."""
        scheduled = sorted(scheduled, key=lambda item: item[1] != 1)  # stable: decodes first
        rows = np.array([s.row for s, _ in scheduled], dtype=np.int64)
        counts = np.array([n for _, n in scheduled], dtype=np.int64)
        computed = np.array([s.num_computed_tokens for s, _ in scheduled], dtype=np.int64)
        self._check_known(scheduled, computed + counts)
        ends = np.cumsum(counts)
        req_of_token = np.repeat(np.arange(len(scheduled)), counts)
        positions = (
            computed[req_of_token] + np.arange(int(ends[-1])) - (ends - counts)[req_of_token]
        )
        blocks = self.block_table[rows[req_of_token], positions // self.block_size].astype(np.int64)
        samples = [
            i for i, (s, n) in enumerate(scheduled) if s.num_computed_tokens + n == s.num_tokens
        ]
        return StepInputs(
            input_ids=self.token_ids[rows[req_of_token], positions],
            positions=positions,
            slots=blocks * self.block_size + positions % self.block_size,
            rows=rows,
            counts=counts,
            seq_lens=computed + counts,
            logits_indices=ends[samples] - 1,
            sampling_states=[scheduled[i][0] for i in samples],
            scheduled=scheduled,
        )

    def _check_known(self, scheduled: list[tuple[RequestState, int]], seq_lens: np.ndarray) -> None:
        """Every scheduled token must be known to the worker and have a cache slot."""
        for (state, _), seq_len in zip(scheduled, seq_lens.tolist(), strict=True):
            if seq_len > state.num_tokens or cdiv(seq_len, self.block_size) > len(state.block_ids):
                raise PlanError(
                    f"request {state.req_id!r}: plan computes up to position {seq_len} but the "
                    f"worker has {state.num_tokens} tokens and {len(state.block_ids)} blocks"
                )

    def attention_metadata(self, step: StepInputs) -> AttentionMetadata:
        """What attention needs for `step`, as device tensors (built once per step)."""
        counts, seq_lens = step.counts, step.seq_lens
        max_blocks = cdiv(int(seq_lens.max()), self.block_size)
        starts = np.concatenate([[0], np.cumsum(counts)])
        return AttentionMetadata(
            slot_mapping=self.to_device(step.slots),
            query_start_loc=self.to_device(starts, torch.int32),
            seq_lens=self.to_device(seq_lens, torch.int32),
            block_tables=self.to_device(self.block_table[step.rows, :max_blocks], torch.int32),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            num_decodes=int((counts == 1).sum()),
            block_size=self.block_size,
            starts=starts.tolist(),
            seq_lens_list=seq_lens.tolist(),
        )

    def to_device(self, array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor
