"""Summary statistics, goodput and the vLLM key names, on a hand-computed record set."""

from __future__ import annotations

import math

import pytest

from loadgen.report import (
    METRICS,
    RequestRecord,
    error_counts,
    format_table,
    parse_goodput,
    parse_metric_percentiles,
    parse_percentile_metrics,
    percentile_key,
    summarize,
    token_times_of,
)


def _rec(rid: str, start: float, ttft: float, itls: list[float], prompt: int) -> RequestRecord:
    e2el = ttft + sum(itls)
    return RequestRecord(rid, True, prompt_tokens=prompt, output_tokens=len(itls) + 1,
                         start_time=start, ttft=ttft, itls=itls, e2el=e2el)


@pytest.fixture
def records() -> list[RequestRecord]:
    # ttft 100/200/300/400 ms; tpot 15, 30, (none: 1 token), 50 ms.
    return [
        _rec("r1", 0.0, 0.1, [0.01, 0.01, 0.02, 0.02], 10),
        _rec("r2", 0.1, 0.2, [0.03, 0.03, 0.03, 0.03], 20),
        _rec("r3", 1.0, 0.3, [], 30),
        _rec("r4", 1.1, 0.4, [0.05, 0.05], 40),
        RequestRecord("r5", False, error="HTTP 400: too long", prompt_tokens=99,
                      start_time=0.05, e2el=0.1),
    ]


def test_counts_and_throughput(records: list[RequestRecord]) -> None:
    s = summarize(records, duration=2.0)
    assert (s["completed"], s["failed"], s["duration"]) == (4, 1, 2.0)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (100, 14)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(7.0)
    assert s["total_token_throughput"] == pytest.approx(57.0)
    assert s["request_goodput"] is None


def test_latency_statistics(records: list[RequestRecord]) -> None:
    s = summarize(records, duration=2.0, percentiles=(90.0, 99.0, 99.9))
    assert s["mean_ttft_ms"] == pytest.approx(250.0)
    assert s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(12500.0))
    assert s["p90_ttft_ms"] == pytest.approx(370.0)  # linear: 300 + 0.7 * 100
    assert s["p99_ttft_ms"] == pytest.approx(397.0)
    assert s["p99.9_ttft_ms"] == pytest.approx(399.7)
    assert s["mean_tpot_ms"] == pytest.approx(95.0 / 3)
    assert s["median_tpot_ms"] == pytest.approx(30.0)
    assert s["p90_tpot_ms"] == pytest.approx(46.0)
    assert s["mean_itl_ms"] == pytest.approx(28.0)
    assert s["median_itl_ms"] == pytest.approx(30.0)
    assert s["mean_e2el_ms"] == pytest.approx(320.0)
    assert s["median_e2el_ms"] == pytest.approx(310.0)


def test_vllm_key_names(records: list[RequestRecord]) -> None:
    s = summarize(records, duration=2.0, percentiles=(50.0, 99.0, 99.9))
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99", "p99.9"):
            assert f"{stat}_{metric}_ms" in s
    assert "p90_ttft_ms" not in s
    assert percentile_key(99.0) == "99" and percentile_key(99.9) == "99.9"
    default = summarize(records, duration=2.0)  # vLLM's default percentiles: 99 alone
    assert [k for k in default if k.endswith("_ttft_ms")] == [
        "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    ]


def test_selected_metrics_only(records: list[RequestRecord]) -> None:
    """As vLLM: only the selected metrics get keys; median is there without a 50th
    percentile; the throughput and peak keys do not depend on the selection."""
    s = summarize(records, 2.0, percentiles=(25.0,), metrics=("ttft", "e2el"))
    latency = sorted(k for k in s if k.endswith("_ms"))
    assert latency == sorted(
        f"{stat}_{m}_ms" for m in ("ttft", "e2el") for stat in ("mean", "median", "std", "p25")
    )
    assert s["p25_ttft_ms"] == pytest.approx(175.0)  # 100 + 0.75 * 100
    assert s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["completed"] == 4 and s["max_concurrent_requests"] == 3
    empty = summarize(records, 2.0, percentiles=(), metrics=())
    assert not [k for k in empty if k.endswith("_ms")]
    with pytest.raises(ValueError, match="percentile metrics"):
        summarize(records, 2.0, metrics=("ttft", "latency"))
    with pytest.raises(ValueError, match="metric percentiles"):
        summarize(records, 2.0, percentiles=(99.0, 101.0))


def test_flag_parsing() -> None:
    assert parse_percentile_metrics("ttft,tpot,itl,e2el") == METRICS
    assert parse_percentile_metrics("e2el, ttft,e2el") == ("e2el", "ttft")
    assert parse_metric_percentiles("25,50,99") == (25.0, 50.0, 99.0)
    assert parse_metric_percentiles("99.9") == (99.9,)
    for bad in ("", "ttft,p99", "TTFT"):
        with pytest.raises(ValueError, match="percentile metrics"):
            parse_percentile_metrics(bad)
    for bad in ("", "99,x", "-1", "100.5", "nan"):
        with pytest.raises(ValueError, match="metric percentiles"):
            parse_metric_percentiles(bad)


@pytest.mark.parametrize(
    ("slos", "expected"),
    [
        ({"ttft": 250.0}, 1.0),  # r1, r2
        ({"tpot": 40.0}, 1.5),  # r1, r2, r3 (one token: no TPOT to miss)
        ({"ttft": 350.0, "e2el": 400.0}, 1.5),  # r1, r2, r3
        ({"e2el": 100.0}, 0.0),
    ],
)
def test_goodput(records: list[RequestRecord], slos: dict[str, float], expected: float) -> None:
    assert summarize(records, 2.0, slos)["request_goodput"] == pytest.approx(expected)


def test_peaks(records: list[RequestRecord]) -> None:
    s = summarize(records, duration=2.0)
    assert s["max_concurrent_requests"] == 3  # r1, r5 and r2 at t = 0.1
    assert s["max_output_tokens_per_s"] == 10  # r1 and r2 stream all 10 tokens in second 0
    assert token_times_of(records[3]) == pytest.approx([1.5, 1.55, 1.6])
    assert token_times_of(records[4]) == []


def test_empty_and_all_failed() -> None:
    s = summarize([RequestRecord("x", False, error="boom")], duration=0.0)
    assert (s["completed"], s["failed"], s["request_throughput"]) == (0, 1, 0.0)
    assert s["mean_ttft_ms"] == 0.0 and s["p99_e2el_ms"] == 0.0
    assert summarize([], 1.0)["completed"] == 0


def test_error_counts_and_goodput_parsing(records: list[RequestRecord]) -> None:
    records.append(RequestRecord("r6", False, error="HTTP 400: too long"))
    records.append(RequestRecord("r7", False))
    assert error_counts(records) == {"HTTP 400: too long": 2, "unknown error": 1}
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.0,
    }
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    with pytest.raises(ValueError, match="goodput"):
        summarize(records, 1.0, {"itl": 5.0})


def _value(table: str, label: str) -> str:
    return next(ln for ln in table.splitlines() if ln.startswith(label)).split()[-1]


def test_format_table(records: list[RequestRecord]) -> None:
    table = format_table(summarize(records, 2.0, {"ttft": 250.0}, percentiles=(90.0, 99.9)))
    assert "Successful requests:" in table and "Failed requests:" in table
    assert "Request goodput (req/s):" in table
    assert "P99.9 TTFT (ms):" in table and "Mean E2EL (ms):" in table
    assert _value(table, "Mean TTFT") == "250.00" and _value(table, "P90 TTFT") == "370.00"
    assert _value(table, "Peak concurrent requests:") == "3"
    assert "Std" not in table  # vLLM's table: mean, median and the percentiles
    assert "Request goodput" not in format_table(summarize(records, 2.0))
    assert "Maximum request concurrency" not in table and "Request rate configured" not in table


def test_format_table_follows_the_selection(records: list[RequestRecord]) -> None:
    summary = summarize(records, 2.0, percentiles=(25.0, 50.0), metrics=("itl",))
    table = format_table(summary, max_concurrency=4, request_rate=1.5)
    sections = [ln.strip("-") for ln in table.splitlines() if ln.startswith("---")]
    assert sections == ["Inter-token Latency"]
    labels = [ln.split(" (ms)")[0] for ln in table.splitlines() if "ITL (ms)" in ln]
    assert labels == ["Mean ITL", "Median ITL", "P25 ITL", "P50 ITL"]
    assert _value(table, "Maximum request concurrency:") == "4"
    assert _value(table, "Request rate configured (RPS):") == "1.50"
    assert "Request rate configured" not in format_table(summary, request_rate=float("inf"))
