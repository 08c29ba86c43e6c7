"""The dashboard in a real browser: headless Debian Chromium driven by Playwright (the
system browser; no browser download). Against a live `stepserve serve` on a tiny random
Llama model with a KV pool so small that requests preempt each other, behind an API key:
log in, watch >= 20 live steps and a preemption, then replay simulator timelines (uploaded,
and served by `stepserve view`) to their end. No JavaScript error may be logged, and the
screenshot must not be blank."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tiny_models import make_tiny_hf_model

from loadgen.sim.cli import main as simulate_main

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
INSTALL = ("headless Chromium is needed for the dashboard's browser tests: on Debian/Ubuntu run "
           "`apt-get install -y chromium` (.ci/run does this in CI) and `pip install -e '.[test]'` "
           "for Playwright (it drives the system browser; never `playwright install`)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "dashboard-test-key"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip(INSTALL)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(INSTALL)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[tuple[Any, list[str]]]:
    """A fresh page and the JavaScript errors it logs (console errors and uncaught ones)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    yield pg, errors
    context.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A tiny random Llama (2 layers, hidden 64) with the default model's tokenizer."""
    target = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_hf_model(vocab_size=len(tokenizer)).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def timeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "worked-example.json"
    assert simulate_main(["--scenario", "worked-example", "--strategy", "all", "--batch-size", "8",
                          "--timeline-json", str(path)]) == 0
    return path


def assert_not_blank(png: Path) -> None:
    from PIL import Image, ImageStat

    with Image.open(png) as img:
        rgb = img.convert("RGB")
        assert max(ImageStat.Stat(rgb).stddev) > 20, "the screenshot is (nearly) one colour"
        assert len(rgb.getcolors(1 << 20) or []) > 100, "the screenshot has almost no colours"


def panels(pg: Any) -> list[dict[str, str]]:
    return pg.evaluate("[...document.querySelectorAll('.run')].map((e) => ({...e.dataset}))")


def _stream(base_url: str, i: int) -> int:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    stream = client.completions.create(model="tiny", prompt=f"request {i}: tell me a long story about KV blocks",
                                       max_tokens=90, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    return usage[-1].completion_tokens


def test_live_dashboard_shows_steps_and_a_forced_preemption(
        page: Any, tiny_model: Path, timeline: Path, start_server: Any, tmp_path: Path) -> None:
    pg, errors = page
    # 96 KiB of KV = 12 blocks of 16 tokens: six 100-token requests cannot all fit
    server = start_server(tmp_path, "--model", str(tiny_model), "--served-model-name", "tiny",
                          "--kv-cache-memory", "96KiB", "--api-key", KEY, "--max-num-seqs", "8")
    first = pg.goto(server.url + "/dashboard")
    assert first.status == 401  # the login form; Chromium logs the 401 status, nothing else
    assert len(errors) == 1 and "status of 401" in errors[0], errors
    errors.clear()
    pg.fill("#key", KEY)
    pg.click("#login")
    pg.wait_for_selector("body[data-status='live']", timeout=30_000)
    with ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(_stream, server.url, i) for i in range(6)]
        pg.wait_for_function("() => { const r = document.querySelector('.run');"
                             " return r && +r.dataset.steps >= 20 && +r.dataset.preemptions >= 1; }", timeout=240_000)
        shot = tmp_path / "dashboard-live.png"
        pg.screenshot(path=str(shot), full_page=True)
        pg.select_option("#window", "30")
        pg.wait_for_function("() => +document.querySelector('.run').dataset.steps >= 110"
                             " || +document.querySelector('.run').dataset.finished >= 4", timeout=240_000)
        busy = tmp_path / "dashboard-live-busy.png"
        pg.locator("body").screenshot(path=str(busy))  # the page's content, no empty viewport below
        assert [j.result() for j in jobs] == [90] * 6
    pg.wait_for_function("() => +document.querySelector('.run').dataset.finished >= 6", timeout=60_000)
    (live,) = panels(pg)
    assert int(live["steps"]) >= 20 and int(live["preemptions"]) >= 1
    # lanes are keyed by the stream's short keys and shown by the requests' ids
    lanes = pg.evaluate("(() => { const m = window.stepserveDashboard.panels[0].model;"
                        " return [...m.lanes.keys()].map((k) => [k, m.nameOf(k)]); })()")
    assert len(lanes) == 6 and all(len(k) < 4 and name.startswith("cmpl-") for k, name in lanes), lanes
    assert_not_blank(shot)
    assert_not_blank(busy)
    _save_for_docs(busy)
    # the same page replays an uploaded timeline
    pg.set_input_files("#file", str(timeline))
    pg.select_option("#speed", "10")
    pg.wait_for_selector("body[data-ended='true']", timeout=60_000)
    assert [(p["steps"], p["finished"]) for p in panels(pg)] == _expected(timeline)
    assert errors == [] and pg.evaluate("window.stepserveDashboard.errors") == []


def test_stepserve_view_replays_a_timeline_to_its_end(page: Any, timeline: Path, tmp_path: Path) -> None:
    pg, errors = page
    port = free_port()
    log = (tmp_path / "view.log").open("wb")
    view = subprocess.Popen([sys.executable, "-m", "service.cli", "view", str(timeline), "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_listening(port, view)
        pg.goto(f"http://127.0.0.1:{port}/")
        pg.wait_for_function("() => document.querySelectorAll('.run').length === 3", timeout=30_000)
        pg.click("#play")  # pause, then walk one step at a time
        pg.wait_for_timeout(100)  # the frame that draws the paused state
        paused = _total_steps(pg)
        pg.wait_for_timeout(300)
        assert _total_steps(pg) == paused
        for _ in range(3):
            before = _total_steps(pg)
            pg.click("#step")
            pg.wait_for_function(f"() => {TOTAL_STEPS_JS} > {before}", timeout=10_000)
            assert _total_steps(pg) <= before + 3  # the next record of each run at most
        pg.select_option("#speed", "10")
        pg.click("#play")
        pg.wait_for_selector("body[data-ended='true']", timeout=60_000)
        assert [(p["steps"], p["finished"]) for p in panels(pg)] == _expected(timeline)
        assert int(panels(pg)[0]["preemptions"]) == 4  # the worked example's four
        shot = tmp_path / "dashboard-replay.png"
        pg.screenshot(path=str(shot), full_page=True)
        assert_not_blank(shot)
        assert errors == []
    finally:
        view.terminate()
        view.wait(30)


TOTAL_STEPS_JS = "[...document.querySelectorAll('.run')].reduce((a, e) => a + +e.dataset.steps, 0)"


def _total_steps(pg: Any) -> int:
    return int(pg.evaluate(f"() => {TOTAL_STEPS_JS}"))


def _expected(timeline: Path) -> list[tuple[str, str]]:
    import json

    runs = json.loads(timeline.read_text())["runs"]
    return [(str(len(r["records"])), "5") for r in runs]


def _wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    import socket

    for _ in range(200):
        assert proc.poll() is None, "stepserve view exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError("stepserve view did not listen")


def _save_for_docs(shot: Path) -> None:
    """STEPSERVE_DOCS_SCREENSHOT=path copies the live screenshot there (README's picture)."""
    import os

    target = os.environ.get("STEPSERVE_DOCS_SCREENSHOT")
    if target:
        shutil.copyfile(shot, target)


LOST_MARK_PIXELS_JS = """() => {
  const d = window.stepserveDashboard, p = d.panels[0], c = p.lanes, ctx = c.getContext("2d");
  const dpr = window.devicePixelRatio || 1, t1 = Math.max(d.player.clock, 1e-6), w = c.clientWidth;
  const out = [];
  p.laneList.forEach((lane, i) => {
    for (const m of lane.lost) {
      const x = (m.t / t1) * (w - 4), y = i * 11 + 2 + 1;  // views.js: LANE_H 11, the mark's middle
      out.push([lane.id, m.objective, Array.from(ctx.getImageData(Math.round(x * dpr), Math.round(y * dpr), 1, 1).data)]);
    }
  });
  return out;
}"""


def test_replay_marks_slack_and_lost_deadlines(page: Any, tmp_path: Path) -> None:
    """A run whose requests have objectives (tests/support/slo_records.py): the page shows
    the legend, counts both lost deadlines and draws each one's mark on its lane."""
    from slo_records import slo_run

    from loadgen.sim.timeline import timeline_run, write_timeline

    _, hello, records = slo_run()
    timeline = tmp_path / "slo.json"
    write_timeline(timeline, [timeline_run("continuous", hello, records)])
    pg, errors = page
    port = free_port()
    log = (tmp_path / "view.log").open("wb")
    view = subprocess.Popen([sys.executable, "-m", "service.cli", "view", str(timeline), "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_listening(port, view)
        pg.goto(f"http://127.0.0.1:{port}/")
        pg.wait_for_function("() => document.querySelectorAll('.run').length === 1", timeout=30_000)
        pg.click("#end")
        pg.wait_for_selector("body[data-ended='true']", timeout=30_000)
        pg.wait_for_timeout(200)  # the frame that draws the end
        (panel,) = panels(pg)
        assert panel["lost"] == "2" and panel["finished"] == "4"
        assert pg.is_visible(".slo-legend") and "deadlines lost: TTFT 1, TPOT 1" in pg.inner_text(".run-stats")
        marks = pg.evaluate(LOST_MARK_PIXELS_JS)
        assert [(rid, objective) for rid, objective, _ in marks] == [("R1", "tpot"), ("R2", "ttft")]
        for rid, _, (r, g, b, a) in marks:  # COLORS.lost, #7a0019
            assert abs(r - 0x7a) < 40 and g < 40 and b < 60 and a > 200, (rid, r, g, b, a)
        shot = tmp_path / "dashboard-slo.png"
        pg.screenshot(path=str(shot), full_page=True)
        assert_not_blank(shot)
        assert errors == [] and pg.evaluate("window.stepserveDashboard.errors") == []
    finally:
        view.terminate()
        view.wait(30)
