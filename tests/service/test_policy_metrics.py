"""/metrics carries the output-length predictor's error and the recomputed tokens."""

from __future__ import annotations

from scheduler.stats import SchedulerStats
from service.engine.metrics import ServiceMetrics


def _stats(scored: int, error: float, recompute: int) -> SchedulerStats:
    return SchedulerStats(num_running=0, num_waiting=0, num_swapped=0, kv_cache_usage=0.0, num_free_blocks=1,
                          num_gpu_blocks=1, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                          num_swap_preemptions=0, num_recompute_tokens=recompute,
                          output_len_predictions_scored=scored, output_len_prediction_abs_error=error)


def test_prediction_error_and_recompute_tokens_exported() -> None:
    m = ServiceMetrics("m")
    m.observe_stats(_stats(2, 30.0, 16))
    m.observe_stats(_stats(4, 50.0, 16))  # cumulative snapshots: counters move by the deltas
    text = m.exposition().decode()
    assert 'stepserve:output_len_predictions_total{model_name="m"} 4.0' in text
    assert 'stepserve:output_len_prediction_abs_error_tokens_total{model_name="m"} 50.0' in text
    assert 'stepserve:output_len_prediction_mean_abs_error_tokens{model_name="m"} 12.5' in text
    assert 'stepserve:num_recompute_tokens_total{model_name="m"} 16.0' in text
