// Replay of timeline files: parsing, and a player that feeds every run's records to its
// model on one virtual clock, so runs of different strategies stay side by side in time.

// A timeline file (`stepserve simulate --timeline-json`): {"format": "stepserve-timeline",
// "runs": [{name, hello, records}]}. A saved live stream (lines of `data: {...}`, or one
// JSON record per line) works too: each `hello` starts a run.
export function parseTimeline(text) {
  const trimmed = text.trim();
  if (trimmed.startsWith("{")) {
    let whole = null;
    try { whole = JSON.parse(trimmed); } catch { whole = null; }
    if (whole && whole.format === "stepserve-timeline") {
      if (!Array.isArray(whole.runs) || !whole.runs.length) throw new Error("the timeline has no runs");
      return whole.runs.map((r, i) => ({ name: r.name || `run ${i + 1}`, hello: r.hello, records: r.records || [] }));
    }
    if (whole && whole.type !== "hello") throw new Error("not a stepserve timeline (no \"format\": \"stepserve-timeline\")");
  }
  const runs = [];
  for (let line of trimmed.split("\n")) {
    line = line.trim();
    if (line.startsWith("data:")) line = line.slice(5).trim();
    if (!line.startsWith("{")) continue;
    const rec = JSON.parse(line);
    if (rec.type === "hello") runs.push({ name: rec.strategy || rec.source || `run ${runs.length + 1}`, hello: rec, records: [] });
    else if (runs.length) runs[runs.length - 1].records.push(rec);
  }
  if (!runs.length) throw new Error("no hello record found: not a stepserve timeline or record stream");
  return runs;
}

export class Player {
  // runs: [{name, hello, records}]; apply(i, record) feeds run i's model.
  constructor(runs, apply) {
    this.runs = runs.map((r) => ({ ...r, idx: 0 }));
    this.apply = apply;
    this.clock = 0;
    this.playing = true;
    this.duration = Math.max(1e-6, ...runs.map((r) => (r.records.length ? r.records[r.records.length - 1].t : 0)));
    this.setSpeed("auto");
  }

  setSpeed(value) {
    this.speed = value === "auto" ? this.duration / 20 : Number(value);
  }

  get ended() {
    return this.runs.every((r) => r.idx >= r.records.length);
  }

  tick(dtSeconds) {
    if (!this.playing || this.ended) return false;
    this.advanceTo(this.clock + dtSeconds * this.speed);
    if (this.ended) this.playing = false;
    return true;
  }

  advanceTo(t) {
    this.runs.forEach((run, i) => {
      while (run.idx < run.records.length && run.records[run.idx].t <= t) this.apply(i, run.records[run.idx++]);
    });
    this.clock = Math.min(t, this.duration);
  }

  // One step: the clock jumps to the end of the next record of any run.
  stepOnce() {
    this.playing = false;
    let next = Infinity;
    for (const run of this.runs) if (run.idx < run.records.length) next = Math.min(next, run.records[run.idx].t);
    if (next !== Infinity) this.advanceTo(next);
  }

  toEnd() {
    this.advanceTo(Infinity);
    this.playing = false;
  }
}
