"""Prometheus metrics of one server, in their own registry, named after vLLM's.

Counters get ``_total`` appended by prometheus-client on exposition, so
``stepserve:prompt_tokens`` is scraped as ``stepserve:prompt_tokens_total`` (vLLM's name).
Scheduler gauges and cumulative counters are refreshed from `SchedulerStats` once per
step; token and request histograms by the engine's output processor, as outputs arrive.
The gauges routers read are also exported under vLLM's names (``vllm:num_requests_waiting``
...), and with ``--metrics-compat vllm`` the counters and histograms vLLM's dashboards plot:
renamed at scrape time (`vllm_names.py`). The registry also carries prometheus-client's
process, platform and GC collectors (``process_resident_memory_bytes``...).

Objectives (scheduler/slo.py) are judged when a request ends (`observe_objectives`):
``stepserve:slo_requests_total{class, objective, outcome}`` counts, per objective a request
has (ttft, tpot) and for all of them together (both), whether it was met or missed;
``stepserve:slo_tokens_total{class, outcome}`` counts the output tokens of requests that met
all theirs (goodput in tokens) and of those that did not; a request without objectives is in
neither. ``stepserve:ttft_forecast_error_seconds`` is the first-token forecast's error
(measured - predicted) where there was one (signed buckets, so no _sum: the mean absolute
error is ``stepserve:ttft_forecast_abs_error_seconds``), and
``stepserve:request_rejected_total{reason}`` counts the 429s: queue_full (the waiting limit)
and slo_unmeetable (`--reject-unmeetable`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase

from scheduler.slo import SLO, slo_met, ttft_and_tpot
from scheduler.stats import SchedulerStats
from service.engine.vllm_names import VllmNames, aliases

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)
_REQUEST_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0,
)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# vLLM's: 1, 2, 5, 10, 20, 50, ... (vLLM stops at max_model_len; a million is past any here)
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5)) + (1e6,)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# measured - predicted first-token time: late (positive) and early (negative) alike
_ERROR_STEPS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_FORECAST_ERROR_BUCKETS = (*(-e for e in reversed(_ERROR_STEPS)), 0.0, *_ERROR_STEPS)
SLO_OBJECTIVES = ("ttft", "tpot", "both")
SLO_OUTCOMES = ("met", "missed")
REJECT_REASONS = ("queue_full", "slo_unmeetable")
M = TypeVar("M", bound=MetricWrapperBase)


class ServiceMetrics:
    """Every metric the server exports; one instance per app (tests build many).

    Attributes hold the children already bound to this server's ``model_name`` label:
    ``labels()`` costs more than the observation itself, and it runs per token.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        *,
        compat: str | None = None,
    ) -> None:
        """`compat`: "vllm" exports the dashboards' families under vLLM's names too."""
        disable_created_metrics()  # the *_created series only add noise to every scrape
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._families: dict[str, MetricWrapperBase] = {}  # by name: what VllmNames renames
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
            return self._family(Gauge(f"stepserve:{name}", doc, labels, registry=r)).labels(
                model_name
            )

        def counter(name: str, doc: str) -> Counter:
            return self._family(Counter(f"stepserve:{name}", doc, labels, registry=r)).labels(
                model_name
            )

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return self._family(
                Histogram(f"stepserve:{name}", doc, labels, buckets=buckets, registry=r)
            ).labels(model_name)

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
        self._request_success = self._family(Counter(
            "stepserve:request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=r,
        ))
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
        self.request_time_per_output_token = hist(
            "request_time_per_output_token_seconds",
            "Per request: its decode time / (output tokens - 1).",
            _LATENCY_BUCKETS,
        )
        self.e2e_request_latency = hist(
            "e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS
        )
        self.request_queue_time = hist(
            "request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS
        )
        self.request_prefill_time = hist(
            "request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_BUCKETS
        )
        self.request_decode_time = hist(
            "request_decode_time_seconds", "First token to the request's end.", _REQUEST_BUCKETS
        )
        self.request_prompt_tokens = hist(
            "request_prompt_tokens", "Prompt tokens of each finished request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Output tokens of each finished request.", _TOKEN_BUCKETS
        )
        self.iteration_tokens = hist(
            "iteration_tokens_total",
            "Tokens per step (prefill and decode).",
            _ITERATION_TOKEN_BUCKETS,
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
        self._slo_requests = Counter(
            "stepserve:slo_requests",
            "Finished requests per objective they had (ttft, tpot; both: all of them), met or "
            "missed, by objective class.",
            labels + ["class", "objective", "outcome"],
            registry=r,
        )
        self._slo_tokens = Counter(
            "stepserve:slo_tokens",
            "Output tokens of finished requests with objectives: of those that met all of them "
            "(goodput) and of those that missed one, by objective class.",
            labels + ["class", "outcome"],
            registry=r,
        )
        # signed, so exported without a _sum (OpenMetrics): the absolute error has the mean
        self.ttft_forecast_error = hist(
            "ttft_forecast_error_seconds",
            "Measured minus predicted time to first token, of requests forecast on arrival "
            "(positive: later than forecast).",
            _FORECAST_ERROR_BUCKETS,
        )
        self.ttft_forecast_abs_error = hist(
            "ttft_forecast_abs_error_seconds",
            "|measured - predicted| time to first token, of requests forecast on arrival.",
            _LATENCY_BUCKETS,
        )
        self._request_rejected = Counter(
            "stepserve:request_rejected",
            "Requests refused with 429, by reason (queue_full, slo_unmeetable).",
            labels + ["reason"],
            registry=r,
        )
        self.request_rejected = {
            reason: self._request_rejected.labels(model_name, reason) for reason in REJECT_REASONS
        }
        # vLLM's cache_config_info idiom: constant labels that say how the worker runs
        self.worker = Info(
            "stepserve:worker", "How the worker runs the model (chosen at start-up).", labels,
            registry=r,
        ).labels(model_name)
        self.cache_config = self._family(Info(
            "stepserve:cache_config", "The KV cache's shape: block size and device blocks.",
            labels, registry=r,
        )).labels(model_name)
        # The default registry's collectors, for this registry (RSS, CPU, open fds, GC)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        r.register(VllmNames(self._families, aliases(compat)))

    def _family(self, metric: M) -> M:
        """Keep `metric` by its full name, for `VllmNames` to rename."""
        self._families[metric._name] = metric
        return metric

    def set_cache_config(self, *, block_size: int, num_gpu_blocks: int) -> None:
        """The KV cache's shape (vLLM's ``cache_config_info``: the endpoint picker reads the
        block size off it)."""
        self.cache_config.info(
            {"block_size": str(block_size), "num_gpu_blocks": str(num_gpu_blocks)}
        )

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
        wide_steps: str = "",
    ) -> None:
        self._worker_labels = {
            "wide_steps": wide_steps,
            "device": device,
            "dtype": dtype,
            "kv_cache_dtype": kv_cache_dtype or dtype,
            "quantization": quantization,
            "compiled": str(compiled).lower(),
            "attention_backend": attention_backend,
            "num_threads": str(num_threads),
            "batch_invariant": str(batch_invariant).lower(),
        }
        self.worker.info(self._worker_labels)

    def set_compiled(self, compiled: bool) -> None:
        """The worker swapped its forward (a compiled one built in the background)."""
        self._worker_labels["compiled"] = str(compiled).lower()
        self.worker.info(self._worker_labels)

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
        self.iteration_tokens.observe(prefill_tokens + decode_tokens)
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
        num_prompt: int = 0,
        prefill_time: float | None = None,
    ) -> None:
        """A request ended (stop, length or abort). `prefill_time` runs from its first
        scheduling to its first token; its decode time from there to now (e2e - ttft)."""
        child = self.request_success.get(reason)
        if child is None:
            child = self.request_success[reason] = self._request_success.labels(
                self.model_name, reason
            )
        child.inc()
        self.e2e_request_latency.observe(e2e)
        self.request_prompt_tokens.observe(num_prompt)
        self.request_generation_tokens.observe(num_output)
        if queue_time is not None:
            self.request_queue_time.observe(queue_time)
        if prefill_time is not None:
            self.request_prefill_time.observe(prefill_time)
        if ttft is not None:
            decode_time = e2e - ttft
            self.request_decode_time.observe(decode_time)
            if num_output > 1:
                self.request_time_per_output_token.observe(decode_time / (num_output - 1))

    def declare_slo_classes(self, names: Iterable[str]) -> None:
        """Export the objective counters of these classes at zero (so that a rate over them
        exists before the first request of the class ends)."""
        for cls in names:
            for objective in SLO_OBJECTIVES:
                for outcome in SLO_OUTCOMES:
                    self._slo_requests.labels(self.model_name, cls, objective, outcome)
            for outcome in SLO_OUTCOMES:
                self._slo_tokens.labels(self.model_name, cls, outcome)

    def observe_objectives(
        self,
        slo: SLO,
        *,
        arrival: float,
        first_token: float | None,
        finished: float,
        num_output: int,
        aborted: bool,
        predicted_ttft: float | None = None,
    ) -> None:
        """A request with objectives `slo` ended: count each of its objectives met or missed,
        and its output tokens as goodput or not; the forecast's error where it had one. An
        aborted request did not get what it asked for: its objectives count as missed, but
        a TTFT objective its first token had already met."""
        ttft, tpot = ttft_and_tpot(arrival, first_token, finished, num_output)
        if predicted_ttft is not None and ttft is not None:
            self.ttft_forecast_error.observe(ttft - predicted_ttft)
            self.ttft_forecast_abs_error.observe(abs(ttft - predicted_ttft))
        if slo.empty:
            return
        ttft_ok, tpot_ok = slo_met(slo, ttft, tpot)
        tpot_ok = tpot_ok and not aborted  # (slo_met: no first token, TTFT missed)
        outcomes = []
        if slo.ttft_s is not None:
            outcomes.append(("ttft", ttft_ok))
        if slo.tpot_s is not None:
            outcomes.append(("tpot", tpot_ok))
        met = all(ok for _, ok in outcomes) and not aborted
        outcomes.append(("both", met))
        for objective, ok in outcomes:
            self._slo_requests.labels(
                self.model_name, slo.cls, objective, "met" if ok else "missed"
            ).inc()
        if num_output:
            self._slo_tokens.labels(self.model_name, slo.cls, "met" if met else "missed").inc(
                num_output
            )

    def observe_rejected(self, reason: str) -> None:
        """A request was refused with 429 for `reason`."""
        child = self.request_rejected.get(reason)
        if child is None:
            child = self.request_rejected[reason] = self._request_rejected.labels(
                self.model_name, reason
            )
        child.inc()

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
