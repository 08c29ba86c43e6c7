"""The benchmark scripts as modules of the `bench` package: each imports as `bench.NAME` with
no change to `sys.path`, answers `--help`, and the child processes the scripts start run as
`python -m bench.NAME ...` from the repository root (the scripts' numbers are theirs, not
the tests')."""

from __future__ import annotations

import importlib
import json
import subprocess

import pytest

from bench.servers import ROOT, bench_module_cmd

SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")


def test_the_scripts_are_listed() -> None:
    assert {"servers", "vs_llamacpp", "threads", "gather_workspace", "fidelity"} <= set(SCRIPTS)
    readme = (ROOT / "bench" / "README.md").read_text()
    for name in SCRIPTS:
        if name != "servers":  # the shared module, not a benchmark
            assert f"`python -m bench.{name}" in readme, name


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_is_a_module_without_path_tricks(name: str) -> None:
    source = (ROOT / "bench" / f"{name}.py").read_text()
    assert "sys.path" not in source and "__file__," not in source
    module = importlib.import_module(f"bench.{name}")
    if name == "servers":
        return
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0


def test_gather_workspace_runs_its_variants_as_child_modules(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench import gather_workspace

    args = ["--batch", "2", "--context", "16", "--steps", "2", "--threads", "1"]
    assert gather_workspace.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["results"]) == {"fresh", "workspace"}
    assert all(r["first_step_ms"] > 0 and r["median_step_ms"] > 0 for r in out["results"].values())


def test_dashboard_viewers_process_runs_as_a_module() -> None:
    """With no viewers the process connects nowhere and reports nothing received."""
    done = subprocess.run(
        bench_module_cmd("dashboard_cost", "--viewers-process", "http://127.0.0.1:9", "0", "0"),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"bytes": 0, "events": 0}


def test_threads_child_takes_one_combination(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import threads

    with pytest.raises(SystemExit) as exc:
        threads.main(["--child", "--threads", "1", "2"])
    assert exc.value.code == 2
    assert "--child takes one --threads value" in capsys.readouterr().err


@pytest.mark.slow
def test_threads_times_a_combination_in_a_child_module() -> None:
    """One combination end to end: `python -m bench.threads --child` on the default model
    (eager), no busy neighbour."""
    from bench import threads

    row = threads.measure(1, "default", neighbour=False, eager=True, helper="normal")
    assert "error" not in row, row
    for batch in threads.DECODE_BATCHES:
        assert row[f"batch_{batch}_ms"] > 0
        assert row[f"batch_{batch}_max_ms"] >= row[f"batch_{batch}_ms"]



def test_router_benchmark_measures_both_arms_at_toy_size(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench.router` end to end at toy size: every token streams on both arms (the script
    raises otherwise) and the ratios are router over direct."""
    from bench import router

    if router.smg_executable() is None:
        pytest.skip("smg is not installed (the test extra installs it)")
    assert router.main(["--concurrency", "4", "--tokens", "8", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["smg_version"] != "unknown"
    for arm in ("direct", "router"):
        assert out[arm]["tokens_per_s"] > 0 and out[arm]["ttft_ms_p50"] > 0
    ratio = out["ratio_router_over_direct"]["tokens_per_s"]
    assert ratio == round(out["router"]["tokens_per_s"] / out["direct"]["tokens_per_s"], 3)
