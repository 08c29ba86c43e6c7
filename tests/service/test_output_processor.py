"""`OutputProcessor` with a character tokenizer: a stop string ends the request at the token
that completes it (the id comes back for the scheduler, and a token sampled after it is
dropped), text held back for a possible stop is released at the end; and the token metrics
it feeds once per step (one histogram pass equals observing one value at a time; each
request adds one TTFT, n-1 ITLs and n generated tokens)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from scheduler.output import RequestOutput
from service.engine.metrics import ServiceMetrics, observe_all
from service.engine.output_processor import OutputProcessor
from service.engine.stream import RequestStream

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


def _out(rid: str, char: str, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, (ord(char),), finished, "length" if finished else None, num_output_tokens=n)


async def test_stop_string_ends_the_request_at_its_token_and_drops_later_ones() -> None:
    processor = OutputProcessor(_Tokenizer())
    stream = RequestStream("s", 1, lambda _: None)
    processor.add_request(stream, ("END",), False, arrival_time=0.0)
    finished: list[list[str]] = []
    for i, char in enumerate("abcENDxy"):
        if char == "x":  # the overlap token: sampled by the plan already in flight
            assert "s" not in processor
        finished.append(processor.process([_out("s", char, i + 1)], now=float(i)))
    assert finished[5] == ["s"] and sum(finished, []) == ["s"]
    (delta,) = [d async for d in stream]
    assert (delta.text, delta.finish_reason, delta.stop_reason, delta.num_output_tokens) == ("abc", "stop", "END", 6)
    assert delta.token_ids == tuple(map(ord, "abcEND"))


async def test_text_held_for_a_possible_stop_is_released_when_the_request_ends() -> None:
    processor = OutputProcessor(_Tokenizer())
    stream = RequestStream("h", 1, lambda _: None)
    processor.add_request(stream, ("ENDING",), True, arrival_time=0.0)
    outs = [_out("h", c, i + 1, finished=(i == 4)) for i, c in enumerate("abEND")]
    assert all(processor.process([o], now=1.0) == [] for o in outs)
    (delta,) = [d async for d in stream]
    assert (delta.text, delta.finish_reason) == ("abEND", "length")
