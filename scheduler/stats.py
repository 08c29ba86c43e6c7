"""`SchedulerStats`: a snapshot the engine turns into metrics and the simulator into reports."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.step_cost import BatchShape


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # fraction of device blocks held by live requests
    num_free_blocks: int
    num_gpu_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # of those, tokens found cached (cumulative)
    num_preemptions: int  # cumulative
    num_swap_preemptions: int  # cumulative, subset of num_preemptions
    num_recompute_tokens: int = 0  # cumulative: computed tokens dropped by recompute preemptions
    # cumulative: finished requests whose prediction was scored
    output_len_predictions_scored: int = 0
    output_len_prediction_abs_error: float = 0.0  # cumulative |predicted - actual| output tokens
    # The last plan:
    step_num_reqs: int = 0
    step_prefill_tokens: int = 0
    step_decode_tokens: int = 0
    step_shape: BatchShape | None = None  # what the step-cost model reads (not to be mutated)
    # The time budget (cumulative):
    num_time_capped_chunks: int = 0  # prefill chunks it shortened
    num_decode_over_target: int = 0  # steps whose decodes alone were predicted over the target
    # seconds: the limit the last prefill chunk beside decodes was sized to
    step_time_limit: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0
