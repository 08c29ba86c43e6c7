"""Service-level objectives per request: what a request is held to (`SLO`), where a
request's objectives come from (`SLOClasses`: the request's own fields, then its tenant's
class, its priority's class, the server default), whether a finished request met them
(`slo_met`), and how much time a request has to spare (`due`, `slack`).

An objective is a time to first token (TTFT: from arrival to the first token) and a time
per output token after it (TPOT: the mean gap, (finish - first token) / (outputs - 1)). A
request may carry either, both or none. Times are seconds here; the HTTP fields and flags
speak milliseconds (`slo_ttft_ms`, `--default-slo ttft=2000,tpot=150`).

What a request is *due* to do next::

    no first token yet:   its first token, by  arrival + ttft
    decoding:             its next token,  by  first token + tpot * outputs so far

and its slack is that due time, less now, less the time the work before it takes (its
prefill still to do; for a running request, also the recompute a preemption would cost).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.request import Request

DEFAULT_CLASS = "default"  # the class of a request whose objectives are the server default
REQUEST_CLASS = "request"  # the class of a request that set an objective itself


@dataclass(frozen=True)
class SLO:
    """Objectives in seconds; `cls` names where they came from (a metrics label). None: not
    set (a class below may set it); `math.inf`, only in the server's classes: set to no
    objective (``tpot=none``), which `SLOClasses.resolve` turns back into None."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    cls: str = DEFAULT_CLASS

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # also rejects NaN
                raise ValueError(f"slo_{name[:-2]}_ms must be a positive number of "
                                 f"milliseconds, got {value * 1e3}")

    @property
    def empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None

    def over(self, base: SLO) -> SLO:
        """These objectives, each missing one taken from `base` (and its class with it when
        this one sets none)."""
        if self.empty:
            return base
        return SLO(self.ttft_s if self.ttft_s is not None else base.ttft_s,
                   self.tpot_s if self.tpot_s is not None else base.tpot_s, self.cls)

    def as_ms(self) -> dict[str, float | None]:
        """The objectives as the API and the step records write them."""
        return {"ttft_ms": _ms(self.ttft_s), "tpot_ms": _ms(self.tpot_s)}


NO_SLO = SLO()


def _finite(seconds: float | None) -> float | None:
    return None if seconds == math.inf else seconds


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


@dataclass(frozen=True)
class SLOClasses:
    """The server's objectives for requests that set none: a default, and overrides per
    class: ``user:NAME`` (the OpenAI `user`, the tenant) or ``priority:N``. A request's own
    objectives win, then its tenant's class, then its priority's, then the default; each
    objective separately (a class that sets only ttft keeps the default tpot)."""

    default: SLO = NO_SLO
    classes: tuple[tuple[str, SLO], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        names = [name for name, _ in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"slo classes name a class twice: {names}")
        for name in names:
            kind, sep, value = name.partition(":")
            if not sep or not value or kind not in ("user", "priority"):
                raise ValueError(f"slo class {name!r} is not user:NAME or priority:N")
            if kind == "priority":
                try:
                    int(value)
                except ValueError:
                    raise ValueError(f"slo class {name!r}: priority must be an integer") from None

    def resolve(self, given: SLO, tenant: str, priority: int) -> SLO:
        by_name = dict(self.classes)
        slo = self.default
        for name in (f"priority:{priority}", f"user:{tenant}"):
            cls = by_name.get(name)
            if cls is not None:
                slo = cls.over(slo)
        given = given if given.empty else SLO(given.ttft_s, given.tpot_s, REQUEST_CLASS)
        slo = given.over(slo)
        if slo.ttft_s == math.inf or slo.tpot_s == math.inf:
            slo = SLO(_finite(slo.ttft_s), _finite(slo.tpot_s), slo.cls)
        return slo

    @property
    def names(self) -> tuple[str, ...]:
        """Every class a request can be counted under (the metrics' label values)."""
        return (DEFAULT_CLASS, REQUEST_CLASS, *(name for name, _ in self.classes))


def parse_slo(spec: str, cls: str = DEFAULT_CLASS) -> SLO:
    """``ttft=2000,tpot=150`` (milliseconds; ``none``: no objective, over any the default
    sets) -> `SLO`."""
    values: dict[str, float | None] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, text = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot"):
            raise ValueError(f"slo {spec!r}: {item!r} is not ttft=MS or tpot=MS")
        if key in values:
            raise ValueError(f"slo {spec!r} sets {key} twice")
        if text.strip().lower() == "none":
            values[key] = math.inf
            continue
        try:
            ms = float(text)
        except ValueError:
            raise ValueError(f"slo {spec!r}: {key} is not a number: {text!r}") from None
        if not (math.isfinite(ms) and ms > 0):
            raise ValueError(f"slo {spec!r}: {key} must be a positive number of ms, got {text!r}")
        values[key] = ms / 1e3
    return SLO(values.get("ttft"), values.get("tpot"), cls)


def parse_slo_classes(spec: str) -> tuple[tuple[str, SLO], ...]:
    """One ``CLASS=ttft=MS,tpot=MS`` (``user:batch=ttft=60000,tpot=none``), or a JSON file
    ``{"user:batch": {"ttft_ms": 60000, "tpot_ms": null}, "priority:0": {...}}``."""
    path = Path(spec)
    if spec.strip().endswith(".json") or path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"slo classes file {spec!r}: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"slo classes file {spec!r}: expected an object of class: objectives")
        out = []
        for name, body in data.items():
            if not isinstance(body, dict) or set(body) - {"ttft_ms", "tpot_ms"}:
                raise ValueError(f"slo classes file {spec!r}: {name!r} must be an object with "
                                 "ttft_ms and/or tpot_ms")
            parts = [f"{k[:4]}={'none' if v is None else v}" for k, v in body.items()]
            out.append((str(name), parse_slo(",".join(parts), str(name))))
        SLOClasses(classes=tuple(out))  # checks the names
        return tuple(out)
    name, sep, rest = spec.partition("=")
    if not sep:
        raise ValueError(f"slo class {spec!r} is not CLASS=ttft=MS,tpot=MS")
    entry = (name.strip(), parse_slo(rest, name.strip()))
    SLOClasses(classes=(entry,))
    return (entry,)


# ---- judged at the end ---------------------------------------------------------------------

def ttft_and_tpot(arrival: float, first_token: float | None, finished: float,
                  num_output_tokens: int) -> tuple[float | None, float | None]:
    """A request's measured TTFT and TPOT (None where it has no such time)."""
    if first_token is None:
        return None, None
    tpot = (finished - first_token) / (num_output_tokens - 1) if num_output_tokens > 1 else None
    return first_token - arrival, tpot


def slo_met(slo: SLO, ttft: float | None, tpot: float | None) -> tuple[bool, bool]:
    """Whether measured `ttft` / `tpot` met each objective (one it does not have is met; a
    request with no first token missed its TTFT objective)."""
    ttft_ok = slo.ttft_s is None or (ttft is not None and ttft <= slo.ttft_s)
    tpot_ok = slo.tpot_s is None or tpot is None or tpot <= slo.tpot_s
    return ttft_ok, tpot_ok


# ---- slack -----------------------------------------------------------------------------------

PrefillTime = Callable[[int], float]  # seconds to compute that many tokens of one request


def due(req: Request) -> float | None:
    """When the request's next objective falls due (None: it has no objective left)."""
    slo: SLO = req.slo
    first = req.metrics.first_token_time
    if first is None:
        return None if slo.ttft_s is None else req.arrival_time + slo.ttft_s
    if slo.tpot_s is None:
        return None
    return first + slo.tpot_s * req.num_output_tokens


def slack(req: Request, now: float, prefill_time: PrefillTime, preempting: bool = False) -> float:
    """Seconds to spare before `req`'s next objective falls due, once its outstanding work
    (prefill not yet computed) is done; with `preempting`, also after recomputing what it
    has computed. +inf for a request with no objective left."""
    when = due(req)
    if when is None:
        return math.inf
    todo = req.num_tokens - req.num_computed_tokens
    if preempting:
        todo = req.num_tokens
    return when - now - (prefill_time(todo) if todo > 1 else 0.0)
