"""Timeline files (`stepserve simulate --timeline-json`): the same step records the live view
streams, for the continuous scheduler and the static/padding baselines, and `stepserve view`
serving them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from record_schema import check_step

from loadgen.sim.cli import main as simulate_main
from loadgen.sim.scenarios import parse_with_scenario
from loadgen.sim.setup import add_run_args
from service.cli.view import TIMELINE_PATH, create_view_app
from service.cli.view import main as view_main


@pytest.fixture(scope="module")
def worked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The worked example under all three strategies: the timeline file and the summaries."""
    tmp = tmp_path_factory.mktemp("timeline")
    path, result = tmp / "worked.json", tmp / "result.json"
    assert simulate_main(["--scenario", "worked-example", "--strategy", "all", "--batch-size", "8",
                          "--timeline-json", str(path), "--result-json", str(result)]) == 0
    return path, json.loads(path.read_text()), json.loads(result.read_text())["summaries"]


def _runs(data: dict[str, Any]) -> dict[str, Any]:
    return {r["name"]: r for r in data["runs"]}


def test_every_strategy_writes_well_formed_records(worked: Any) -> None:
    _, data, summaries = worked
    assert data["format"] == "stepserve-timeline" and data["config"]["num_gpu_blocks"] == 6
    runs = _runs(data)
    assert list(runs) == ["continuous", "static", "padding"]
    for name, run in runs.items():
        hello = run["hello"]
        assert hello["type"] == "hello" and hello["strategy"] == name and hello["num_blocks"] == 6
        records = [check_step(r, 6) for r in run["records"]]
        assert len(records) == summaries[name]["num_steps"]
        assert [r["t"] for r in records] == sorted(r["t"] for r in records)
        assert records[-1]["t"] == pytest.approx(summaries[name]["duration"], abs=1e-5)
        finished = [f[0] for r in records for f in r["finished"]]
        assert sorted(finished) == ["R1", "R2", "R3", "R4", "R5"]
        assert sum(r["tokens"] for r in records) == 32 + 8 + 16 + 64 + 8


def test_continuous_timeline_shows_the_worked_examples_preemptions(worked: Any) -> None:
    records = [check_step(r, 6) for r in _runs(worked[1])["continuous"]["records"]]
    preempted = [p for r in records for p in r["preempted"]]
    assert len(preempted) == 4 == worked[2]["continuous"]["num_preemptions"]
    assert preempted[0] == ["R4", "kv", "recompute", "R3"]
    assert all(p[1:3] == ["kv", "recompute"] for p in preempted)
    assert max(r["kv"][0] for r in records) == 6 and records[-1]["kv"] == [0, 0, 6]


def test_baselines_reserve_padded_rows_and_show_their_padding(worked: Any) -> None:
    runs = _runs(worked[1])
    for name in ("static", "padding"):
        records = [check_step(r, 6) for r in runs[name]["records"]]
        starts = [r for r in records if r["new"]]
        for r in starts:  # each row reserves its padded length in contiguous blocks
            tables = list(r["blocks"]["tables"].values())
            assert all(t == list(range(t[0], t[0] + len(t))) for t in tables)
            assert r["padded_tokens"] == sum(r["prefill"][0][1] - n[2] for n in r["new"])
        assert any(r["padding"] for r in records)  # finished rows still computing
    static = [check_step(r, 6) for r in runs["static"]["records"]]
    for r in static:  # answered only when the batch ends
        assert sorted(r["first"]) == sorted(f[0] for f in r["finished"])


def test_scenario_sets_defaults_that_flags_override() -> None:
    import argparse

    from loadgen.sim.scenarios import add_scenario_arg

    def parse(argv: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_run_args(parser)
        add_scenario_arg(parser)
        return parse_with_scenario(parser, argv)

    thrash = parse(["--scenario", "thrash"])
    assert (thrash.num_gpu_blocks, thrash.num_prompts, thrash.seed, str(thrash.prompt_len)) == (200, 100, 42, str(parse(["--prompt-len", "uniform:50:2000"]).prompt_len))
    assert parse(["--scenario", "thrash", "--num-gpu-blocks", "300"]).num_gpu_blocks == 300
    assert parse([]).num_gpu_blocks == 1024


async def test_view_serves_the_page_and_the_file(worked: Any) -> None:
    path = worked[0]
    client = TestClient(TestServer(create_view_app(path)))
    await client.start_server()
    try:
        root = await client.get("/", allow_redirects=False)
        assert root.status == 302 and root.headers["Location"] == f"/dashboard?timeline={TIMELINE_PATH}"
        page = await client.get("/dashboard")
        assert page.status == 200 and "main.js" in await page.text()
        assert (await client.get("/dashboard/static/player.js")).status == 200
        timeline = await client.get(TIMELINE_PATH)
        assert json.loads(await timeline.read()) == worked[1]
        assert (await client.get("/dashboard/stream")).status == 404  # nothing live here
    finally:
        await client.close()


def test_view_rejects_a_file_that_is_no_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    assert view_main([str(bad)]) == 2
    assert "not a stepserve timeline" in capsys.readouterr().err
    assert view_main([str(tmp_path / "missing.json")]) == 2
