"""The scheduler and the simulator type-check: `mypy` with the repository's mypy.ini
(strict) reports nothing over the packages it names (`scheduler`, `loadgen/sim`)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_is_clean_over_the_configured_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = pytest.importorskip("mypy.api", reason="mypy is in the test extra")
    config = ROOT / "mypy.ini"
    monkeypatch.chdir(ROOT)  # the config's `files` are relative to the working directory
    stdout, stderr, status = api.run(
        ["--config-file", str(config), "--cache-dir", str(tmp_path / "cache")]
    )
    assert status == 0, stdout + stderr
    assert "Success: no issues found" in stdout
