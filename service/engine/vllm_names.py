"""`VllmNames`: our metric families again under vLLM's names, for what is built to read vLLM.

Routers: the Gateway API Inference Extension's endpoint picker scrapes
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc``
by default (and reads the block size off ``vllm:cache_config_info``); SGLang's model
gateway (smg) takes a replica whose ``/v1/models`` owner it does not know but whose
``/version`` answers for vLLM, and polls the same gauges from ``/metrics``
(``vllm:gpu_cache_usage_perc``, vLLM's older name, first). Those few lines are always
exported. Dashboards: vLLM's Grafana dashboards plot the counters and histograms; renamed
too they would about double a scrape, so only with ``--metrics-compat vllm``.

Only families whose meaning is vLLM's are renamed. ``vllm:time_per_output_token_seconds``
is vLLM's older name of the inter-token latency, so it renames ours (our per-request mean
is ``request_time_per_output_token_seconds``, as in vLLM).

The renaming happens at scrape time, from the very metric objects the server updates: the
values are the same by construction, and the hot path (a histogram observation per token)
pays nothing for the second name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

PREFIX = "stepserve:"
# Always exported: what routers read (our family, without the prefix -> vLLM's names for it)
ROUTER_ALIASES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "num_requests_swapped": ("vllm:num_requests_swapped",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "cache_config": ("vllm:cache_config",),
}
# With `--metrics-compat vllm`: what vLLM's dashboards plot (they would double a scrape)
DASHBOARD_ALIASES: dict[str, tuple[str, ...]] = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "num_preemptions": ("vllm:num_preemptions",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "request_success": ("vllm:request_success",),
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "request_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "request_generation_tokens": ("vllm:request_generation_tokens",),
    "iteration_tokens_total": ("vllm:iteration_tokens_total",),
}
COMPAT_MODES = ("vllm",)  # --metrics-compat


def aliases(compat: str | None) -> dict[str, tuple[str, ...]]:
    """The families renamed under `compat` (None: the routers' gauges alone)."""
    if compat is None:
        return dict(ROUTER_ALIASES)
    if compat not in COMPAT_MODES:
        raise ValueError(f"metrics compat must be one of {COMPAT_MODES}, not {compat!r}")
    return {**ROUTER_ALIASES, **DASHBOARD_ALIASES}


class VllmNames(Collector):
    """Collects each family of `families` (by full name) that `names` renames, renamed."""

    def __init__(
        self, families: Mapping[str, MetricWrapperBase], names: Mapping[str, tuple[str, ...]]
    ) -> None:
        self._families = families
        self._names = names

    def collect(self) -> Iterator[Metric]:
        for name, aliases in self._names.items():
            source = self._families.get(PREFIX + name)
            if source is None:
                continue
            for family in source.collect():
                for alias in aliases:
                    yield renamed(family, alias)


def renamed(family: Metric, name: str) -> Metric:
    """`family` under `name`: each sample keeps its suffix (``_total``, ``_bucket``...)."""
    out = Metric(name, family.documentation, family.type)
    cut = len(family.name)
    out.samples = [s._replace(name=name + s.name[cut:]) for s in family.samples]
    return out
