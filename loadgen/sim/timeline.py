"""Timeline files: every simulated step as a step record (`scheduler.step_records`, the
format the live dashboard streams), for `stepserve simulate --timeline-json FILE` and
`stepserve view FILE`.

The continuous strategy records through `StepRecorder` on the real scheduler; the static
and padding baselines build the same records from their padded batches. Both reserve a
batch's whole padded length up front, so their block map shows each row's reservation
(contiguous blocks) from the batch's first step, and their padding shows as
`padded_tokens` (prompt padding) and `padding` rows (finished rows still computing).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from common.arith import cdiv
from loadgen.workloads import WorkloadRequest
from scheduler.step_records import Record, compact, empty_record, hello

TIMELINE_FORMAT = "stepserve-timeline"


class FixedBatchRecorder:
    """Step records of a static or padding run (`loadgen.sim.strategies`)."""

    def __init__(self, strategy: str, num_blocks: int, block_size: int, batch_size: int) -> None:
        self.block_size = block_size
        self.hello = hello(num_blocks, block_size, None, strategy=strategy, source="simulator",
                           batch_size=batch_size)
        self.num_blocks = num_blocks
        self.records: list[Record] = []

    def step(self, batch: list[WorkloadRequest], k: int, seconds: float, now: float, waiting: int,
             streaming: bool) -> None:
        """Step k of `batch` (0: the padded prefill) ended at `now` after `seconds`."""
        rec = empty_record(len(self.records))
        rec["t"], rec["step_ms"] = round(now, 6), round(seconds * 1e3, 4)
        p, o = max(w.prompt_len for w in batch), max(w.output_len for w in batch)
        per_row = cdiv(p + o, self.block_size)
        if k == 0:
            rec["prefill"] = [[w.request_id, p, 0] for w in batch]
            rec["new"] = [[w.request_id, w.arrival_time, w.prompt_len, 0] for w in batch]
            rec["padded_tokens"] = sum(p - w.prompt_len for w in batch)
            rec["blocks"] = {"tables": {w.request_id: list(range(i * per_row, (i + 1) * per_row))
                                        for i, w in enumerate(batch)}, "shared": [], "cached": []}
        else:
            rec["decode"] = [w.request_id for w in batch if k < w.output_len]
            rec["padding"] = [w.request_id for w in batch if k >= w.output_len]
        self._emitted(rec, batch, k, o, streaming)
        used = min(len(batch) * per_row, self.num_blocks)
        rec["running"], rec["waiting"], rec["kv"] = (
            len(batch),
            waiting,
            [used, 0, self.num_blocks - used],
        )
        self.records.append(rec)

    @staticmethod
    def _emitted(
        rec: Record, batch: list[WorkloadRequest], k: int, o: int, streaming: bool
    ) -> None:
        """Tokens the client sees: each step's (padding), or all at the batch's end (static)."""
        if streaming:
            live = [w for w in batch if k < w.output_len]
            rec["tokens"] = len(live)
            rec["first"] = [w.request_id for w in live] if k == 0 else []
            rec["finished"] = [[w.request_id, "length"] for w in live if k == w.output_len - 1]
        elif k == o - 1:
            rec["tokens"] = sum(w.output_len for w in batch)
            rec["first"] = [w.request_id for w in batch]
            rec["finished"] = [[w.request_id, "length"] for w in batch]


def timeline_run(name: str, run_hello: Record, records: list[Record]) -> dict[str, Any]:
    """One run of a timeline file, its records compacted."""
    return {"name": name, "hello": run_hello, "records": [compact(r) for r in records]}


def write_timeline(
    path: str | Path, runs: list[dict[str, Any]], config: dict[str, Any] | None = None
) -> None:
    """One file with every run, to be played side by side by the dashboard."""
    # JSON has no Infinity (an unbounded request rate): such values are written as text
    cfg = {
        k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
        for k, v in (config or {}).items()
    }
    data = {"format": TIMELINE_FORMAT, "version": 1, "config": cfg, "runs": runs}
    Path(path).write_text(json.dumps(data, separators=(",", ":"), default=str, allow_nan=False))


def read_timeline(path: str | Path) -> dict[str, Any]:
    """Load and check a timeline file; ValueError says what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read a timeline ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != TIMELINE_FORMAT or not data.get("runs"):
        raise ValueError(
            f"{path}: not a stepserve timeline (write one with stepserve simulate --timeline-json)"
        )
    return data
