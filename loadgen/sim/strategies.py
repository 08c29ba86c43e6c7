"""The two baselines continuous batching is measured against, on the same cost model.

- ``static``: request-level batching. Wait until `batch_size` requests are queued (or the
  oldest has waited `timeout` seconds), pad every prompt to the longest, run the batch
  until its longest output is done, and answer every request when the batch ends (one
  tensor out, as a batched `generate` call does).
- ``padding``: iteration-level streaming without joining. Start a batch as soon as the
  engine is idle with whatever is queued (up to `batch_size`), pad it the same way,
  stream each request's tokens as they are produced and finish each at its own length;
  but finished rows keep computing padding and no request joins until the batch drains.

Both reserve contiguous KV for every row's padded length (prompt max + output max), so a
batch is also capped by `kv_capacity_tokens` when given.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from common.arith import cdiv
from loadgen.sim.cost_model import BatchShape, CostModel
from loadgen.sim.result import KVUsage, SimResult, TimelinePoint, TokenClock
from loadgen.sim.timeline import FixedBatchRecorder
from loadgen.workloads import WorkloadRequest


@dataclass(frozen=True)
class FixedBatchConfig:
    """Knobs of the static and padding strategies."""

    batch_size: int = 32
    timeout: float = 1.0  # static only: seconds the oldest queued request waits for a full batch
    kv_capacity_tokens: int | None = None  # padded token slots that fit in the KV cache
    block_size: int = 16  # only to report KV usage in blocks on the timeline

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.timeout < 0:
            raise ValueError(f"timeout must be >= 0 s, got {self.timeout}")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be >= 1, got {self.kv_capacity_tokens}")


class _FixedBatchRun:
    """One run of a fixed-batch strategy over a workload."""

    def __init__(
        self,
        workload: list[WorkloadRequest],
        cm: CostModel,
        cfg: FixedBatchConfig,
        streaming: bool,
        record_timeline: bool,
        recorder: FixedBatchRecorder | None = None,
    ) -> None:
        self.cm, self.cfg, self.streaming, self.record_timeline = (
            cm, cfg, streaming, record_timeline,
        )
        self.recorder = recorder
        cap = cfg.kv_capacity_tokens
        self.rejected = {
            w.request_id for w in workload if cap is not None and w.prompt_len + w.output_len > cap
        }
        self.queue = sorted((w for w in workload if w.request_id not in self.rejected),
                            key=lambda w: w.arrival_time)
        self.arrivals = [w.arrival_time for w in self.queue]
        self.clock = TokenClock(workload)
        self.now, self.steps, self.kv = 0.0, 0, KVUsage()
        self.timeline: list[TimelinePoint] = []

    def batch_start(self, i: int) -> float:
        """When the batch headed by queue[i] starts."""
        ready = max(self.now, self.arrivals[i])
        if self.streaming:
            return ready
        full_at = (
            self.arrivals[i + self.cfg.batch_size - 1]
            if i + self.cfg.batch_size <= len(self.queue)
            else math.inf
        )
        return max(ready, min(full_at, self.arrivals[i] + self.cfg.timeout))

    def take(self, i: int, start: float) -> list[WorkloadRequest]:
        """Requests queued by `start`, up to the batch size and the KV capacity."""
        batch: list[WorkloadRequest] = []
        p = o = 0
        cap = self.cfg.kv_capacity_tokens
        for w in self.queue[i:i + self.cfg.batch_size]:
            if w.arrival_time > start:
                break
            p2, o2 = max(p, w.prompt_len), max(o, w.output_len)
            if batch and cap is not None and (len(batch) + 1) * (p2 + o2) > cap:
                break
            batch.append(w)
            p, o = p2, o2
        return batch

    def waiting(self, queued_after: int) -> int:
        """Requests arrived by now that are not in this batch or an earlier one."""
        return bisect.bisect_right(self.arrivals, self.now) - queued_after

    def step(self, batch: BatchShape, rows: int, padded_len: int, queued_after: int) -> float:
        seconds = self.cm.step_time(batch)
        self.now += seconds
        self.steps += 1
        cap = self.cfg.kv_capacity_tokens
        usage = rows * padded_len / cap if cap else 0.0
        self.kv.add(usage, seconds)
        if self.record_timeline:
            blocks = rows * cdiv(padded_len, self.cfg.block_size)
            self.timeline.append(
                TimelinePoint(
                    self.now, rows, self.waiting(queued_after), 0, blocks, batch.num_prefill_tokens,
                    batch.num_decode_tokens,
                )
            )
        return seconds

    def run_batch(self, batch: list[WorkloadRequest], queued_after: int) -> None:
        """Prefill padded to the longest prompt, then decode to the longest output."""
        b, p, o = len(batch), max(w.prompt_len for w in batch), max(w.output_len for w in batch)
        for k in range(o):
            shape = BatchShape()
            shape.add(p if k == 0 else 1, 0 if k == 0 else p + k - 1, count=b)
            seconds = self.step(shape, b, p + k + 1, queued_after)
            if self.recorder is not None:
                self.recorder.step(
                    batch, k, seconds, self.now, self.waiting(queued_after), self.streaming
                )
            if self.streaming:
                for w in batch:
                    if k < w.output_len:
                        self.clock.tokens(w.request_id, 1, self.now)
                    if k == w.output_len - 1:
                        self.clock.finished(w.request_id, self.now)
        if not self.streaming:
            for w in batch:
                self.clock.tokens(w.request_id, w.output_len, self.now)
                self.clock.finished(w.request_id, self.now)

    def run(self, name: str) -> SimResult:
        i = 0
        while i < len(self.queue):
            start = self.batch_start(i)
            self.now = start
            batch = self.take(i, start)
            i += len(batch)
            self.run_batch(batch, i)
        unfinished = dict.fromkeys(sorted(self.rejected), "REJECTED")
        records = [self.clock.record(rid, unfinished.get(rid)) for rid in self.clock.requests]
        rec = self.recorder
        return SimResult(
            name,
            records,
            self.now,
            self.steps,
            unfinished=unfinished,
            mean_kv_cache_usage=self.kv.mean,
            max_kv_cache_usage=self.kv.max,
            timeline=self.timeline,
            busy_time=self.kv.total_time,
            num_busy_steps=self.kv.busy_steps,
            step_hello=rec.hello if rec else None,
            step_records=rec.records if rec else [],
        )


def _recorder(name: str, cfg: FixedBatchConfig, record_steps: bool) -> FixedBatchRecorder | None:
    if not record_steps:
        return None
    num_blocks = cfg.kv_capacity_tokens // cfg.block_size if cfg.kv_capacity_tokens else 0
    return FixedBatchRecorder(name, num_blocks, cfg.block_size, cfg.batch_size)


def simulate_static(workload: list[WorkloadRequest], cm: CostModel, cfg: FixedBatchConfig,
                    record_timeline: bool = False, record_steps: bool = False) -> SimResult:
    """Request-level batching: wait for a full batch (or the timeout), answer at its end."""
    return _FixedBatchRun(workload, cm, cfg, streaming=False, record_timeline=record_timeline,
                          recorder=_recorder("static", cfg, record_steps)).run("static")


def simulate_padding(workload: list[WorkloadRequest], cm: CostModel, cfg: FixedBatchConfig,
                     record_timeline: bool = False, record_steps: bool = False) -> SimResult:
    """Padded batches started when idle, streamed per request, nobody joins mid-flight."""
    return _FixedBatchRun(workload, cm, cfg, streaming=True, record_timeline=record_timeline,
                          recorder=_recorder("padding", cfg, record_steps)).run("padding")
