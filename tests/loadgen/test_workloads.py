"""Workload builders: length distributions, arrival statistics, exact-length prompts."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadgen.prompts import PromptBuilder, encode
from loadgen.tokenizer import load_tokenizer
from loadgen.workloads import (
    LengthDist,
    PriorityMix,
    add_workload_args,
    arrival_times,
    from_jsonl,
    from_sharegpt,
    shared_prefix,
    synthetic,
    workload_from_args,
)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_length_dist_parsing_and_bounds() -> None:
    assert LengthDist.parse("64").sample(_rng(), 3) == [64, 64, 64]
    assert LengthDist.parse("fixed:7") == LengthDist("fixed", 7)
    uni = LengthDist.parse("uniform:5:8").sample(_rng(), 2000)
    assert min(uni) == 5 and max(uni) == 8  # both ends included
    assert LengthDist.parse("uniform:5:8").max == 8
    for bad in ("uniform:9:3", "gauss:1:2", "uniform:3", "0", "lognormal:-1:1", "x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_lognormal_mean_and_cap() -> None:
    values = np.asarray(LengthDist.parse("lognormal:200:0.8").sample(_rng(1), 40_000))
    assert values.mean() == pytest.approx(200, rel=0.03)
    assert values.min() >= 1
    capped = LengthDist.parse("lognormal:200:0.8:300")
    assert max(capped.sample(_rng(1), 5000)) == 300 and capped.max == 300
    assert str(capped) == "lognormal:200:0.8:300"


def test_priority_mix() -> None:
    mix = PriorityMix.parse("0:0.8,10:0.2")
    prios = mix.sample(_rng(), 20_000)
    assert set(prios) == {0, 10}
    assert prios.count(10) / len(prios) == pytest.approx(0.2, abs=0.015)
    with pytest.raises(ValueError):
        PriorityMix.parse("0-1")


def test_arrivals_poisson_mean_and_inf() -> None:
    times = arrival_times(20_000, rate=4.0, burstiness=1.0, rng=_rng(2))
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    assert arrival_times(5, math.inf, 1.0, _rng()) == [0.0] * 5
    assert arrival_times(0, 1.0, 1.0, _rng()) == []
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 1.0, _rng())


def test_burstiness_changes_variance_not_mean() -> None:
    bursty = np.diff(arrival_times(20_000, 2.0, 0.25, _rng(3)))
    smooth = np.diff(arrival_times(20_000, 2.0, 4.0, _rng(3)))
    assert bursty.mean() == pytest.approx(0.5, rel=0.05)
    assert smooth.mean() == pytest.approx(0.5, rel=0.05)
    # gamma(k): squared coefficient of variation is 1/k.
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.1)
    assert (smooth.std() / smooth.mean()) ** 2 == pytest.approx(0.25, rel=0.1)


def test_synthetic_without_tokenizer_is_seeded_and_exact() -> None:
    plen, olen = LengthDist.parse("uniform:10:50"), LengthDist.parse("uniform:1:20")
    reqs = synthetic(50, plen, olen, rate=5.0, seed=7)
    assert reqs == synthetic(50, plen, olen, rate=5.0, seed=7)
    assert reqs != synthetic(50, plen, olen, rate=5.0, seed=8)
    assert [r.request_id for r in reqs] == [f"req-{i}" for i in range(50)]
    for r in reqs:
        assert r.prompt_token_ids is not None and len(r.prompt_token_ids) == r.prompt_len
        assert 10 <= r.prompt_len <= 50 and 1 <= r.output_len <= 20 and r.prompt_text is None
    # Arrivals have their own random stream: other lengths, same arrival times.
    other = synthetic(50, LengthDist.parse("100"), olen, rate=5.0, seed=7)
    assert [r.arrival_time for r in other] == [r.arrival_time for r in reqs]


def test_shared_prefix_groups() -> None:
    reqs = shared_prefix(40, groups=3, prefix_len=16, suffix_len=LengthDist.parse("uniform:1:8"),
                         output_len=LengthDist.parse("4"), seed=1,
                         priority_mix=PriorityMix.parse("0:1,5:1"))
    prefixes: dict[int, list[int]] = {}
    for r in reqs:
        assert r.group is not None and r.prompt_token_ids is not None
        assert len(r.prompt_token_ids) == r.prompt_len and 17 <= r.prompt_len <= 24
        assert prefixes.setdefault(r.group, r.prompt_token_ids[:16]) == r.prompt_token_ids[:16]
    assert len(prefixes) == 3 and len({tuple(p) for p in prefixes.values()}) == 3
    assert {r.priority for r in reqs} == {0, 5}


def test_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "x" * 40, "output_len": 5}, {"prompt_token_ids": [1, 2, 3], "priority": 3}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = from_jsonl(path, n=3)
    assert [(r.prompt_len, r.output_len, r.priority) for r in reqs] == [(10, 5, 0), (3, 128, 3), (10, 5, 0)]
    assert reqs[1].prompt_token_ids == [1, 2, 3] and reqs[0].prompt_text == "x" * 40
    assert {r.output_len for r in from_jsonl(path, output_len=LengthDist.parse("9"))} == {9}


def _sharegpt_file(tmp_path: Path) -> Path:
    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": "p" * 80},
                                      {"from": "gpt", "value": "q" * 40}]},
        {"id": "short", "conversations": [{"from": "human", "value": "hi"},
                                          {"from": "gpt", "value": "q" * 40}]},
        {"id": "one-turn", "conversations": [{"from": "human", "value": "p" * 80}]},
        {"id": "b", "conversations": [{"from": "human", "value": "p" * 400},
                                      {"from": "gpt", "value": "q" * 20}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    return path


def test_from_sharegpt(tmp_path: Path) -> None:
    path = _sharegpt_file(tmp_path)
    reqs = from_sharegpt(path, n=4, seed=0)
    assert len(reqs) == 4
    assert sorted({(r.prompt_len, r.output_len) for r in reqs}) == [(20, 10), (100, 5)]
    capped = from_sharegpt(path, n=2, max_prompt_len=50)
    assert {(r.prompt_len, r.output_len) for r in capped} == {(20, 10)}


def test_workload_from_args(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    args = parser.parse_args(["--dataset", "shared-prefix", "--num-prompts", "6", "--prefix-len", "4",
                              "--prompt-len", "2", "--output-len", "3", "--request-rate", "2"])
    reqs = workload_from_args(args)
    assert len(reqs) == 6 and {r.prompt_len for r in reqs} == {6} and {r.output_len for r in reqs} == {3}
    assert reqs[-1].arrival_time > 0
    with pytest.raises(ValueError, match="dataset-path"):
        workload_from_args(parser.parse_args(["--dataset", "jsonl"]))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(None)  # the default model's tokenizer, loaded once


@pytest.mark.slow
def test_exact_length_prompts_with_default_tokenizer(tokenizer: Any) -> None:
    reqs = synthetic(20, LengthDist.parse("uniform:1:300"), LengthDist.parse("8"), seed=3,
                     tokenizer=tokenizer)
    for r in reqs:
        assert r.prompt_text is not None
        assert len(encode(tokenizer, r.prompt_text)) == r.prompt_len == len(r.prompt_token_ids or [])
    grouped = shared_prefix(10, 2, 50, LengthDist.parse("uniform:5:30"), LengthDist.parse("4"),
                            seed=1, tokenizer=tokenizer)
    for r in grouped:
        assert encode(tokenizer, r.prompt_text or "") == r.prompt_token_ids
        assert len(r.prompt_token_ids or []) == r.prompt_len


@pytest.mark.slow
def test_prompt_builder_counts_text_with_tokenizer(tokenizer: Any, tmp_path: Path) -> None:
    builder = PromptBuilder(tokenizer)
    assert builder.count("hello world") == len(encode(tokenizer, "hello world"))
    reqs = from_sharegpt(_sharegpt_file(tmp_path), n=2, tokenizer=tokenizer)
    for r in reqs:
        assert r.prompt_len == len(encode(tokenizer, r.prompt_text or ""))
