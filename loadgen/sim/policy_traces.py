"""The traces `stepserve simulate compare-policies` runs every policy on.

- `token-budget` and `kv-capacity`: the sweep presets of `loadgen/sim/sweep.py`, as they are.
- `length-variance`: four applications (the `user` of their requests) whose output lengths
  differ: app k's mean is proportional to spread**k, the four together always average
  `MEAN_OUTPUT` tokens, and within an app lengths are lognormal (sigma 0.5). Every client
  declares the same generous `max_tokens` (2048, capped by the context) and stops by EOS,
  so the bound says nothing about a request's length while its app does: what a
  predictor learned per tenant can use. Spread 1 is one app's mix; spread 4 gives means of
  about 9, 38, 151 and 602 tokens (extraction, short answers, chat, long-form). Arrivals
  are Poisson at one rate for every spread, 90% of what the server serves of the spread-1
  mix (`policy_lab.mix_capacity`): the load it carries comfortably when lengths barely
  vary. Only the variance changes from point to point, and as it grows the same server
  serves fewer requests a second (14.3, 11.9, 10.6, 9.9 by the same measure), so spread 1
  is stable and spreads 2, 3 and 4 are past that capacity (1.08x, 1.22x, 1.30x): where the
  queue's order decides who meets the SLO. (The rate was set so after a sweep at 90% of
  the spread-4 capacity had shown that no order can raise goodput much below capacity.)
  Prompts are uniform 32-512 tokens whatever the app.
- `variance-load`: the largest spread again, at offered loads from 0.8x to 1.4x of its
  own capacity, FCFS and SJF (learned) only: where the order starts to matter for goodput.
  Below capacity a request rarely waits long, so FCFS already meets the SLO for nearly every
  request and no order can raise goodput much; from about 1.25x of it (the all-at-once
  capacity understates what Poisson arrivals sustain), FCFS's queue delays everyone.
- `tenant-flood`: two tenants with the same length mix, "flood" sending 4x "steady"'s rate,
  together 3x what the server can serve, so both stay backlogged: the fair share question.

`--scale` multiplies every trace's request count (a smaller run for quick looks).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadgen.distributions import LengthDist, arrival_times
from loadgen.sim.setup import add_run_args, build_workload
from loadgen.sim.sweep import PRESETS, with_param
from loadgen.workloads import WorkloadRequest

MEAN_OUTPUT = 200
DECLARED_MAX_TOKENS = 2048
SPREADS = ("1", "2", "3", "4")
NUM_APPS = 4
# Rates from the server's capacity for each mix (`policy_lab.mix_capacity`: what FCFS
# serves, llama-3.1-8b on an a100-80g with 1024 KV blocks, with every request queued at
# once); tests/loadgen/test_policy_lab.py measures the first again.
SPREAD1_CAPACITY = 14.3  # req/s at spread 1
SPREAD4_CAPACITY = 9.9  # req/s at spread 4
VARIANCE_RATE = round(0.9 * SPREAD1_CAPACITY, 1)  # req/s (12.9), for every spread
LOAD_FACTORS = ("0.8", "0.9", "1.0", "1.1", "1.2", "1.3", "1.4")
FLOOD_STEADY_RATE = 12.0  # req/s; flood sends 48: 60 in all, 3x the 20.5 req/s served


@dataclass
class TracePoint:
    """One value of a trace's parameter: the flags and the workload every policy runs."""

    label: str
    args: argparse.Namespace
    workload: list[WorkloadRequest]


@dataclass
class Trace:
    name: str
    param: str
    about: str
    points: list[TracePoint] = field(default_factory=list)
    record_service: bool = False  # fairness metrics need per-step service
    queues: tuple[str, ...] | None = None  # the queue policies it runs (None: all)
    victims: tuple[str, ...] | None = None  # the victim policies it runs (None: all)


def base_args(argv: list[str] | None = None, **defaults: Any) -> argparse.Namespace:
    """The simulator's run flags with `defaults` applied (what a preset does). Prefix caching
    is off: the lab compares orders and victims, and a resumed victim's recompute is the cost
    the victim policies are judged by (a cached prefix would hide part of it)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_run_args(parser)
    parser.set_defaults(**{"enable_prefix_caching": False, **defaults})
    return parser.parse_args(argv or [])


def _scaled(n: int, scale: float) -> int:
    return max(8, int(round(n * scale)))


def preset_trace(name: str, scale: float) -> Trace:
    preset = PRESETS[name]
    defaults = dict(preset.defaults)
    defaults["num_prompts"] = _scaled(int(defaults["num_prompts"]), scale)
    args = base_args(**defaults)
    trace = Trace(name, preset.param, preset.about)
    for value in preset.values:
        point = with_param(args, preset.param, value)
        trace.points.append(TracePoint(value, point, build_workload(point)))
    return trace


def app_means(spread: float) -> list[float]:
    """Mean output length of each app: proportional to spread**k, averaging MEAN_OUTPUT."""
    raw = [spread**k for k in range(NUM_APPS)]
    return [MEAN_OUTPUT * NUM_APPS * r / sum(raw) for r in raw]


def variance_workload(n: int, spread: float, rate: float, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 12])
    arrivals = arrival_times(n, rate, 1.0, np.random.default_rng([seed, 0]))
    apps = rng.integers(0, NUM_APPS, size=n)
    means = app_means(spread)
    sigma = 0.5
    mu = [math.log(m) - sigma**2 / 2 for m in means]  # lognormal with that mean
    out: list[WorkloadRequest] = []
    for i in range(n):
        app = int(apps[i])
        prompt = int(rng.integers(32, 513))
        declared = DECLARED_MAX_TOKENS
        length = int(min(max(round(rng.lognormal(mu[app], sigma)), 1), declared))
        out.append(WorkloadRequest(f"req-{i}", float(arrivals[i]), prompt, length,
                                   user=f"app{app}", max_tokens=declared))
    return out


def variance_args(n: int, rate: float) -> argparse.Namespace:
    """The run flags of a length-variance workload of n requests at `rate`."""
    return base_args(
        num_prompts=n,
        request_rate=rate,
        max_model_len=512 + DECLARED_MAX_TOKENS,
        num_gpu_blocks=1024,
    )


def variance_trace(scale: float, rate: float = VARIANCE_RATE) -> Trace:
    n = _scaled(1200, scale)
    args = variance_args(n, rate)
    trace = Trace(
        "length-variance",
        "spread",
        f"output length variance across four apps; the mean stays {MEAN_OUTPUT} tokens",
    )
    for spread in SPREADS:
        trace.points.append(TracePoint(spread, args, variance_workload(n, float(spread), rate, 0)))
    return trace


def load_trace(scale: float) -> Trace:
    """Spread 4 at each of LOAD_FACTORS x its capacity: the same requests, arriving faster."""
    n = _scaled(1200, scale)
    trace = Trace(
        "variance-load",
        "load",
        f"spread 4 at offered loads relative to its {SPREAD4_CAPACITY} req/s capacity",
        queues=("fcfs", "sjf"),
        victims=("newest",),
    )
    for factor in LOAD_FACTORS:
        rate = float(factor) * SPREAD4_CAPACITY
        trace.points.append(
            TracePoint(factor, variance_args(n, rate), variance_workload(n, 4.0, rate, 0))
        )
    return trace


def flood_workload(n: int, steady_rate: float, seed: int) -> list[WorkloadRequest]:
    """n requests: a fifth from "steady" at `steady_rate`, the rest from "flood" at 4x."""
    lengths = np.random.default_rng([seed, 1])
    out: list[WorkloadRequest] = []
    for tenant, count, rate, stream in (
        ("steady", n // 5, steady_rate, 2),
        ("flood", n - n // 5, 4 * steady_rate, 3),
    ):
        times = arrival_times(count, rate, 1.0, np.random.default_rng([seed, stream]))
        prompts = LengthDist.parse("uniform:32:512").sample(lengths, count)
        outputs = LengthDist.parse("uniform:32:256").sample(lengths, count)
        out += [
            WorkloadRequest(f"{tenant}-{i}", float(times[i]), prompts[i], outputs[i], user=tenant)
            for i in range(count)
        ]
    return sorted(out, key=lambda w: w.arrival_time)


def flood_trace(scale: float) -> Trace:
    n = _scaled(1000, scale)
    args = base_args(num_prompts=n, max_model_len=768, num_gpu_blocks=1024)
    trace = Trace(
        "tenant-flood", "trace",
        "two tenants; 'flood' sends 4x 'steady' and together they ask for about 3x capacity",
        record_service=True,
    )
    trace.points.append(TracePoint("4:1", args, flood_workload(n, FLOOD_STEADY_RATE, 0)))
    return trace


TRACES = ("token-budget", "kv-capacity", "length-variance", "variance-load", "tenant-flood")


def build_trace(name: str, scale: float = 1.0, variance_rate: float = VARIANCE_RATE) -> Trace:
    if name == "length-variance":
        return variance_trace(scale, variance_rate)
    if name == "variance-load":
        return load_trace(scale)
    if name == "tenant-flood":
        return flood_trace(scale)
    if name in PRESETS:
        return preset_trace(name, scale)
    raise ValueError(f"unknown trace {name!r}: choose from {', '.join(TRACES)}")
