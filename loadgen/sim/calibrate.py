"""Fit a `HardwareProfile` (effective FLOP/s, bandwidth, overheads) to measured steps.

The model is ``t = max(a * FLOPs, b * bytes) + c + d * requests + e * KV tokens read
+ g * [more than one token]`` with a = 1/FLOP/s, b = 1/bandwidth and c, d, e, g the
per-step, per-request, per-KV-token and multi-token overheads (see `HardwareProfile`). It
is linear once each step is known to be compute- or memory-bound, so the fit alternates:
assign each step to the roof the current parameters say bounds it, solve a (relative-error
weighted) least-squares problem, repeat until the assignment is stable. Several starting
points are tried and the best fit kept.

Input: `bench/worker_step.py` JSON (see `samples_from_bench`), or any list of `StepSample`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from loadgen.sim.cost_model import (
    OVERHEADS,
    BatchShape,
    CostModel,
    HardwareProfile,
    ModelShape,
    get_model_shape,
    overhead_terms,
)


@dataclass(frozen=True)
class StepSample:
    """One measured step: its shape and how long it took."""

    batch: BatchShape
    seconds: float


@dataclass(frozen=True)
class Fit:
    """A fitted profile and how well it explains the samples."""

    profile: HardwareProfile
    rel_rmse: float  # root-mean-square of (predicted - measured) / measured
    num_samples: int
    num_compute_bound: int


def _solve(
    f: np.ndarray, m: np.ndarray, terms: np.ndarray, t: np.ndarray, compute: np.ndarray
) -> np.ndarray | None:
    """Non-negative least squares for (a, b, c, d, e, g) given which steps are compute-bound:
    t = max(a * flops, b * bytes) + terms @ (c, d, e, g), `terms` being each step's
    `overhead_terms`.

    With six unknowns, exact NNLS is cheap: solve on every subset of the columns and keep
    the best solution with no negative entry. A zero entry means "not measured" (a roof no
    step is assigned to) or "no overhead". None when no subset gives a valid solution.
    """
    cols = np.column_stack([np.where(compute, f, 0.0), np.where(compute, 0.0, m), terms])
    cols /= t[:, None]  # relative errors: a 5 ms step weighs as much as a 5 s one
    target = np.ones_like(t)
    best, best_err = None, np.inf
    for subset in itertools.product((False, True), repeat=cols.shape[1]):
        used = np.array(subset) & cols.any(axis=0)
        if not used.any():
            continue
        x = np.zeros(cols.shape[1])
        x[used], *_ = np.linalg.lstsq(cols[:, used], target, rcond=None)
        err = float(np.sum((cols @ x - target) ** 2))
        if (x >= 0).all() and err < best_err:
            best, best_err = x, err
    return best


def _refine(
    f: np.ndarray, m: np.ndarray, terms: np.ndarray, t: np.ndarray, x0: np.ndarray
) -> tuple[np.ndarray, float]:
    """Alternate roof assignment and least squares from `x0`; returns the best (params,
    rel_rmse) seen, `x0` included: each solve is optimal for its roof assignment, not for
    the max() of both roofs, so a later iterate can be worse than an earlier one."""
    def rel_rmse(x: np.ndarray) -> float:
        pred = np.maximum(x[0] * f, x[1] * m) + terms @ x[2:]
        return float(np.sqrt(np.mean(((pred - t) / t) ** 2)))

    x = x0
    best = (x0, rel_rmse(x0))
    compute = x[0] * f >= x[1] * m
    for _ in range(50):
        new = _solve(f, m, terms, t, compute)
        if new is None:
            break
        # an unused roof keeps its previous value
        x = np.array([new[0] or x[0], new[1] or x[1], *new[2:]])
        err = rel_rmse(x)
        if err < best[1]:
            best = (x, err)
        nxt = x[0] * f >= x[1] * m
        if (nxt == compute).all():
            break
        compute = nxt
    return best


def fit_profile(
    samples: Sequence[StepSample],
    shape: ModelShape,
    base: HardwareProfile,
    block_size: int = 16,
    name: str | None = None,
    also_from: Sequence[HardwareProfile] = (),
) -> Fit:
    """Fit effective FLOP/s, bandwidth and the per-step, per-request, per-KV-token and
    multi-token overheads; the host link is kept from `base`.

    The overheads can only be told apart when the samples vary batch size and context:
    `bench/worker_step.py --context 64 512 --chunk-context 0 256 ...` measures such a grid.

    A roof no sample reaches cannot be measured: it keeps `base`'s value (and the fit
    only guarantees it is not binding). The fit starts from `base` (and variants of its
    roofs) and from each profile in `also_from`, and is never worse than any of them.
    """
    if len(samples) < 3:
        raise ValueError(f"calibration needs at least 3 measured steps, got {len(samples)}")
    cm = CostModel(shape, base, block_size)
    f = np.array([cm.flops(s.batch) for s in samples])
    m = np.array([cm.bytes(s.batch) for s in samples])
    terms = np.array([overhead_terms(s.batch) for s in samples])
    t = np.array([s.seconds for s in samples])
    if (t <= 0).any():
        raise ValueError("every measured step must take > 0 seconds")
    x_base = np.array([1 / base.peak_flops, 1 / base.memory_bandwidth, *base.overheads])
    starts = [x_base]
    for scale in (0.25, 4.0):
        for roof in (0, 1):
            x0 = x_base.copy()
            x0[roof] *= scale
            starts.append(x0)
    starts += [
        np.array([1 / p.peak_flops, 1 / p.memory_bandwidth, *p.overheads]) for p in also_from
    ]
    best_x, best_err = min((_refine(f, m, terms, t, x0) for x0 in starts), key=lambda res: res[1])
    compute_bound = int((best_x[0] * f >= best_x[1] * m).sum())
    profile = HardwareProfile(
        name=name or f"{base.name}-calibrated",
        peak_flops=float(1 / best_x[0]),
        memory_bandwidth=float(1 / best_x[1]),
        host_bandwidth=base.host_bandwidth,
        **{field: float(v) for field, v in zip(OVERHEADS, best_x[2:], strict=True)},
    )
    return Fit(profile, best_err, len(samples), compute_bound)


def _batch_from_record(rec: dict[str, Any]) -> BatchShape:
    """A step record: `num_reqs` requests each computing `tokens_per_req` after `context`."""
    batch = BatchShape()
    n = int(rec.get("tokens_per_req") or rec.get("num_tokens", 1))
    batch.add(n, int(rec.get("context", 0)), count=int(rec.get("num_reqs", 1)))
    return batch


def _seconds(rec: dict[str, Any]) -> float | None:
    if rec.get("seconds") is not None:
        return float(rec["seconds"])
    ms = rec.get("step_ms", rec.get("median_ms", rec.get("mean_ms")))
    return None if ms is None else float(ms) / 1e3


def _worker_step_records(data: dict[str, Any], dtype: str | None) -> list[dict[str, Any]]:
    """bench/worker_step.py's layout: per dtype, a `steps` list of every measured step; older
    outputs only have decode steps of B requests at `context` tokens (keyed by B) and fresh
    prefill chunks of N tokens (keyed by N), with `step_ms`."""
    results = data["results"]
    chosen = next((r for r in results if dtype is None or r.get("dtype") == dtype), None)
    if chosen is None:
        raise ValueError(f"the bench output has no results for dtype {dtype!r}")
    if chosen.get("steps"):  # every measured step, with its context
        return list(chosen["steps"])
    context = int(data.get("context", 0))
    records = [{"num_reqs": int(b), "tokens_per_req": 1, "context": context, **v}
               for b, v in chosen.get("decode", {}).items()]
    records += [{"num_reqs": 1, "tokens_per_req": int(n), "context": 0, **v}
                for n, v in chosen.get("prefill", {}).items()]
    return records


def samples_from_bench(data: dict[str, Any], dtype: str | None = None) -> list[StepSample]:
    """Measured steps from bench/worker_step.py output, or from a plain list of step
    records under `steps` (num_reqs, tokens_per_req, context, seconds or step_ms)."""
    results = data.get("results")
    if isinstance(results, list) and results and "decode" in results[0]:
        records = _worker_step_records(data, dtype)
    else:
        records = data.get("steps") or []
    out = []
    for rec in records:
        secs = _seconds(rec)
        if secs is not None:
            out.append(StepSample(_batch_from_record(rec), secs))
    return out


def bench_model_shape(data: dict[str, Any]) -> str | None:
    """The cost-model shape preset a bench run's model name points at, if any."""
    name = str(data.get("model_shape") or data.get("model") or "").lower()
    if "smollm2" in name and "135m" in name:
        return "smollm2-135m"
    for preset in ("llama-3.1-8b", "llama-3.1-70b"):
        if preset in name.replace("meta-", "").replace("_", "-"):
            return preset
    return None


def calibrate_bench(data: dict[str, Any], base: HardwareProfile, shape_name: str | None = None,
                    dtype: str | None = None, name: str | None = None) -> tuple[Fit, ModelShape]:
    """Fit a profile to a bench output; the shape and dtype default to the bench's own.

    The bench's own matmul rate and copy bandwidth (`machine`, in GFLOP/s and GB/s), when
    present, replace `base`'s roofs as the fit's starting point; `base` itself is a
    starting point too, so the fit is never worse than `base` on these steps.
    """
    results = data.get("results")
    if dtype is None and isinstance(results, list) and results and "dtype" in results[0]:
        dtype = str(results[0]["dtype"])
    dtype = dtype or str(data.get("dtype") or "float32")
    shape = get_model_shape(shape_name or bench_model_shape(data) or "smollm2-135m").with_dtype(
        dtype
    )
    machine = data.get("machine") or {}
    flops = machine.get(f"matmul_flops_{dtype}") or machine.get("matmul_flops_float32")
    given = base
    if flops and machine.get("copy_bandwidth_bytes"):
        base = replace(base, peak_flops=float(flops) * 1e9,
                       memory_bandwidth=float(machine["copy_bandwidth_bytes"]) * 1e9)
    fit = fit_profile(samples_from_bench(data, dtype), shape, base, name=name,
                      also_from=(given,) if given is not base else ())
    return fit, shape
