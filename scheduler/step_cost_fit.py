"""`OnlineStepCost`: the step-time model the engine and the simulator hand the scheduler,
fitted online from the measured execute time of every step.

    predicted = θ · step_features(shape) + shape.swap_blocks * block_bytes / copy_bandwidth

θ ≥ 0 holds one coefficient per `FEATURES` term. After each measured step it is the
non-negative minimiser of::

    Σ_k λ^age(k) · w_k · (θ·φ_k / t_k - 1)²    live steps, forgotten at rate λ per step
  + ε · Σ_j (θ·φ_j / t_j - 1)²                 seed steps (the start-up calibration), kept
  + δ · |θ ⊙ S|²                                a tiny ridge, so every direction is determined

- Relative errors (each equation divided by its own measured time, as the offline
  calibration does): a 50 ms decode weighs as much as a 2 s prefill.
- Forgetting (memory ~ 1 / (1 - λ) steps) follows a machine that gets slower or faster.
- w_k is a Huber weight on |log(measured / predicted)| beyond a few times its running
  mean: one outlier step (a page-fault storm, another tenant) moves the fit by a bounded
  amount, while a lasting change wins within a few dozen steps as the running mean grows.
- The seed term is weak next to recent traffic, but it is never forgotten: a direction
  recent steps do not excite (no long prefill for minutes) falls back to the calibrated
  value instead of drifting to zero.

A least-squares fit is right on average, so about half of the steps run over it. `overrun`
says by how much at the tail: the 99th percentile of measured / predicted over the last
256 steps. The slo policy divides a TPOT objective by it, so that steps held to the
objective meet it at the tail (a stream's p99 inter-token latency), not only on average.

Pure Python (the scheduler's package imports no numpy): seven unknowns, a 7x7 normal
matrix updated in O(49) per step and solved lazily, on the next prediction, with
non-negativity by Lawson-Hanson's active set, started from the last fit's support: the
optimum is unique (the ridge makes the problem strictly convex), so the warm start changes
how fast it is found (one small solve in the usual step, instead of one per coefficient),
not what is found.
"""

from __future__ import annotations

import math
from collections import deque
from operator import mul

from scheduler.step_cost import FEATURES, BatchShape, step_features

# Typical magnitude of each feature: the normal matrix is built on features / scale, so
# that its entries are of one order and the solve is well conditioned.
_SCALES = (1.0, 32.0, 8192.0, 1.0, 256.0, 32.0, 65536.0)
_N = len(FEATURES)
_RIDGE = 1e-9
_EWMA = 0.05  # the relative-error and outlier-scale running means: ~ the last 20 steps
_MIN_LOG_SCALE = 0.05
OVERRUN_WINDOW = 256  # steps
OVERRUN_QUANTILE = 0.99
MAX_OVERRUN = 2.0  # a storm of slow steps halves a TPOT-held step at most


class OnlineStepCost:
    """Predicts a step's seconds from its shape; `observe` refits it from a measured step.

    Callable (`model(shape)` is `model.predict(shape)`), so it can be passed straight to
    `SchedulerConfig(step_cost=...)`: the scheduler then sees every refit at once.
    """

    def __init__(self, *, forgetting: float = 0.98, seed_weight: float = 0.1, huber: float = 3.0,
                 warmup: int = 20, block_bytes: int = 0, copy_bandwidth: float = 0.0) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if seed_weight <= 0 or huber <= 0 or warmup < 0:
            raise ValueError("seed_weight and huber must be > 0 and warmup >= 0")
        if block_bytes < 0 or copy_bandwidth < 0:
            raise ValueError("block_bytes and copy_bandwidth must be >= 0")
        self.forgetting, self.seed_weight = forgetting, seed_weight
        self.huber, self.warmup = huber, warmup
        self.block_bytes, self.copy_bandwidth = block_bytes, copy_bandwidth
        self._live = _Normal()
        self._seed = _Normal()
        self._coef: tuple[float, ...] = (0.0,) * _N
        self._support: tuple[int, ...] = tuple(range(_N))  # the last fit's positive coefficients
        self._dirty = False
        self._log_scale = 0.1
        self.num_observed = 0
        self.num_seeded = 0
        self.relative_error = math.nan  # running mean of |predicted - measured| / measured
        self.last_predicted = 0.0
        self.last_measured = 0.0
        self._ratios: deque[float] = deque(maxlen=OVERRUN_WINDOW)  # measured / predicted
        self._overrun: float | None = 1.0  # None: to compute from _ratios

    # ---- prediction --------------------------------------------------------------------
    def predict(self, batch: BatchShape) -> float:
        """Predicted seconds of a step of this shape."""
        if self._dirty:
            self._refit()
        fitted = sum(c * f for c, f in zip(self._coef, step_features(batch), strict=True))
        return fitted + self.swap_seconds(batch)

    __call__ = predict

    def overrun(self) -> float:
        """How far measured steps run over the predictions at the tail: the
        `OVERRUN_QUANTILE` of measured / predicted over the last `OVERRUN_WINDOW` steps,
        within [1, MAX_OVERRUN]; 1.0 until `warmup` steps past the first `warmup` are measured."""
        if self._overrun is None:
            if len(self._ratios) < max(self.warmup, 1):
                self._overrun = 1.0
            else:
                ratios = sorted(self._ratios)
                q = ratios[min(int(OVERRUN_QUANTILE * len(ratios)), len(ratios) - 1)]
                self._overrun = min(max(q, 1.0), MAX_OVERRUN)
        return self._overrun

    def swap_seconds(self, batch: BatchShape) -> float:
        """The swap copies' share: measured bandwidth, not fitted (swaps are too rare)."""
        if not batch.swap_blocks or not self.copy_bandwidth:
            return 0.0
        return batch.swap_blocks * self.block_bytes / self.copy_bandwidth

    @property
    def coefficients(self) -> dict[str, float]:
        """Seconds per unit of each feature (per step, per request, per KV token read, ...)."""
        if self._dirty:
            self._refit()
        return dict(zip(FEATURES, self._coef, strict=True))

    # ---- fitting -----------------------------------------------------------------------
    def seed(self, batch: BatchShape, seconds: float) -> None:
        """A calibration step: kept in the fit for good, with weight `seed_weight`."""
        x = self._row(batch, seconds - self.swap_seconds(batch))
        if x is not None:
            self._seed.add(x, 1.0)
            self.num_seeded += 1
            self._dirty = True

    def observe(self, batch: BatchShape, seconds: float) -> float | None:
        """Refit from one measured step; returns what was predicted for it, or None when
        the step tells nothing (not timed, or nothing computed)."""
        if seconds <= 0 or (batch.num_tokens == 0 and not batch.swap_blocks):
            return None
        predicted = self.predict(batch)
        err = abs(predicted - seconds) / seconds
        self.relative_error = (
            err
            if math.isnan(self.relative_error)
            else self.relative_error + _EWMA * (err - self.relative_error)
        )
        self.last_predicted, self.last_measured = predicted, seconds
        if predicted > 0 and self.num_observed >= self.warmup:  # past the fit's first misses
            self._ratios.append(seconds / predicted)
            self._overrun = None
        swap = self.swap_seconds(batch)
        x = self._row(batch, seconds - swap)
        if x is None:
            return predicted  # all of it was copy time: nothing to learn about the forward
        self._live.decay(self.forgetting)
        self._live.add(x, self._huber_weight(predicted - swap, seconds - swap))
        self.num_observed += 1
        self._dirty = True
        return predicted

    def _huber_weight(self, predicted: float, measured: float) -> float:
        if predicted <= 0:
            return 1.0
        r = abs(math.log(measured / predicted))
        limit = self.huber * self._log_scale
        self._log_scale = max(_MIN_LOG_SCALE, self._log_scale + _EWMA * (r - self._log_scale))
        if self.num_observed < self.warmup or r <= limit:
            return 1.0
        return limit / r

    @staticmethod
    def _row(batch: BatchShape, seconds: float) -> list[float] | None:
        """The step's equation, relative: features / scale / seconds (target 1)."""
        if seconds <= 0:
            return None
        return [f / (s * seconds) for f, s in zip(step_features(batch), _SCALES, strict=True)]

    def _refit(self) -> None:
        eps = self.seed_weight
        m = [
            [a + eps * s for a, s in zip(ra, rs, strict=True)]
            for ra, rs in zip(self._live.m, self._seed.m, strict=True)
        ]
        for i in range(_N):
            m[i][i] += _RIDGE
        c = [a + eps * s for a, s in zip(self._live.c, self._seed.c, strict=True)]
        x = nnls(m, c, start=self._support)
        self._support = tuple(i for i, v in enumerate(x) if v > 0) or tuple(range(_N))
        self._coef = tuple(v / s for v, s in zip(x, _SCALES, strict=True))
        self._dirty = False


class _Normal:
    """Σ w x xᵀ and Σ w x of relative step equations (target 1)."""

    def __init__(self) -> None:
        self.m = [[0.0] * _N for _ in range(_N)]
        self.c = [0.0] * _N

    def decay(self, factor: float) -> None:
        if factor == 1.0:
            return
        for row in self.m:
            for j in range(_N):
                row[j] *= factor
        self.c = [v * factor for v in self.c]

    def add(self, x: list[float], weight: float) -> None:
        for i, xi in enumerate(x):
            if xi:
                wxi = weight * xi
                row = self.m[i]
                for j in range(_N):
                    row[j] += wxi * x[j]
                self.c[i] += wxi


def solve(m: list[list[float]], c: list[float]) -> list[float] | None:
    """x with m x = c (Gaussian elimination, partial pivoting); None if m is singular."""
    n = len(c)
    a = [list(row) + [c[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            return None
        a[col], a[piv] = a[piv], a[col]
        prow = a[col]
        for r in range(col + 1, n):
            f = a[r][col] / prow[col]
            if f:
                row = a[r]
                for k in range(col, n + 1):
                    row[k] -= f * prow[k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


def nnls(m: list[list[float]], c: list[float], start: tuple[int, ...] = ()) -> list[float]:
    """argmin over x >= 0 of xᵀ m x - 2 cᵀ x (m symmetric positive definite): Lawson-Hanson's
    active set on the normal equations.

    `start` is a guess of the optimum's positive coordinates (a previous fit's): when the
    problem restricted to them has a positive solution, the search starts there, which meets
    the algorithm's invariant (x optimal on its passive set, positive there), so only the
    coordinates the guess got wrong cost iterations. Otherwise it starts from x = 0.
    """
    n = len(c)
    x = [0.0] * n
    passive = [False] * n
    tol = 1e-12 * max(1.0, max(abs(v) for v in c))
    if start:
        sub = solve([[m[i][k] for k in start] for i in start], [c[i] for i in start])
        if sub is not None and min(sub) > 0:
            for i, v in zip(start, sub, strict=True):
                x[i], passive[i] = v, True
    for _ in range(3 * n):
        grad = [c[i] - sum(map(mul, m[i], x)) for i in range(n)]
        free = [i for i in range(n) if not passive[i]]
        if not free:
            break
        j = max(free, key=lambda i: grad[i])
        if grad[j] <= tol:
            break
        passive[j] = True
        for _ in range(3 * n):
            idx = [i for i in range(n) if passive[i]]
            sub = (solve([[m[i][k] for k in idx] for i in idx], [c[i] for i in idx])
                   or [0.0] * len(idx))
            s = [0.0] * n
            for i, v in zip(idx, sub, strict=True):
                s[i] = v
            if all(s[i] > 0 for i in idx):
                x = s
                break
            alpha = min(x[i] / (x[i] - s[i]) for i in idx if s[i] <= 0)
            x = [xi + alpha * (si - xi) for xi, si in zip(x, s, strict=True)]
            for i in idx:
                if x[i] <= tol:
                    passive[i], x[i] = False, 0.0
    return x
