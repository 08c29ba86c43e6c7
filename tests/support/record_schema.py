"""The step-record format (docs/step_records.md) as a checker, applied to live records and to
simulator timelines alike, so the two can never drift apart."""

from __future__ import annotations

from typing import Any

from scheduler.step_records import empty_record

STEP_KEYS = set(empty_record(0))
PREEMPT_REASONS = {"kv", "priority"}
PREEMPT_MODES = {"recompute", "swap"}
OBJECTIVES = {"ttft", "tpot"}


def full(rec: dict[str, Any]) -> dict[str, Any]:
    """A possibly compacted record with its left-out keys filled back in."""
    return {**empty_record(rec.get("step", 0)), **rec}


def check_step(rec: dict[str, Any], num_blocks: int) -> dict[str, Any]:
    """Assert `rec` is a well-formed step record; returns it with every key present."""
    assert set(rec) <= STEP_KEYS, f"unknown keys {set(rec) - STEP_KEYS}"
    r = full(rec)
    assert r["type"] == "step" and isinstance(r["step"], int) and r["t"] >= 0
    assert all(isinstance(i, str) for i in r["decode"] + r["padding"] + r["first"] + r["aborted"])
    for rid, n, ctx in r["prefill"]:
        assert isinstance(rid, str) and n >= 1 and ctx >= 0
    for rid, arrival, prompt, cached, *rest in r["new"]:
        assert isinstance(rid, str) and arrival is not None and prompt >= 1 and 0 <= cached < prompt
        if rest and isinstance(rest[-1], dict):  # the request's objectives, last
            check_objectives(rest.pop())
        assert rest == [] or (len(rest) == 1 and isinstance(rest[0], str) and rest[0] != rid)
    for rid, ms in r["slack"]:
        assert isinstance(rid, str) and isinstance(ms, int)
    for rid, objective, due, *name in r["lost"]:
        assert isinstance(rid, str) and objective in OBJECTIVES and 0 <= due <= r["t"]
        assert name == [] or (len(name) == 1 and isinstance(name[0], str) and name[0] != rid)
    for victim, reason, mode, by in r["preempted"]:
        assert isinstance(victim, str) and reason in PREEMPT_REASONS and mode in PREEMPT_MODES and isinstance(by, str)
    for rid, reason in r["finished"]:
        assert isinstance(rid, str) and reason in {"stop", "length", "abort"}
    used, cached, free = r["kv"]
    assert used + cached + free == num_blocks and min(used, cached, free) >= 0
    assert r["tokens"] >= len(r["first"])
    if r["blocks"] is not None:
        check_block_map(r["blocks"], num_blocks, used, cached)
    return r


def check_objectives(o: dict[str, Any]) -> None:
    """A request's objectives as records carry them: at least one, in ms, and the class."""
    assert set(o) <= {"ttft_ms", "tpot_ms", "class"} and isinstance(o["class"], str)
    assert {"ttft_ms", "tpot_ms"} & set(o) and all(o[k] > 0 for k in o if k != "class")


def check_block_map(m: dict[str, Any], num_blocks: int, used: int, cached: int) -> None:
    held = {b for table in m["tables"].values() for b in table}
    assert all(0 <= b < num_blocks for b in held)
    assert len(held) == used, f"{len(held)} blocks in tables, {used} counted used"
    assert len(m["cached"]) == cached and not held & set(m["cached"])
    holders: dict[int, int] = {}
    for table in m["tables"].values():
        for b in table:
            holders[b] = holders.get(b, 0) + 1
    assert {b: rc for b, rc in m["shared"]} == {b: n for b, n in holders.items() if n > 1}
