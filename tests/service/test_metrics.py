"""The token metrics the output processor feeds once per step: a histogram filled in one
pass equals one filled a value at a time, and each request adds one TTFT, n-1 ITLs and n
generated tokens."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from scheduler.output import RequestOutput
from service.metrics import ServiceMetrics, observe_all
from service.output_processor import OutputProcessor
from service.stream import RequestStream

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _samples(histogram: Histogram) -> dict[str, float]:
    return {f"{s.name}{s.labels}": s.value for metric in histogram.collect() for s in metric.samples
            if not s.name.endswith("_created")}


def test_observe_all_equals_observing_one_at_a_time() -> None:
    rng = random.Random(0)
    values = [rng.choice([0.0, 0.001, 0.01, 1.0, 5.0]) if rng.random() < 0.3 else rng.expovariate(20) for _ in range(500)]
    one = Histogram("one", "x", buckets=BUCKETS, registry=CollectorRegistry())
    many = Histogram("one", "x", buckets=BUCKETS, registry=CollectorRegistry())
    for value in values:
        one.observe(value)
    observe_all(many, values)
    got, want = _samples(many), _samples(one)
    assert got.pop("one_sum{}") == pytest.approx(want.pop("one_sum{}"))  # summed in another order
    assert got == want


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: object, skip_special_tokens: bool = True, clean_up_tokenization_spaces: object = None) -> str:
        return "".join(chr(t) for t in token_ids)  # type: ignore[attr-defined]


def _value(metrics: ServiceMetrics, name: str) -> float:
    return {s.name: s.value for f in metrics.registry.collect() for s in f.samples}[name]


def test_each_request_adds_one_ttft_and_n_minus_1_itls() -> None:
    metrics = ServiceMetrics("m")
    processor = OutputProcessor(_Tokenizer(), metrics)
    for rid in ("a", "b"):
        processor.add_request(RequestStream(rid, 3, lambda _: None), (), False, arrival_time=0.0)
    for step in range(5):  # "a" gets 5 tokens, "b" 3
        outs = [RequestOutput(rid, (65 + step,), step == n - 1, "length" if step == n - 1 else None,
                              num_prompt_tokens=3, num_output_tokens=step + 1)
                for rid, n in (("a", 5), ("b", 3)) if step < n]
        assert processor.process(outs, now=0.1 * (step + 1)) == []
    assert _value(metrics, "stepserve:generation_tokens_total") == 8
    assert _value(metrics, "stepserve:time_to_first_token_seconds_count") == 2
    assert _value(metrics, "stepserve:inter_token_latency_seconds_count") == 4 + 2
    assert _value(metrics, "stepserve:prompt_tokens_total") == 6
    assert len(processor) == 0
