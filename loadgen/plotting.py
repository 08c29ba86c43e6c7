"""Plotting is optional: matplotlib comes with the `plots` extra (`pip install
'stepserve[plots]'`; `make install` and `make test` install it). Commands that plot call
`require_plots()` before doing any work, so a missing extra is reported at once with what
to install; everything else runs without it."""

from __future__ import annotations

PLOTS_HINT = "plots need matplotlib: pip install 'stepserve[plots]' (make install includes it)"


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_plots() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotsUnavailable(PLOTS_HINT) from None
