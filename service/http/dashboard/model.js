// The state of one run (the live server, or one run of a timeline file), rebuilt from its
// records: `hello` once, then `step` records and, live, `gap` records for steps a slow
// viewer missed. The record format is documented in docs/step_records.md. Records name
// requests by keys (live: short keys; the request ids come with `new` entries and the hello's
// `state.requests`); `nameOf` gives the id to show. Requests with objectives (TTFT / TPOT)
// bring them with the same entries; `slack` and `lost` mark how their deadlines stand.

// Every key of a step record with its empty value (scheduler/step_records.py:empty_record);
// a record may leave out the keys that hold these.
export const EMPTY_STEP = {
  type: "step", step: 0, t: 0, step_ms: null, execute_ms: null, predicted_ms: null,
  decode: [], prefill: [], padding: [], padded_tokens: 0, new: [], resumed: [], swapped_in: [],
  preempted: [], aborted: [], tokens: 0, first: [], finished: [], swap_out: 0, swap_in: 0,
  running: 0, waiting: 0, swapped: 0, waiting_for_grammar: 0, kv: [0, 0, 0], blocks: null,
  slack: [], lost: [],
};

const MAX_HISTORY = 20000; // queue-chart points kept
const MAX_LANES = 600; // request lanes kept (the oldest finished ones go first)
const MAX_SLACK_POINTS = 500; // slack changes kept per lane
const MAX_PENDING = 2000; // lost deadlines kept for requests with no lane yet (still waiting)

// A request's slack as a share of the objective it is measured against (1: all of it to
// spare, 0: none, below 0: overdue); null where the lane has no slack listed.
export function slackRatio(lane) {
  if (lane.slack === null) return null;
  const slo = lane.slo || {};
  const objective = lane.slackPhase === "ttft" ? slo.ttft_ms : slo.tpot_ms;
  if (!objective) return lane.slack >= 0 ? 1 : -1;
  return Math.max(-1, Math.min(1, lane.slack / objective));
}

export class RunModel {
  constructor(name, hello) {
    this.name = name;
    this.hello = hello;
    this.numBlocks = hello.num_blocks;
    this.steps = 0; // step records applied
    this.gapSteps = 0; // steps only known through gaps
    this.preemptions = 0;
    this.tokens = 0;
    this.finished = 0;
    this.truncated = false;
    this.history = []; // {t, running, waiting, swapped, kvUsed, preempted}
    this.preemptMarks = []; // {t, victim, reason, mode, by}
    this.lostMarks = []; // {t: when it fell due, id, objective: "ttft" | "tpot"}
    this.lost = { ttft: 0, tpot: 0 }; // deadlines lost, by objective
    this.hasSLO = false; // some request has objectives: show slack and the legend
    this.slos = new Map(); // request key -> objectives, until its lane exists
    this.pendingLost = new Map(); // request key -> [lost marks], until its lane exists
    this.lanes = new Map(); // request key -> lane
    this.names = new Map(); // request key -> request id, where they differ
    this.last = null; // the last step record
    this.lastBatch = null; // the last step record that computed something
    this.blocks = null; // {owners: Array(num blocks) of [ids], cached: Set, shared: Map}
    this.now = 0;
    const s = hello.state;
    if (s) this.counts = { running: s.running, waiting: s.waiting, swapped: s.swapped, kv: s.kv };
    else this.counts = { running: 0, waiting: 0, swapped: 0, kv: [0, 0, hello.num_blocks] };
    if (s && s.requests) {
      for (const [key, id, slo] of s.requests) {
        this.names.set(key, id);
        if (slo) { this.slos.set(key, slo); this.hasSLO = true; }
      }
    }
    if (s && s.blocks) this.applyBlocks(s.blocks);
  }

  nameOf(key) {
    return this.names.get(key) ?? key;
  }

  // A `new` entry: [key, arrival, prompt tokens, cached tokens], then, live, the request's id
  // (a string), then its objectives when it has any ({ttft_ms, tpot_ms, class}).
  admit([id, arrival, prompt, cached, ...rest], t) {
    for (const x of rest) {
      if (typeof x === "string") this.names.set(id, x);
      else if (x && typeof x === "object") { this.slos.set(id, x); this.hasSLO = true; }
    }
    const lane = this.lane(id, arrival ?? t);
    lane.arrival = arrival ?? t; lane.since = lane.arrival; lane.prompt = prompt; lane.cached = cached;
    if (this.slos.has(id)) { lane.slo = this.slos.get(id); this.slos.delete(id); }
  }

  apply(rec) {
    if (rec.type === "step") this.applyStep({ ...EMPTY_STEP, ...rec });
    else if (rec.type === "gap") this.applyGap(rec);
  }

  lane(id, t) {
    let lane = this.lanes.get(id);
    if (!lane) {
      lane = { id, arrival: t, prompt: null, cached: 0, segments: [], state: "waiting", since: t,
               firstToken: null, finish: null, reason: null, preemptions: 0, outputs: 0,
               decoded: false, slo: this.slos.get(id) ?? null, slack: null, slackPhase: null, slackPts: [],
               lost: this.pendingLost.get(id) ?? [] };
      this.slos.delete(id); this.pendingLost.delete(id);
      this.lanes.set(id, lane);
      this.pruneLanes();
    }
    return lane;
  }

  pruneLanes() {
    if (this.lanes.size <= MAX_LANES) return;
    for (const [id, lane] of this.lanes) {
      if (lane.finish !== null) {
        this.lanes.delete(id); this.names.delete(id);
        if (this.lanes.size <= MAX_LANES) return;
      }
    }
  }

  // A lane's open interval (waiting, preempted, swapped) ends where it runs again.
  closeWait(lane, t) {
    if (lane.state !== "running" && lane.since !== null && t > lane.since) {
      lane.segments.push({ t0: lane.since, t1: t, kind: lane.state });
    }
    lane.state = "running";
    lane.since = null;
  }

  addSegment(lane, t0, t1, kind, n) {
    const segs = lane.segments;
    const prev = segs[segs.length - 1];
    // decode steps merge into one run; every prefill chunk stays its own segment
    if (kind === "decode" && prev && prev.kind === "decode" && t0 - prev.t1 < (t1 - t0) * 4 + 1e-9) prev.t1 = t1;
    else segs.push({ t0, t1, kind, n });
  }

  applyStep(rec) {
    const t1 = rec.t;
    const t0 = rec.step_ms != null ? Math.max(0, t1 - rec.step_ms / 1000) : (this.last ? this.last.t : t1);
    this.steps += 1;
    this.now = t1;
    for (const entry of rec.new) this.admit(entry, t0);
    for (const [id, n] of rec.prefill) {
      const lane = this.lane(id, t0); this.closeWait(lane, t0); this.addSegment(lane, t0, t1, "prefill", n);
    }
    for (const id of rec.decode) {
      const lane = this.lane(id, t0); this.closeWait(lane, t0); this.addSegment(lane, t0, t1, "decode", 1);
      lane.decoded = true;
    }
    for (const id of rec.padding) {
      const lane = this.lanes.get(id); if (lane) this.addSegment(lane, t0, t1, "padding", 1);
    }
    this.lifecycle(rec, t0, t1);
    for (const [id, ms] of rec.slack) { const lane = this.lanes.get(id); if (lane) this.setSlack(lane, t1, ms); }
    this.counts = { running: rec.running, waiting: rec.waiting, swapped: rec.swapped, kv: rec.kv,
                    grammar: rec.waiting_for_grammar };
    this.tokens += rec.tokens;
    if (rec.blocks) this.applyBlocks(rec.blocks);
    this.pushHistory(t1, rec.preempted.length);
    this.last = rec;
    if (rec.prefill.length || rec.decode.length || rec.padding.length) this.lastBatch = rec;
  }

  // A `slack` entry: ms to spare at t, against TTFT until the first token (a lane that
  // decoded is past it, though a viewer that joined late never saw it), then TPOT.
  setSlack(lane, t, ms) {
    const slo = lane.slo || {}, before = lane.firstToken === null && !lane.decoded;
    lane.slack = ms; lane.slackPhase = slo.ttft_ms && (before || !slo.tpot_ms) ? "ttft" : "tpot";
    lane.slackPts.push({ t, ratio: slackRatio(lane) });
    if (lane.slackPts.length > MAX_SLACK_POINTS) lane.slackPts.splice(0, lane.slackPts.length - MAX_SLACK_POINTS);
    this.hasSLO = true;
  }

  // A `lost` entry: [key, "ttft" | "tpot", when it fell due] and, live, the request's id
  // when the entry names it first (it may still wait: its lane comes with its admission).
  loseDeadline([id, objective, due, name]) {
    if (name !== undefined) this.names.set(id, name);
    const mark = { t: due, objective };
    this.lost[objective] = (this.lost[objective] || 0) + 1;
    this.lostMarks.push({ t: due, id, objective });
    this.hasSLO = true;
    const lane = this.lanes.get(id);
    if (lane) { lane.lost.push(mark); return; }
    const pending = this.pendingLost.get(id);
    if (pending) { pending.push(mark); return; }
    this.pendingLost.set(id, [mark]);
    if (this.pendingLost.size > MAX_PENDING) { // requests that left before admission
      const [oldest] = this.pendingLost.keys();
      this.pendingLost.delete(oldest); this.names.delete(oldest);
    }
  }

  // What survives a gap too: preemptions, first tokens, finishes, aborts, lost deadlines.
  lifecycle(rec, t0, t1) {
    for (const [victim, reason, mode, by] of rec.preempted) {
      const lane = this.lane(victim, t0);
      lane.preemptions += 1; lane.state = mode === "swap" ? "swapped" : "preempted"; lane.since = t0;
      this.preemptions += 1;
      this.preemptMarks.push({ t: t0, victim, reason, mode, by });
    }
    for (const id of rec.first) { const lane = this.lanes.get(id); if (lane && lane.firstToken === null) lane.firstToken = t1; }
    for (const [id, reason] of rec.finished) this.finish(id, t1, reason);
    for (const id of rec.aborted) this.finish(id, t0, "abort");
    for (const entry of rec.lost || []) this.loseDeadline(entry);
  }

  finish(id, t, reason) {
    const lane = this.lanes.get(id);
    if (!lane || lane.finish !== null) return;
    if (lane.state !== "running" && lane.since !== null && t > lane.since) lane.segments.push({ t0: lane.since, t1: t, kind: lane.state });
    lane.finish = t; lane.reason = reason; lane.state = "finished"; lane.since = null;
    this.finished += 1;
  }

  applyGap(gap) {
    this.gapSteps += gap.steps;
    this.now = gap.t;
    if (gap.truncated) this.truncated = true;
    for (const entry of gap.new) this.admit(entry, gap.t0);
    for (const id of [...gap.resumed, ...gap.swapped_in]) { const lane = this.lanes.get(id); if (lane) this.closeWait(lane, gap.t); }
    this.lifecycle(gap, gap.t0, gap.t);
    this.counts = { running: gap.running, waiting: gap.waiting, swapped: gap.swapped, kv: gap.kv };
    this.tokens += gap.tokens;
    this.pushHistory(gap.t, gap.preempted.length);
  }

  pushHistory(t, preempted) {
    const c = this.counts;
    this.history.push({ t, running: c.running, waiting: c.waiting, swapped: c.swapped, kvUsed: c.kv[0], preempted });
    if (this.history.length > MAX_HISTORY) this.history.splice(0, this.history.length - MAX_HISTORY);
    if (this.preemptMarks.length > MAX_HISTORY) this.preemptMarks.splice(0, this.preemptMarks.length - MAX_HISTORY);
    if (this.lostMarks.length > MAX_HISTORY) this.lostMarks.splice(0, this.lostMarks.length - MAX_HISTORY);
  }

  applyBlocks(map) {
    const owners = new Array(this.numBlocks).fill(null);
    for (const [id, table] of Object.entries(map.tables)) {
      for (const b of table) { if (owners[b]) owners[b].push(id); else owners[b] = [id]; }
    }
    this.blocks = { owners, cached: new Set(map.cached), shared: new Map(map.shared) };
  }
}
