"""The engine's side of the step-cost model: the start-up calibration through the worker,
the feed of every step's shape and measured execute time into the online fit, and the
/metrics that compare predicted with measured step time.

    start-up:   calibration plans ──worker──▶ execute times ──▶ model.seed()
    each step:  plan's shape ──▶ predicted (kept by step id)
                output.execute_time ──▶ model.observe() ──▶ metrics

The model itself (`scheduler.step_cost_fit.OnlineStepCost`) is pure Python and the scheduler
calls it directly; this module only feeds it.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.stats import SchedulerStats
from scheduler.step_cost import FEATURES, BatchShape
from scheduler.step_cost_calibration import CalibrationStep, calibration_steps, finish_plan
from scheduler.step_cost_fit import OnlineStepCost
from service.engine.metrics import ServiceMetrics
from worker.config import WorkerInfo

log = logging.getLogger("stepserve.step_time")

CALIBRATION_TIME_LIMIT = 3.0  # seconds of calibration steps at most; later shapes are skipped
_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0,
    1.5, 2.5, 5.0, 10.0,
)


class _Worker(Protocol):
    def submit(self, plan: SchedulerOutput) -> None: ...

    async def get_output(self) -> ModelRunnerOutput: ...


def new_model(info: WorkerInfo) -> OnlineStepCost:
    """An unseeded model for this worker (swap copies priced at its measured bandwidth)."""
    return OnlineStepCost(block_bytes=info.kv_bytes_per_token * info.block_size,
                          copy_bandwidth=info.copy_bandwidth)


async def calibrate(worker: _Worker, info: WorkerInfo, model: OnlineStepCost,
                    time_limit: float = CALIBRATION_TIME_LIMIT) -> int:
    """Run the calibration plans one at a time and seed `model` with their measured times;
    returns how many seeded it (fewer when the time limit, past the first measured step, or
    a small KV pool cut it short)."""
    steps = calibration_steps(
        info.block_size, info.num_gpu_blocks, info.max_model_len, info.vocab_size
    )
    start = time.monotonic()
    done: list[CalibrationStep] = []
    for step in steps:
        if model.num_seeded and time.monotonic() - start > time_limit:
            break
        worker.submit(step.plan)
        output = await worker.get_output()
        done.append(step)
        if output.error is not None:
            log.warning(
                "calibration step failed (%s); the step-cost model learns from live steps only",
                output.error,
            )
            break
        if step.measured:
            model.seed(step.shape, output.execute_time)
    if done:
        worker.submit(finish_plan(done))
        await worker.get_output()
    log.info("step-cost model seeded from %d calibration steps in %.2f s: %s", model.num_seeded,
             time.monotonic() - start, {k: f"{v:.3g}" for k, v in model.coefficients.items()})
    return model.num_seeded


class StepCostFeed:
    """Feeds the online model from every executed step and exports what it predicts."""

    def __init__(
        self, model: OnlineStepCost, target: float, metrics: ServiceMetrics | None = None
    ) -> None:
        self.model = model
        self.target = target
        self._predicted: dict[int, tuple[BatchShape, float]] = {}  # step id -> (shape, predicted s)
        self._metrics = (
            _StepTimeMetrics(metrics.registry, metrics.model_name, target) if metrics else None
        )

    def predict(self, shape: BatchShape) -> float:
        """Predicted seconds of a step of this shape."""
        return self.model.predict(shape)

    def predicted(self, plan: SchedulerOutput) -> float | None:
        """What was predicted for a plan in flight (the live view's `predicted_ms`)."""
        entry = self._predicted.get(plan.step_id)
        return None if entry is None else entry[1]

    def on_plan(self, plan: SchedulerOutput, stats: SchedulerStats) -> None:
        """A plan went to the worker; `stats` is the scheduler's snapshot right after it."""
        if stats.step_shape is not None and not plan.is_empty:
            self._predicted[plan.step_id] = (stats.step_shape, self.model.predict(stats.step_shape))

    def on_output(
        self, plan: SchedulerOutput, output: ModelRunnerOutput, stats: SchedulerStats
    ) -> None:
        """The worker answered `plan`: refit from its measured time, refresh the metrics."""
        entry = self._predicted.pop(plan.step_id, None)
        if entry is None or output.execute_time <= 0:
            return
        shape, predicted = entry
        self.model.observe(shape, output.execute_time)
        if self._metrics is not None:
            self._metrics.observe(predicted, output.execute_time, self.model, stats)


class _StepTimeMetrics:
    """The step-time series, registered in the server's own registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str, target: float) -> None:
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"stepserve:{name}", doc, labels, registry=registry).labels(model_name)

        self.predicted = Histogram("stepserve:step_time_predicted_seconds",
                                   "Step time the cost model predicted when the plan was made "
                                   "(compare model_execute_time_seconds, measured).",
                                   labels, buckets=_BUCKETS, registry=registry).labels(model_name)
        self.last_predicted = gauge(
            "step_time_last_predicted_seconds", "The last step's predicted time."
        )
        self.last_measured = gauge(
            "step_time_last_measured_seconds", "The last step's measured execute time."
        )
        self.rel_error = gauge(
            "step_time_relative_error",
            "Recent mean of |predicted - measured| / measured step time (~ last 20 steps).",
        )
        self.overrun = gauge(
            "step_time_overrun",
            "measured / predicted step time, 99th percentile of the last 256 steps (>= 1): "
            "the slo policy divides TPOT objectives by it.",
        )
        self.target = gauge(
            "step_time_target_seconds", "--max-step-ms as seconds (0: the time budget is off)."
        )
        self.target.set(target)
        self.limit = gauge(
            "step_time_limit_seconds",
            "The limit the last prefill chunk beside decodes was sized to: --max-step-ms, or "
            "the decodes' predicted time / (1 - --min-prefill-share) where that is larger.",
        )
        self.limit.set(target)
        self._coef = Gauge(
            "stepserve:step_cost_coefficient",
            "The online step-cost fit: seconds per unit of each term.",
            [*labels, "term"],
            registry=registry,
        )
        self._coef_model: OnlineStepCost | None = None
        self.model_name = model_name
        self.capped = Counter(
            "stepserve:step_prefill_time_capped", "Prefill chunks shortened by the time budget.",
            labels, registry=registry,
        ).labels(model_name)
        self.over = Counter("stepserve:step_decode_over_target",
                            "Steps whose decodes alone were predicted over --max-step-ms "
                            "(not split; lower --max-num-seqs to shorten them).",
                            labels, registry=registry).labels(model_name)
        self._last = (0, 0)

    def observe(
        self, predicted: float, measured: float, model: OnlineStepCost, stats: SchedulerStats
    ) -> None:
        self.predicted.observe(predicted)
        self.last_predicted.set(predicted)
        self.last_measured.set(measured)
        self.rel_error.set(model.relative_error)
        self.limit.set(stats.step_time_limit)
        if (
            self._coef_model is not model
        ):  # read at scrape time: a refit (or the overrun's sort) costs more than a step's metrics
            self._coef_model = model
            self.overrun.set_function(model.overrun)
            for term in FEATURES:
                self._coef.labels(self.model_name, term).set_function(
                    lambda term=term: model.coefficients[term]
                )
        capped, over = stats.num_time_capped_chunks, stats.num_decode_over_target
        self.capped.inc(max(0, capped - self._last[0]))
        self.over.inc(max(0, over - self._last[1]))
        self._last = (max(capped, self._last[0]), max(over, self._last[1]))
