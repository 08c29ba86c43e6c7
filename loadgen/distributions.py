"""Random pieces of a workload: token-length distributions, priority mixes, arrival times.

All sampling takes a `numpy.random.Generator`, so one seed reproduces a whole workload.
Spec strings (as the CLI takes them):

- lengths: ``"N"`` or ``"fixed:N"``; ``"uniform:LO:HI"`` (both ends included);
  ``"lognormal:MEAN:SIGMA[:MAX]"`` (MEAN is the mean length in tokens, SIGMA the sigma of
  the underlying normal, MAX an optional cap). Every sample is at least 1.
- priority mix: ``"0:0.8,10:0.2"`` (priority:weight pairs; weights need not sum to 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_KINDS = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token lengths; build it with `LengthDist.parse("uniform:50:2000")`."""

    kind: str  # "fixed" | "uniform" | "lognormal"
    a: float  # fixed: the length; uniform: low end; lognormal: mean length
    b: float = 0.0  # uniform: high end (inclusive); lognormal: sigma; fixed: unused
    cap: int | None = None  # lognormal only: samples above it are clipped to it

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"length distribution kind must be one of {_KINDS}, got {self.kind!r}")
        if self.a < 1 and self.kind != "lognormal":
            raise ValueError(f"{self.kind} length must be >= 1, got {self.a}")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"uniform length: HI ({self.b}) must be >= LO ({self.a})")
        if self.kind == "lognormal" and (self.a <= 0 or self.b < 0):
            raise ValueError(
                f"lognormal length: MEAN must be > 0 and SIGMA >= 0, got {self.a}, {self.b}"
            )
        if self.cap is not None and self.cap < 1:
            raise ValueError(f"lognormal length: MAX must be >= 1, got {self.cap}")

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        """Parse ``N``, ``fixed:N``, ``uniform:LO:HI`` or ``lognormal:MEAN:SIGMA[:MAX]``."""
        if isinstance(spec, int):
            return cls("fixed", spec)
        parts = spec.strip().split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", int(parts[0]))
            kind, nums = parts[0].lower(), parts[1:]
            if kind == "fixed" and len(nums) == 1:
                return cls("fixed", int(nums[0]))
            if kind == "uniform" and len(nums) == 2:
                return cls("uniform", int(nums[0]), int(nums[1]))
            if kind == "lognormal" and len(nums) in (2, 3):
                cap = int(nums[2]) if len(nums) == 3 else None
                return cls("lognormal", float(nums[0]), float(nums[1]), cap)
        except ValueError as exc:
            raise ValueError(f"bad length spec {spec!r}: {exc}") from exc
        raise ValueError(
            f"bad length spec {spec!r}: use N, fixed:N, uniform:LO:HI or lognormal:MEAN:SIGMA[:MAX]"
        )

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """Draw `n` lengths (each >= 1)."""
        if self.kind == "fixed":
            return [int(self.a)] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(int(self.a), int(self.b) + 1, size=n)]
        # Pick mu so that the distribution's mean (not its median) is `a`.
        mu = math.log(self.a) - self.b**2 / 2
        values = np.rint(rng.lognormal(mu, self.b, size=n)).astype(np.int64)
        values = np.maximum(values, 1)
        if self.cap is not None:
            values = np.minimum(values, self.cap)
        return [int(x) for x in values]

    @property
    def max(self) -> int | None:
        """The largest length this distribution can produce (None: unbounded lognormal)."""
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(self.b)
        return self.cap

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        cap = f":{self.cap}" if self.cap is not None else ""
        return f"lognormal:{self.a:g}:{self.b:g}{cap}"


@dataclass(frozen=True)
class PriorityMix:
    """Priorities drawn with given weights; parse with `PriorityMix.parse("0:0.8,10:0.2")`."""

    priorities: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.priorities or len(self.priorities) != len(self.weights):
            raise ValueError("priority mix needs one weight per priority and at least one pair")
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError(
                f"priority mix weights must be >= 0 with a positive sum, got {self.weights}"
            )

    @classmethod
    def parse(cls, spec: str) -> PriorityMix:
        """Parse ``"P:W,P:W,..."``."""
        pairs: list[tuple[int, float]] = []
        for item in spec.split(","):
            prio, sep, weight = item.strip().partition(":")
            if not sep:
                raise ValueError(f"bad priority mix item {item!r}: use PRIORITY:WEIGHT")
            pairs.append((int(prio), float(weight)))
        return cls(tuple(p for p, _ in pairs), tuple(w for _, w in pairs))

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """Draw `n` priorities."""
        probs = np.asarray(self.weights, dtype=np.float64)
        idx = rng.choice(len(self.priorities), size=n, p=probs / probs.sum())
        return [self.priorities[int(i)] for i in idx]

    def __str__(self) -> str:
        return ",".join(f"{p}:{w:g}" for p, w in zip(self.priorities, self.weights, strict=True))


def arrival_times(
    n: int, rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Arrival times in seconds from the start, the first at 0.

    Inter-arrival gaps are gamma distributed with shape `burstiness` and mean `1/rate`, so
    burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular.
    `rate = inf` sends everything at time 0.
    """
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *(float(t) for t in np.cumsum(gaps))]
