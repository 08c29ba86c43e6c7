"""The scheduler and the simulator type-check: `mypy` with the repository's mypy.ini
(strict) reports nothing over the packages it names (`scheduler`, `loadgen/sim`).

mypy runs in a child process: in-process it raises the collector's thresholds for good
(`gc.set_threshold(200_000, ...)`), which other tests of the session would inherit."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_is_clean_over_the_configured_packages(tmp_path: Path) -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is in the test extra (pip install -e '.[test]')")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini"),
         "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
