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
  own capacity, FCFS, SJF (learned) and slo only: where the order starts to matter for
  goodput.
  Below capacity a request rarely waits long, so FCFS already meets the SLO for nearly every
  request and no order can raise goodput much; from about 1.25x of it (the all-at-once
  capacity understates what Poisson arrivals sustain), FCFS's queue delays everyone.
- `tenant-flood`: two tenants with the same length mix, "flood" sending 4x "steady"'s rate,
  together 3x what the server can serve, so both stay backlogged: the fair share question.
- `two-class`: requests with objectives (scheduler/slo.py) from two classes, the `user` of
  their requests: "interactive" (80%: prompts 64-512, outputs 32-256 tokens, TTFT 1 s and
  a TPOT objective of 1.5x the modelled time of a full batch's decode step, 35 ms here)
  and "batch" (20%: prompts 1024-4096, outputs 256-1024 tokens, TTFT 60 s, no TPOT
  objective), Poisson, at offered loads from 0.6x to 1.5x of the mix's capacity (measured
  as for the length-variance mixes), on a KV cache the size an 80 GB card holds for this
  model. The objectives are the server's classes (`--slo-class user:interactive=...`).
- `variance-reject`: spread 4 at 1.5x, 2x and 3x of its capacity, slo with and without
  `--reject-unmeetable` (FCFS too at 1.5x): refusals where slo itself misses objectives.
- `below-capacity`: the other traces' mixes (length variance at spreads 1 and 4, the
  token-budget and KV-capacity presets' requests, the tenant flood's) at 0.6x to 0.9x of
  their own capacity, FCFS against slo: a scheduler that orders by deadlines must not do
  worse where the server keeps up.

The lab's goodput SLO (`--goodput`, ttft:2000 tpot:100) is every request's default
objective in every trace, so that the slo policy schedules by the objectives the lab
judges by; a trace's classes (two-class) override it.

`--scale` multiplies every trace's request count (a smaller run for quick looks).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadgen.distributions import LengthDist, arrival_times
from loadgen.sim.cost_model import BatchShape, CostModel
from loadgen.sim.setup import (
    add_run_args,
    build_workload,
    cost_model_from_args,
    scheduler_config_from_args,
)
from loadgen.sim.simulator import SimLimits, Simulator
from loadgen.sim.step_cost import seeded_model
from loadgen.sim.sweep import PRESETS, with_param
from loadgen.workloads import WorkloadRequest
from scheduler.slo import SLO, parse_slo_classes

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
    pairs: tuple[tuple[str, str], ...] | None = None  # this point's own, over the trace's


@dataclass
class Trace:
    name: str
    param: str
    about: str
    points: list[TracePoint] = field(default_factory=list)
    record_service: bool = False  # fairness metrics need per-step service
    # the (queue, victim) pairs it runs (None: every queue x victim policy asked for)
    pairs: tuple[tuple[str, str], ...] | None = None
    capacity: dict[str, float] = field(default_factory=dict)  # req/s per mix, where measured


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
        pairs=(("fcfs", "newest"), ("sjf", "newest"), ("slo", "slack")),
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


# ---- capacity: what FCFS serves of a mix with every request queued at once ----------------

def capacity(args: argparse.Namespace, workload: list[WorkloadRequest]) -> float:
    """Requests per second FCFS (victim newest, recompute preemption) serves of `workload`
    when every request arrives at once, with the flags in `args`: the capacity the lab's
    loads are fractions of (it understates what Poisson arrivals of a mix sustain: at the
    end of such a run the last long requests run in small batches)."""
    wl = [dataclasses.replace(w, arrival_time=0.0) for w in workload]
    flags = argparse.Namespace(**vars(args))
    flags.preemption_mode = "recompute"
    cm = cost_model_from_args(flags)
    model = seeded_model(cm)
    config = scheduler_config_from_args(flags, wl, cm, model)
    config = dataclasses.replace(config, scheduling_policy="fcfs", victim_policy="newest")
    result = Simulator(config, cm, SimLimits(), step_model=model).run(wl)
    if result.unfinished:
        raise RuntimeError(
            f"the capacity run left {len(result.unfinished)} of {len(wl)} requests unfinished"
        )
    return len(wl) / result.duration


def at_rate(workload: list[WorkloadRequest], factor: float) -> list[WorkloadRequest]:
    """The same requests arriving `factor` times as fast (arrival times divided by it)."""
    return [dataclasses.replace(w, arrival_time=w.arrival_time / factor) for w in workload]


# ---- refusals on the length-variance mix -----------------------------------------------------

VARIANCE_REJECT_LOADS = ("1.5", "2.0", "3.0")


def variance_reject_trace(scale: float) -> Trace:
    """Spread 4 (every request held to the lab's TTFT and TPOT) at 1.5x, 2x and 3x of its
    capacity, slo with and without --reject-unmeetable (and FCFS at 1.5x): where slo
    itself can no longer meet every objective, so that it has something to refuse."""
    n = _scaled(1200, scale)
    trace = Trace("variance-reject", "load",
                  f"spread 4 past its {SPREAD4_CAPACITY} req/s capacity, refusing the unmeetable",
                  pairs=(("slo", "slack"), ("slo-reject", "slack")))
    for factor in VARIANCE_REJECT_LOADS:
        rate = float(factor) * SPREAD4_CAPACITY
        pairs = (("fcfs", "newest"), ("fcfs-reject", "newest"), *(trace.pairs or ())) \
            if factor == "1.5" else None
        trace.points.append(TracePoint(factor, variance_args(n, rate),
                                       variance_workload(n, 4.0, rate, 0), pairs))
    return trace


# ---- two classes with objectives ----------------------------------------------------------

TWO_CLASS_N = 1500
INTERACTIVE_SHARE = 0.8
INTERACTIVE_PROMPT = (64, 512)  # tokens, uniform
INTERACTIVE_OUTPUT = (32, 256)
BATCH_PROMPT = (1024, 4096)
BATCH_OUTPUT = (256, 1024)
INTERACTIVE_TTFT_MS = 1000.0
BATCH_TTFT_MS = 60000.0
TPOT_OVER_DECODE = 1.5  # the interactive TPOT objective over a full batch's decode step
# What an 80 GB card holds for llama-3.1-8b in bf16 after its 15 GB of weights, with room
# for activations: 24576 blocks of 16 tokens (393k tokens, 51.5 GB).
TWO_CLASS_BLOCKS = 24576
TWO_CLASS_MAX_MODEL_LEN = BATCH_PROMPT[1] + BATCH_OUTPUT[1]
TWO_CLASS_LOADS = ("0.6", "0.8", "0.9", "1.0", "1.1", "1.2", "1.3", "1.5")
TWO_CLASS_PAIRS = (("fcfs", "newest"), ("sjf", "newest"), ("fair", "newest"), ("slo", "slack"))
# at REJECT_LOAD the refusing variants run too (their re-simulations are the lab's costliest)
REJECT_LOAD = "1.5"
REJECT_PAIRS = (("fcfs-reject", "newest"), ("slo-reject", "slack"))
INTERACTIVE, BATCH = "interactive", "batch"


def _uniform_moments(lo: int, hi: int) -> tuple[float, float]:
    """E[X] and E[X^2] of the integers uniform in [lo, hi]."""
    mean = (lo + hi) / 2
    return mean, mean * mean + ((hi - lo + 1) ** 2 - 1) / 12


def decode_context() -> float:
    """The context of a decode step's average request in the two-class mix: each request
    decodes output-length times, at contexts from its prompt to prompt + output, so a
    class weighs share x E[output] and its mean context is E[prompt] + E[output^2] / 2E[output]."""
    total = weight = 0.0
    for share, prompt, output in ((INTERACTIVE_SHARE, INTERACTIVE_PROMPT, INTERACTIVE_OUTPUT),
                                  (1 - INTERACTIVE_SHARE, BATCH_PROMPT, BATCH_OUTPUT)):
        p, _ = _uniform_moments(*prompt)
        o, o2 = _uniform_moments(*output)
        total += share * o * (p + o2 / (2 * o))
        weight += share * o
    return total / weight


def interactive_tpot_ms(cm: CostModel, max_num_seqs: int) -> float:
    """TPOT_OVER_DECODE x the modelled decode step of a full batch (`max_num_seqs`
    requests) at the mix's decode context, to the nearest 5 ms."""
    shape = BatchShape()
    shape.add(1, round(decode_context()), count=max_num_seqs)
    return 5.0 * round(TPOT_OVER_DECODE * cm.step_time(shape) * 1e3 / 5.0)


def two_class_workload(n: int, rate: float, seed: int = 0) -> list[WorkloadRequest]:
    """n requests, each interactive with probability INTERACTIVE_SHARE, else batch; Poisson
    at `rate`. Exact output lengths (ignore_eos). Objectives come from the server's classes."""
    rng = np.random.default_rng([seed, 21])
    arrivals = arrival_times(n, rate, 1.0, np.random.default_rng([seed, 20]))
    out: list[WorkloadRequest] = []
    for i in range(n):
        interactive = rng.random() < INTERACTIVE_SHARE
        prompt, output = ((INTERACTIVE_PROMPT, INTERACTIVE_OUTPUT) if interactive
                          else (BATCH_PROMPT, BATCH_OUTPUT))
        user = INTERACTIVE if interactive else BATCH
        out.append(WorkloadRequest(f"{user}-{i}", float(arrivals[i]),
                                   int(rng.integers(prompt[0], prompt[1] + 1)),
                                   int(rng.integers(output[0], output[1] + 1)), user=user))
    return out


def two_class_slo_classes(tpot_ms: float) -> list[tuple[tuple[str, SLO], ...]]:
    """The two classes as `--slo-class` gives them."""
    return [
        parse_slo_classes(f"user:{INTERACTIVE}=ttft={INTERACTIVE_TTFT_MS:g},tpot={tpot_ms:g}"),
        parse_slo_classes(f"user:{BATCH}=ttft={BATCH_TTFT_MS:g},tpot=none"),
    ]


def two_class_args(n: int, rate: float, tpot_ms: float) -> argparse.Namespace:
    return base_args(num_prompts=n, request_rate=rate, max_model_len=TWO_CLASS_MAX_MODEL_LEN,
                     num_gpu_blocks=TWO_CLASS_BLOCKS, slo_class=two_class_slo_classes(tpot_ms))


def two_class_trace(scale: float) -> Trace:
    """The two-class mix at each of TWO_CLASS_LOADS x its capacity: the same requests."""
    n = _scaled(TWO_CLASS_N, scale)
    probe = base_args(num_gpu_blocks=TWO_CLASS_BLOCKS)
    tpot = interactive_tpot_ms(cost_model_from_args(probe), probe.max_num_seqs)
    base = two_class_workload(n, 1.0)
    cap = capacity(two_class_args(n, math.inf, tpot), base)
    trace = Trace(
        "two-class", "load",
        f"interactive (TTFT {INTERACTIVE_TTFT_MS:g} ms, TPOT {tpot:g} ms) and batch (TTFT "
        f"{BATCH_TTFT_MS:g} ms) at offered loads relative to their {cap:.1f} req/s capacity",
        pairs=TWO_CLASS_PAIRS, capacity={"two-class": cap},
    )
    for factor in TWO_CLASS_LOADS:
        rate = float(factor) * cap
        pairs = TWO_CLASS_PAIRS + REJECT_PAIRS if factor == REJECT_LOAD else None
        trace.points.append(
            TracePoint(factor, two_class_args(n, rate, tpot), at_rate(base, rate), pairs)
        )
    return trace


# ---- the other mixes below their capacity -------------------------------------------------

BELOW_LOADS = ("0.6", "0.7", "0.8", "0.9")
BELOW_PAIRS = (("fcfs", "newest"), ("slo", "slack"))


def _below_mixes(scale: float) -> list[tuple[str, argparse.Namespace, list[WorkloadRequest]]]:
    """(name, flags, the requests at 1 req/s) of each mix the below-capacity trace loads."""
    mixes = []
    n = _scaled(1200, scale)
    for spread in ("1", "4"):
        mixes.append((f"spread{spread}", variance_args(n, 1.0),
                      variance_workload(n, float(spread), 1.0, 0)))
    for name, value in (("token-budget", "2048"), ("kv-capacity", "400")):
        preset = PRESETS[name]
        defaults = dict(preset.defaults)
        defaults["num_prompts"] = _scaled(int(defaults["num_prompts"]), scale)
        args = with_param(base_args(**defaults), preset.param, value)
        rate = float(args.request_rate)
        mixes.append((name, args, at_rate(build_workload(args), 1.0 / rate)))
    flood = flood_trace(scale).points[0]
    rate = 5 * FLOOD_STEADY_RATE
    mixes.append(("tenant-flood", flood.args, at_rate(flood.workload, 1.0 / rate)))
    return mixes


def below_trace(scale: float) -> Trace:
    trace = Trace("below-capacity", "mix@load",
                  "the other traces' mixes at 0.6x-0.9x of their own capacity, FCFS and slo",
                  pairs=BELOW_PAIRS)
    for name, args, unit in _below_mixes(scale):
        cap = capacity(args, unit)
        trace.capacity[name] = cap
        for factor in BELOW_LOADS:
            rate = float(factor) * cap
            point = argparse.Namespace(**vars(args))
            point.request_rate = rate
            trace.points.append(TracePoint(f"{name}@{factor}", point, at_rate(unit, rate)))
    return trace


TRACES = ("token-budget", "kv-capacity", "length-variance", "variance-load", "tenant-flood",
          "two-class", "below-capacity", "variance-reject")


def build_trace(name: str, scale: float = 1.0, variance_rate: float = VARIANCE_RATE) -> Trace:
    if name == "length-variance":
        return variance_trace(scale, variance_rate)
    if name == "variance-load":
        return load_trace(scale)
    if name == "tenant-flood":
        return flood_trace(scale)
    if name == "two-class":
        return two_class_trace(scale)
    if name == "below-capacity":
        return below_trace(scale)
    if name == "variance-reject":
        return variance_reject_trace(scale)
    if name in PRESETS:
        return preset_trace(name, scale)
    raise ValueError(f"unknown trace {name!r}: choose from {', '.join(TRACES)}")
