"""Prometheus metrics of one server, in their own registry, named after vLLM's.

Counters get ``_total`` appended by prometheus-client on exposition, so
``stepserve:prompt_tokens`` is scraped as ``stepserve:prompt_tokens_total`` (vLLM's name).
Scheduler gauges and cumulative counters are refreshed from `SchedulerStats` once per
step; token and request histograms by the engine's output processor, as outputs arrive.
"""

from __future__ import annotations

import bisect

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)

from scheduler.stats import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)
_REQUEST_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0,
)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ServiceMetrics:
    """Every metric the server exports; one instance per app (tests build many).

    Attributes hold the children already bound to this server's ``model_name`` label:
    ``labels()`` costs more than the observation itself, and it runs per token.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # the *_created series only add noise to every scrape
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._last_cumulative = {
            "prefix_queries": 0,
            "prefix_hits": 0,
            "preemptions": 0,
            "recompute_tokens": 0,
            "predictions": 0,
            "prediction_error": 0,
        }
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"stepserve:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"stepserve:{name}", doc, labels, registry=r).labels(model_name)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"stepserve:{name}", doc, labels, buckets=buckets, registry=r).labels(
                model_name
            )

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.num_requests_swapped = gauge(
            "num_requests_swapped", "Requests swapped out to host memory."
        )
        self.num_requests_waiting_for_grammar = gauge(
            "num_requests_waiting_for_grammar",
            "Requests held before the scheduler while their structured-output grammar compiles.",
        )
        self.grammar_compile_seconds = hist(
            "grammar_compile_seconds",
            "Time to compile a structured-output grammar not yet in the cache.",
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_preemptions = counter("num_preemptions", "Preemptions (recompute or swap).")
        self.num_recompute_tokens = counter(
            "num_recompute_tokens", "Computed tokens whose KV recompute preemptions dropped."
        )
        self.output_len_predictions = counter(
            "output_len_predictions", "Finished requests whose predicted output length was scored."
        )
        self.output_len_prediction_abs_error = counter(
            "output_len_prediction_abs_error_tokens",
            "Sum of |predicted - actual| output tokens (divide by output_len_predictions).",
        )
        self.output_len_prediction_mean_abs_error = gauge(
            "output_len_prediction_mean_abs_error_tokens",
            "Mean |predicted - actual| output tokens so far.",
        )
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of requests that started generating."
        )
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._request_success = Counter(
            "stepserve:request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: self._request_success.labels(model_name, reason)
            for reason in ("stop", "length", "abort")
        }
        self.time_to_first_token = hist(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = hist(
            "inter_token_latency_seconds", "Time between streamed tokens.", _LATENCY_BUCKETS
        )
        self.time_per_output_token = hist(
            "time_per_output_token_seconds",
            "Per request: (e2e - ttft) / (output tokens - 1).",
            _LATENCY_BUCKETS,
        )
        self.e2e_request_latency = hist(
            "e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS
        )
        self.request_queue_time = hist(
            "request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS
        )
        self.iteration_num_requests = hist(
            "iteration_num_requests", "Requests per step (batch size).", _COUNT_BUCKETS
        )
        self.iteration_prefill_tokens = hist(
            "iteration_prefill_tokens", "Prefill tokens per step.", _COUNT_BUCKETS
        )
        self.iteration_decode_tokens = hist(
            "iteration_decode_tokens", "Decode tokens per step.", _COUNT_BUCKETS
        )
        self.step_duration = hist(
            "step_duration_seconds", "Wall time of one engine step.", _LATENCY_BUCKETS
        )
        self.model_execute_time = hist(
            "model_execute_time_seconds",
            "Worker time executing one plan (swaps, forward, sampling).",
            _LATENCY_BUCKETS,
        )
        # vLLM's cache_config_info idiom: constant labels that say how the worker runs
        self.worker = Info(
            "stepserve:worker", "How the worker runs the model (chosen at start-up).", labels,
            registry=r,
        ).labels(model_name)

    def set_worker(
        self,
        *,
        device: str,
        dtype: str,
        quantization: str,
        compiled: bool,
        attention_backend: str,
        num_threads: int,
        batch_invariant: bool = False,
        kv_cache_dtype: str = "",
    ) -> None:
        self.worker.info(
            {
                "device": device,
                "dtype": dtype,
                "kv_cache_dtype": kv_cache_dtype or dtype,
                "quantization": quantization,
                "compiled": str(compiled).lower(),
                "attention_backend": attention_backend,
                "num_threads": str(num_threads),
                "batch_invariant": str(batch_invariant).lower(),
            }
        )

    def observe_stats(self, stats: SchedulerStats) -> None:
        """Refresh gauges and cumulative counters from a scheduler snapshot."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_swapped.set(stats.num_swapped)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self._inc_cumulative(
            "prefix_queries", self.prefix_cache_queries, stats.prefix_cache_queries
        )
        self._inc_cumulative("prefix_hits", self.prefix_cache_hits, stats.prefix_cache_hits)
        self._inc_cumulative("preemptions", self.num_preemptions, stats.num_preemptions)
        self._inc_cumulative(
            "recompute_tokens", self.num_recompute_tokens, stats.num_recompute_tokens
        )
        self._inc_cumulative(
            "predictions", self.output_len_predictions, stats.output_len_predictions_scored
        )
        self._inc_cumulative(
            "prediction_error",
            self.output_len_prediction_abs_error,
            stats.output_len_prediction_abs_error,
        )
        scored = stats.output_len_predictions_scored
        self.output_len_prediction_mean_abs_error.set(
            stats.output_len_prediction_abs_error / scored if scored else 0.0
        )

    def observe_step(self, num_reqs: int, prefill_tokens: int, decode_tokens: int, duration: float,
                     execute_time: float = 0.0) -> None:
        """One step's batch shape, wall time and (when the worker measured it) execute time.
        The gap between the two is what the engine, the pipe and the front end add."""
        self.iteration_num_requests.observe(num_reqs)
        self.iteration_prefill_tokens.observe(prefill_tokens)
        self.iteration_decode_tokens.observe(decode_tokens)
        self.step_duration.observe(duration)
        if execute_time > 0:
            self.model_execute_time.observe(execute_time)

    def observe_tokens(self, num_new: int, *, first: bool, num_prompt: int, latency: float) -> None:
        """A request received `num_new` tokens; `latency` is TTFT when `first`, else ITL."""
        self.generation_tokens.inc(num_new)
        if first:
            self.prompt_tokens.inc(num_prompt)
            self.time_to_first_token.observe(latency)
        else:
            self.inter_token_latency.observe(latency)

    def observe_step_tokens(
        self, num_generated: int, ttfts: list[tuple[int, float]], itls: list[float]
    ) -> None:
        """`observe_tokens` for a whole step at once: the tokens it generated, (prompt
        length, TTFT) of the requests it gave their first token, and the inter-token
        latencies of the others. It runs for every request at every step, so the ITLs go
        into the histogram in one pass (`observe_all`)."""
        self.generation_tokens.inc(num_generated)
        for num_prompt, ttft in ttfts:
            self.prompt_tokens.inc(num_prompt)
            self.time_to_first_token.observe(ttft)
        if itls:
            observe_all(self.inter_token_latency, itls)

    def observe_finished(
        self,
        reason: str,
        *,
        e2e: float,
        queue_time: float | None,
        ttft: float | None,
        num_output: int,
    ) -> None:
        """A request ended (stop, length or abort)."""
        child = self.request_success.get(reason)
        if child is None:
            child = self.request_success[reason] = self._request_success.labels(
                self.model_name, reason
            )
        child.inc()
        self.e2e_request_latency.observe(e2e)
        if queue_time is not None:
            self.request_queue_time.observe(queue_time)
        if ttft is not None and num_output > 1:
            self.time_per_output_token.observe((e2e - ttft) / (num_output - 1))

    def exposition(self) -> bytes:
        """The text format served at /metrics."""
        return generate_latest(self.registry)

    def metric_names(self) -> set[str]:
        """Every sample name this registry exports (with _total/_bucket/... suffixes)."""
        families = list(self.registry.collect())
        return {s.name for family in families for s in family.samples} | {
            family.name for family in families
        }

    def _inc_cumulative(self, key: str, counter: Counter, value: float) -> None:
        delta = value - self._last_cumulative[key]
        if delta > 0:
            counter.inc(delta)
        self._last_cumulative[key] = max(value, self._last_cumulative[key])


def observe_all(histogram: Histogram, values: list[float]) -> None:
    """``for v in values: histogram.observe(v)`` in one pass: a bucket count and the sum are
    added once each. It reaches into prometheus_client's Histogram child (`_upper_bounds`,
    `_buckets`, `_sum`, as its own `observe` does); tests/service/test_output_processor.py checks
    the result against `observe` one value at a time."""
    bounds = histogram._upper_bounds  # sorted, ending with +Inf
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1
    histogram._sum.inc(sum(values))
    for bucket, count in zip(histogram._buckets, counts, strict=True):
        if count:
            bucket.inc(count)
