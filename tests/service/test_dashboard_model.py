"""The dashboard's model of a run (service/http/dashboard/model.js) under Node, without a
browser: it reads records of a run whose requests have objectives and must put each
request's objectives, slack and lost deadlines on its lane. (The browser test draws them.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from slo_records import slo_run

from scheduler.step_records import compact

DASHBOARD = Path(__file__).resolve().parents[2] / "service/http/dashboard"
NODE = shutil.which("node")

# Feeds the records to a RunModel and prints what its lanes hold (model.js and views.js are
# ES modules: copied next to a package.json that says so).
SCRIPT = """
import { readFileSync } from "node:fs";
import { RunModel, slackRatio } from "./model.js";
import { slackColor } from "./views.js";
const { hello, records } = JSON.parse(readFileSync(0, "utf8"));
const m = new RunModel("run", hello);
const pending = [];
for (const rec of records) {
  m.apply(rec);
  pending.push([...m.pendingLost.keys()]);
}
const lanes = Object.fromEntries([...m.lanes.values()].map((l) => [l.id, {
  slo: l.slo, lost: l.lost, slack: l.slack, phase: l.slackPhase, ratio: slackRatio(l), points: l.slackPts.length,
  name: m.nameOf(l.id) }]));
console.log(JSON.stringify({ lanes, lost: m.lost, hasSLO: m.hasSLO, marks: m.lostMarks, pending,
  colors: [slackColor(1), slackColor(0), slackColor(-0.5)] }));
"""


def run_model(tmp_path: Path, hello: dict[str, Any], records: list[dict[str, Any]]) -> Any:
    if NODE is None:
        pytest.skip("node is not installed")
    for name in ("model.js", "views.js"):
        shutil.copy(DASHBOARD / name, tmp_path / name)
    (tmp_path / "package.json").write_text('{"type": "module"}')
    (tmp_path / "check.js").write_text(SCRIPT)
    done = subprocess.run([NODE, "check.js"], cwd=tmp_path, input=json.dumps({"hello": hello, "records": records}),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_lanes_carry_objectives_slack_and_lost_deadlines(tmp_path: Path) -> None:
    _, hello, records = slo_run()
    out = run_model(tmp_path, hello, [compact(r) for r in records])
    lanes = out["lanes"]
    assert lanes["R1"]["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 800.0, "class": "request"}
    assert lanes["R1"]["lost"] == [{"t": 1.3, "objective": "tpot"}]
    assert (lanes["R1"]["slack"], lanes["R1"]["phase"], lanes["R1"]["ratio"]) == (400, "tpot", 0.5)
    # R2 lost its TTFT at step 2, before it had a lane: the mark waited for its admission
    assert out["pending"][2] == ["R2"] and out["pending"][4] == []
    assert lanes["R2"]["lost"] == [{"t": 2.0, "objective": "ttft"}] and lanes["R2"]["slack"] is None
    assert lanes["R3"]["slo"] is None and lanes["R3"]["lost"] == [] and lanes["R3"]["points"] == 0
    assert lanes["R4"]["lost"] == [] and lanes["R4"]["ratio"] == 1
    assert out["lost"] == {"ttft": 1, "tpot": 1} and out["hasSLO"] is True
    assert [(m["id"], m["t"]) for m in out["marks"]] == [("R1", 1.3), ("R2", 2.0)]
    assert out["colors"] == ["hsl(120 75% 42%)", "hsl(0 75% 42%)", "#7a0019"]


def test_live_keys_gaps_and_a_viewer_joining_late(tmp_path: Path) -> None:
    """Live records: objectives from the hello's state and from `new` entries, a `lost`
    entry that names a waiting request with its id first, and a gap that carries one."""
    hello = {"type": "hello", "num_blocks": 8, "block_size": 4, "token_budget": 64,
             "state": {"running": 1, "waiting": 0, "swapped": 0, "kv": [1, 0, 7],
                       "requests": [["0", "cmpl-early", {"tpot_ms": 100.0, "class": "default"}]]}}
    records = [
        {"type": "step", "step": 5, "t": 1.0, "decode": ["0"], "slack": [["0", 50]]},
        {"type": "step", "step": 6, "t": 1.1, "decode": ["0"], "lost": [["1", "ttft", 1.05, "cmpl-late"]]},
        {"type": "gap", "from_step": 7, "to_step": 9, "steps": 3, "t0": 1.1, "t": 1.4, "tokens": 3,
         "truncated": False, "running": 1, "waiting": 1, "swapped": 0, "kv": [2, 0, 6],
         "new": [], "first": [], "finished": [], "preempted": [], "aborted": [], "resumed": [], "swapped_in": [],
         "lost": [["0", "tpot", 1.2]]},
        {"type": "step", "step": 10, "t": 1.5, "prefill": [["1", 6, 0]],
         "new": [["1", 0.2, 6, 0, "cmpl-late", {"ttft_ms": 850.0, "class": "default"}]], "first": ["1"]},
    ]
    out = run_model(tmp_path, hello, records)
    early, late = out["lanes"]["0"], out["lanes"]["1"]
    assert early["name"] == "cmpl-early" and early["slo"] == {"tpot_ms": 100.0, "class": "default"}
    assert early["lost"] == [{"t": 1.2, "objective": "tpot"}] and early["ratio"] == 0.5
    assert late["name"] == "cmpl-late" and late["slo"]["ttft_ms"] == 850.0
    assert late["lost"] == [{"t": 1.05, "objective": "ttft"}]
    assert out["lost"] == {"ttft": 1, "tpot": 1}
