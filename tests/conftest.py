"""Fixtures shared by the service and worker tests."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from live_servers import LiveServer, start_live_server


@pytest.fixture(scope="session")
def default_live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`stepserve serve` on its defaults, compiled forward included, with a cache of compiled
    forwards of its own: it starts eagerly, builds the compiled forward in the background
    and swaps it in; returned once that happened or failed, with `first_health` (its first
    /health 200 body) and `aot_cache` set. One a session: the worker's accuracy gate loads
    the forward it built (`aot_cache`) instead of compiling its own."""
    tmp = tmp_path_factory.mktemp("defaults")
    aot_cache = tmp / "aot"
    server = start_live_server(tmp, "--max-num-seqs", "16", timeout=600.0, compiled=True,
                               env={"STEPSERVE_AOT_CACHE": str(aot_cache)})
    server.first_health = server.get_json("/health")[1]  # type: ignore[attr-defined]
    server.aot_cache = aot_cache  # type: ignore[attr-defined]
    deadline = time.monotonic() + 900
    while server.get_json("/health")[1].get("compiling") and time.monotonic() < deadline:
        time.sleep(1)
    yield server
    code = server.stop()
    assert code == 0, server.log()
