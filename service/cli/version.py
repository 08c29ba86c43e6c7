"""The installed package's version, for `stepserve --version` and `stepserve serve --version`."""

from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    """The `stepserve` distribution's version ("unknown" when run from a bare checkout)."""
    try:
        return importlib.metadata.version("stepserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
