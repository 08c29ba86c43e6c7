"""The online step-cost fit: it recovers known coefficients from noisy synthetic step times,
follows a machine that gets slower, shrugs off a single outlier, keeps its coefficients
non-negative, and falls back on the start-up seed in directions live traffic stops
exciting. Also the small solvers it is built on."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from scheduler.step_cost import FEATURES, BatchShape, step_features
from scheduler.step_cost_fit import OnlineStepCost, nnls, solve

# Seconds per unit of each feature, roughly SmolLM2 on two CPU cores
TRUE = dict(zip(FEATURES, (22e-3, 1.5e-3, 6e-6, 50e-3, 2.2e-3, 0.6e-3, 0.6e-6), strict=True))


def _time(b: BatchShape, scale: float = 1.0) -> float:
    return scale * sum(c * f for c, f in zip(TRUE.values(), step_features(b), strict=True))


def _shape(rng: random.Random) -> BatchShape:
    """A mixed step: decodes at various contexts, maybe one chunk that may or may not sample,
    sometimes a lone decode (no multi-token cost)."""
    b = BatchShape()
    if rng.random() < 0.1:
        b.add(1, rng.randint(0, 1000))
        return b
    for _ in range(rng.randint(0, 24)):
        b.add(1, rng.randint(10, 1000))
    if b.num_reqs == 0 or rng.random() < 0.6:
        for _ in range(rng.randint(1, 3)):
            b.add(rng.randint(2, 512), rng.choice([0, 0, 128, 512]), samples=rng.random() < 0.5)
    return b


def _rel_errors(model: OnlineStepCost, rng: random.Random, scale: float = 1.0, n: int = 200) -> list[float]:
    shapes = [_shape(rng) for _ in range(n)]
    return [abs(model.predict(b) - _time(b, scale)) / _time(b, scale) for b in shapes]


def test_recovers_known_coefficients_from_noisy_steps() -> None:
    rng = random.Random(1)
    model = OnlineStepCost(forgetting=1.0)  # no forgetting: every sample counts, as offline
    for _ in range(3000):
        b = _shape(rng)
        model.observe(b, _time(b) * (1 + rng.gauss(0, 0.02)))
    fitted = model.coefficients
    for name in ("step", "kv_token_read", "multi_token", "token", "attention_pair"):
        assert fitted[name] == pytest.approx(TRUE[name], rel=0.15), name
    # per request and per sampled position are nearly collinear (most requests are decodes
    # that sample); their sum is what decodes pay, and it is recovered
    assert fitted["request"] + fitted["sampled"] == pytest.approx(TRUE["request"] + TRUE["sampled"], rel=0.15)
    assert max(_rel_errors(model, rng)) < 0.05


def test_follows_a_step_change_in_machine_speed() -> None:
    rng = random.Random(2)
    model = OnlineStepCost()
    for _ in range(400):
        b = _shape(rng)
        model.observe(b, _time(b) * (1 + rng.gauss(0, 0.03)))
    assert sorted(_rel_errors(model, rng))[180] < 0.1  # p90 within 10 %
    for _ in range(300):  # the machine gets 1.6x slower (another tenant, thermal limits, ...)
        b = _shape(rng)
        model.observe(b, _time(b, 1.6) * (1 + rng.gauss(0, 0.03)))
    assert sorted(_rel_errors(model, rng, scale=1.6))[180] < 0.1
    assert model.relative_error < 0.1


def test_one_outlier_step_moves_the_fit_by_a_bounded_amount() -> None:
    rng = random.Random(3)
    model = OnlineStepCost()
    for _ in range(300):
        b = _shape(rng)
        model.observe(b, _time(b) * (1 + rng.gauss(0, 0.02)))
    probe = BatchShape()
    probe.add(1, 200, count=16)
    before = model.predict(probe)
    model.observe(probe, 5 * _time(probe))  # a 5x stall: page faults, a stolen core
    assert model.predict(probe) / before < 1.05
    unweighted, rng = OnlineStepCost(huber=1e9), random.Random(3)
    for _ in range(300):
        b = _shape(rng)
        unweighted.observe(b, _time(b) * (1 + rng.gauss(0, 0.02)))
    before = unweighted.predict(probe)
    unweighted.observe(probe, 5 * _time(probe))
    assert unweighted.predict(probe) / before > 1.1  # without the Huber weight it would move


def test_coefficients_stay_non_negative() -> None:
    rng = random.Random(4)
    model = OnlineStepCost()
    for _ in range(200):  # times that a negative per-token coefficient would fit better
        b = _shape(rng)
        model.observe(b, max(1e-3, 0.5 - 1e-4 * b.num_tokens) * (1 + rng.gauss(0, 0.05)))
        assert all(v >= 0 for v in model.coefficients.values())


def test_seed_keeps_directions_live_traffic_stopped_exciting() -> None:
    """Seeded with long prefills; then only decodes for thousands of steps. A long prefill
    is still predicted from the seed, not from coefficients decayed to nothing."""
    rng = random.Random(5)
    model = OnlineStepCost()
    for _ in range(8):
        b = _shape(rng)
        model.seed(b, _time(b))
    long = BatchShape()
    long.add(1024, 0)
    for _ in range(3000):
        b = BatchShape()
        b.add(1, rng.randint(10, 800), count=rng.randint(1, 32))
        model.observe(b, _time(b) * (1 + rng.gauss(0, 0.02)))
    assert model.predict(long) == pytest.approx(_time(long), rel=0.25)


def test_swap_copies_are_priced_at_the_measured_bandwidth() -> None:
    model = OnlineStepCost(block_bytes=1 << 20, copy_bandwidth=1e9)
    b = BatchShape(swap_blocks=10)
    assert model.predict(b) == pytest.approx(10 * (1 << 20) / 1e9)
    assert model.observe(BatchShape(), 1.0) is None  # an empty step tells nothing
    assert model.observe(b, 0.0) is None  # neither does an untimed one
    assert model.num_observed == 0


def test_relative_error_is_measured_before_each_update() -> None:
    model = OnlineStepCost()
    b = BatchShape()
    b.add(1, 10, count=4)
    model.seed(b, 0.1)
    assert model.predict(b) == pytest.approx(0.1, rel=1e-3)
    model.observe(b, 0.2)  # predicted 0.1, measured 0.2
    assert model.relative_error == pytest.approx(0.5, rel=1e-2)
    assert (model.last_predicted, model.last_measured) == (pytest.approx(0.1, rel=1e-3), 0.2)


def test_overrun_is_the_tail_of_measured_over_predicted() -> None:
    """Steps measured 0.8-1.2x of a fixed truth at random: the least-squares fit is right on
    average, so about half run over it; the overrun is their 99th percentile, near 1.2x
    over the fit, and 1.0 before it has a window past the fit's warm-up."""
    rng = random.Random(3)
    model = OnlineStepCost(forgetting=1.0)
    for _ in range(2 * model.warmup - 1):
        b = _shape(rng)
        model.observe(b, _time(b, rng.uniform(0.8, 1.2)))
    assert model.overrun() == 1.0
    ratios = []
    for _ in range(400):
        b = _shape(rng)
        measured = _time(b, rng.uniform(0.8, 1.2))
        ratios.append(measured / model.predict(b))
        model.observe(b, measured)
    tail = sorted(ratios[-256:])[int(0.99 * 256)]
    assert model.overrun() == pytest.approx(tail, rel=0.02)
    assert 1.1 < model.overrun() < 1.3
    # Predictions it overran by little: never below 1 (a pessimistic fit is not sped up).
    fast = OnlineStepCost()
    for _ in range(100):
        b = _shape(rng)
        fast.observe(b, _time(b))
    assert fast.overrun() >= 1.0


def test_solve_and_nnls_against_brute_force() -> None:
    rng = random.Random(6)
    for _ in range(50):
        n = rng.randint(1, 5)
        a = [[rng.gauss(0, 1) for _ in range(n)] for _ in range(n + 3)]
        m = [[sum(r[i] * r[j] for r in a) + (1e-6 if i == j else 0) for j in range(n)] for i in range(n)]
        c = [rng.gauss(0, 1) for _ in range(n)]
        x = solve(m, c)
        assert x is not None
        assert all(math.isclose(sum(m[i][j] * x[j] for j in range(n)), c[i], abs_tol=1e-6) for i in range(n))
        best = min(_subset_solutions(m, c), key=lambda y: _objective(m, c, y))
        got = nnls(m, c)
        assert all(v >= 0 for v in got)
        assert _objective(m, c, got) <= _objective(m, c, best) + 1e-7
        # started from any guess of the support (right, wrong, all): the same optimum
        for start in (tuple(i for i in range(n) if best[i] > 0), tuple(range(n)),
                      tuple(sorted(rng.sample(range(n), rng.randint(1, n))))):
            warm = nnls(m, c, start=start)
            assert all(v >= 0 for v in warm)
            assert _objective(m, c, warm) <= _objective(m, c, best) + 1e-7


def _objective(m: list[list[float]], c: list[float], x: list[float]) -> float:
    n = len(c)
    return sum(x[i] * m[i][j] * x[j] for i in range(n) for j in range(n)) - 2 * sum(c[i] * x[i] for i in range(n))


def _subset_solutions(m: list[list[float]], c: list[float]) -> list[list[float]]:
    """Every non-negative solution with some variables held at zero (exact NNLS by enumeration)."""
    n = len(c)
    out = [[0.0] * n]
    for k in range(1, n + 1):
        for idx in itertools.combinations(range(n), k):
            sub = solve([[m[i][j] for j in idx] for i in idx], [c[i] for i in idx])
            if sub is not None and all(v >= 0 for v in sub):
                x = [0.0] * n
                for i, v in zip(idx, sub, strict=True):
                    x[i] = v
                out.append(x)
    return out
