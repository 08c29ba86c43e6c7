"""`bench.vs_llamacpp`'s arithmetic: ratios per round and their medians over rounds (the
servers themselves are the benchmark's to run, not the test's)."""

from __future__ import annotations

from typing import Any

from bench import vs_llamacpp


def test_ratios_and_their_median_over_rounds() -> None:
    def summaries(tpot: float, tokens: float) -> dict[str, Any]:
        return {"single": {"median_tpot_ms": tpot}, "saturating": {"total_token_throughput": tokens}}

    llama = [summaries(8.0, 250.0), summaries(10.0, 200.0), summaries(7.0, 300.0)]
    ours = [summaries(6.0, 1000.0), summaries(8.0, 1000.0), summaries(7.0, 900.0)]
    rounds = [vs_llamacpp.ratios(o, t) for o, t in zip(ours, llama, strict=True)]
    assert [r["single_tpot"] for r in rounds] == [0.75, 0.8, 1.0]
    assert [r["saturating_total_tokens_per_s"] for r in rounds] == [4.0, 5.0, 3.0]
    assert rounds[0]["prefill_tokens_per_s"] is None  # a scenario that did not run
    median = vs_llamacpp.median_ratios(rounds)
    assert median["single_tpot"] == 0.8 and median["saturating_total_tokens_per_s"] == 4.0
    assert median["poisson_tpot"] is None
