"""The engine's step-time feed: the start-up calibration seeds the model through the worker
interface (and leaves the worker holding nothing); every executed step refits it and
updates /metrics (predicted vs measured, the recent relative error, the time budget's
counters)."""

from __future__ import annotations

import pytest

from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.stats import SchedulerStats
from scheduler.step_cost import BatchShape
from service.engine.metrics import ServiceMetrics
from service.engine.step_cost_feed import StepCostFeed, calibrate, new_model
from worker.config import WorkerConfig
from worker.execution.instant_runner import InstantRunner


class _TimedInstant:
    """The worker interface over an in-process InstantRunner; "measures" 10 ms + 1 ms a token."""

    def __init__(self) -> None:
        self.runner = InstantRunner(WorkerConfig(kv_cache_memory=64 << 20))
        self.outputs: list[ModelRunnerOutput] = []
        self.plans: list[SchedulerOutput] = []

    def submit(self, plan: SchedulerOutput) -> None:
        self.plans.append(plan)
        out = self.runner.execute(plan)
        self.outputs.append(ModelRunnerOutput(out.step_id, out.sampled_token_ids,
                                              execute_time=0.01 + 0.001 * plan.total_num_scheduled_tokens))

    async def get_output(self) -> ModelRunnerOutput:
        return self.outputs.pop(0)


async def test_calibration_seeds_the_model_and_cleans_up() -> None:
    worker = _TimedInstant()
    model = new_model(worker.runner.info)
    assert await calibrate(worker, worker.runner.info, model) == 7
    assert not worker.runner.requests  # the last plan finished every calibration request
    chunk = BatchShape()
    chunk.add(64, 0)
    assert model.predict(chunk) == pytest.approx(0.074, rel=0.05)


async def test_calibration_stops_at_its_time_limit() -> None:
    worker = _TimedInstant()
    model = new_model(worker.runner.info)
    assert await calibrate(worker, worker.runner.info, model, time_limit=0.0) == 1  # the first always runs
    assert len(worker.plans) == 3 and not worker.runner.requests  # warm-up, one measured, finish


def _stats(shape: BatchShape, capped: int = 0, over: int = 0, limit: float = 0.0) -> SchedulerStats:
    return SchedulerStats(1, 0, 0, 0.0, 10, 10, 0, 0, 0, 0, step_shape=shape,
                          num_time_capped_chunks=capped, num_decode_over_target=over, step_time_limit=limit)


def _plan(step_id: int, tokens: int) -> SchedulerOutput:
    return SchedulerOutput(step_id, (), (), {"r": tokens}, tokens, frozenset(), frozenset(), frozenset())


def test_feed_refits_and_exports_predicted_against_measured() -> None:
    metrics = ServiceMetrics("m")
    model = new_model(InstantRunner(WorkerConfig()).info)
    feed = StepCostFeed(model, 0.25, metrics)
    shape = BatchShape()
    shape.add(1, 100, count=8)
    for i in range(60):
        feed.on_plan(_plan(i, 8), _stats(shape))
        feed.on_output(_plan(i, 8), ModelRunnerOutput(i, {}, execute_time=0.2),
                       _stats(shape, capped=i, over=2 * i, limit=0.25 + i / 1000))
    assert feed.predict(shape) == pytest.approx(0.2, rel=0.01)
    text = metrics.exposition().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("stepserve:step")}
    assert values["stepserve:step_time_predicted_seconds_count"] == 60
    assert values["stepserve:step_time_last_measured_seconds"] == 0.2
    assert abs(values["stepserve:step_time_last_predicted_seconds"] - 0.2) < 0.01
    assert values["stepserve:step_time_relative_error"] < 0.1  # the first (unseeded) miss has faded
    assert values["stepserve:step_time_overrun"] == pytest.approx(1.0, rel=0.01)  # past the first misses
    assert values["stepserve:step_time_target_seconds"] == 0.25
    assert values["stepserve:step_time_limit_seconds"] == pytest.approx(0.309)  # the last step's
    assert values["stepserve:step_prefill_time_capped_total"] == 59
    assert values["stepserve:step_decode_over_target_total"] == 118
    assert model.num_observed == 60


def test_feed_ignores_untimed_and_unknown_steps() -> None:
    model = new_model(InstantRunner(WorkerConfig()).info)
    feed = StepCostFeed(model, 0.0)
    shape = BatchShape()
    shape.add(16, 0)
    feed.on_output(_plan(5, 16), ModelRunnerOutput(5, {}, execute_time=0.1), _stats(shape))  # never planned
    feed.on_plan(_plan(6, 16), _stats(shape))
    feed.on_output(_plan(6, 16), ModelRunnerOutput(6, {}, execute_time=0.0), _stats(shape))  # not timed
    assert model.num_observed == 0


@pytest.mark.parametrize("bad", ["1", "1.5", "-0.1", "nan", "half"])
def test_min_prefill_share_out_of_range_is_refused_by_the_cli(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    from service.cli.serve_args import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--min-prefill-share", bad])
    assert "--min-prefill-share" in capsys.readouterr().err
    assert build_parser().parse_args(["--min-prefill-share", "0"]).min_prefill_share == 0.0
