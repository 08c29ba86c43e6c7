// Canvas drawings of one RunModel: queues over time, the current batch, the KV block map and
// the request lanes. Each draw function sizes its canvas to its CSS box and redraws it whole.

import { slackRatio } from "./model.js";

export const COLORS = { running: "#2a9d4a", waiting: "#e08a1e", swapped: "#8a4fd0", kv: "#888",
  preempt: "#d62828", prefill: "#3b6fd8", decode: "#f08c2a", padding: "#bbb", free: "#eceef1",
  cached: "#9fb3b8", preempted: "#f3b1b1", swappedLane: "#d9c6f2", wait: "#e4e4e4",
  lost: "#7a0019", deadline: "rgba(122, 0, 25, 0.6)" };

// Slack as a colour: green with all of its objective to spare, through amber, to red with
// none; dark crimson once overdue (the ratio of model.js's slackRatio).
export function slackColor(ratio) {
  if (ratio < 0) return COLORS.lost;
  return `hsl(${Math.round(120 * Math.min(ratio, 1))} 75% 42%)`;
}

export function hue(id) {
  let h = 2166136261;
  for (let i = 0; i < id.length; i++) { h ^= id.charCodeAt(i); h = Math.imul(h, 16777619); }
  return ((h >>> 0) % 360);
}

export const requestColor = (id, light = 50) => `hsl(${hue(id)} 65% ${light}%)`;

function fit(canvas, height) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 600;
  const h = height ?? (canvas.clientHeight || 150);
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w, h };
}

// Live: the last `seconds` (from the first record seen); replay: everything up to now.
export function timeWindow(model, seconds) {
  const t1 = Math.max(model.now, 1e-6);
  if (!seconds) return [0, t1];
  const first = model.history.length ? model.history[0].t : t1;
  return [Math.max(first, t1 - seconds), t1];
}

export function drawQueues(canvas, model, [t0, t1]) {
  const { ctx, w, h } = fit(canvas);
  const left = 34, right = w - 8, top = 8, bottom = h - 16;
  const pts = model.history.filter((p) => p.t >= t0);
  let ymax = 4;
  for (const p of pts) ymax = Math.max(ymax, p.running, p.waiting, p.swapped);
  const x = (t) => left + ((t - t0) / Math.max(t1 - t0, 1e-9)) * (right - left);
  const y = (v) => bottom - (v / ymax) * (bottom - top);
  ctx.strokeStyle = "#ddd"; ctx.fillStyle = "#666";
  ctx.beginPath(); ctx.moveTo(left, top); ctx.lineTo(left, bottom); ctx.lineTo(right, bottom); ctx.stroke();
  ctx.fillText(String(ymax), 4, top + 8); ctx.fillText("0", 4, bottom);
  ctx.fillText(`${t0.toFixed(2)} s`, left, h - 3); ctx.fillText(`${t1.toFixed(2)} s`, right - 50, h - 3);
  const kvY = (v) => bottom - (v / Math.max(model.numBlocks, 1)) * (bottom - top);
  line(ctx, pts, x, (p) => kvY(p.kvUsed), COLORS.kv, [4, 3]);
  for (const key of ["waiting", "swapped", "running"]) line(ctx, pts, x, (p) => y(p[key]), COLORS[key]);
  ctx.fillStyle = COLORS.preempt;
  for (const m of model.preemptMarks) if (m.t >= t0) ctx.fillRect(x(m.t) - 1, bottom - 12, 3, 12);
  ctx.fillStyle = COLORS.lost;
  for (const m of model.lostMarks) if (m.t >= t0) lostMark(ctx, x(m.t), bottom - 20);
  const items = [["running", COLORS.running], ["waiting", COLORS.waiting], ["swapped", COLORS.swapped],
                 ["KV used", COLORS.kv], ["preemption", COLORS.preempt]];
  if (model.lostMarks.length) items.push(["lost deadline", COLORS.lost]);
  legend(ctx, items, left + 8, top + 10);
}

// A lost deadline: a small triangle pointing down at x, its tip at y + 6 (outlined in white
// where it sits on a lane's colours).
function lostMark(ctx, x, y, outline = false) {
  ctx.beginPath(); ctx.moveTo(x - 4, y); ctx.lineTo(x + 4, y); ctx.lineTo(x, y + 6); ctx.closePath();
  ctx.fill();
  if (outline) { ctx.strokeStyle = "#fff"; ctx.stroke(); }
}

function line(ctx, pts, x, y, color, dash = []) {
  if (!pts.length) return;
  ctx.strokeStyle = color; ctx.lineWidth = 1.5; ctx.setLineDash(dash); ctx.beginPath();
  pts.forEach((p, i) => { const px = x(p.t), py = y(p); if (i) ctx.lineTo(px, py); else ctx.moveTo(px, py); });
  ctx.stroke(); ctx.setLineDash([]); ctx.lineWidth = 1;
}

function legend(ctx, items, x, y) {
  const width = items.reduce((a, [label]) => a + ctx.measureText(label).width + 26, 0);
  ctx.fillStyle = "rgba(255,255,255,0.85)"; ctx.fillRect(x - 4, y - 10, width + 4, 13);
  for (const [label, color] of items) {
    ctx.fillStyle = color; ctx.fillRect(x, y - 7, 10, 7);
    ctx.fillStyle = "#333"; ctx.fillText(label, x + 13, y); x += ctx.measureText(label).width + 26;
  }
}

// The batch as one bar scaled to the token budget: a segment per request (prefill chunks
// blue, decode tokens orange, padding grey, each with its request's colour on top), and
// the step's time next to its target.
export function drawBatch(canvas, model, hits) {
  const { ctx, w, h } = fit(canvas);
  hits.length = 0;
  const rec = model.lastBatch;
  const budget = model.hello.token_budget || 0;
  const left = 4, right = w - 4, barTop = 4, barH = 24;
  ctx.strokeStyle = "#999"; ctx.strokeRect(left, barTop, right - left, barH);
  if (!rec) return;
  if (rec !== model.last) { ctx.fillStyle = "#888"; ctx.fillText(`last batch: step ${rec.step} (idle now)`, w * 0.45, barTop + barH + 13); }
  const segs = [...rec.prefill.map(([id, n]) => [id, n, "prefill"]), ...rec.decode.map((id) => [id, 1, "decode"]),
                ...rec.padding.map((id) => [id, 1, "padding"])];
  const total = segs.reduce((a, s) => a + s[1], 0) + (rec.padded_tokens || 0);
  const scale = (right - left) / Math.max(budget, total, 1);
  let x = left;
  for (const [id, n, kind] of segs) {
    const sw = Math.max(2, n * scale);
    ctx.fillStyle = COLORS[kind]; ctx.fillRect(x, barTop + 4, sw - 0.5, barH - 4);
    ctx.fillStyle = requestColor(id); ctx.fillRect(x, barTop, sw - 0.5, 4);
    hits.push({ x0: x, x1: x + sw, text: `${model.nameOf(id)}\n${kind}: ${n} token${n === 1 ? "" : "s"}` });
    x += sw;
    if (x > right) break;
  }
  ctx.fillStyle = "#333";
  ctx.fillText(budget ? `${total} / ${budget} tokens (budget)` : `${total} tokens (no token budget)`, left, barTop + barH + 13);
  const target = model.hello.time_target_ms, ms = rec.step_ms, pred = rec.predicted_ms;
  const tmax = Math.max(target || 0, ms || 0, pred || 0, 1e-3) * 1.15;
  const ty = barTop + barH + 20, tx0 = w * 0.45, tw = right - tx0;
  ctx.fillStyle = "#ccd"; ctx.fillRect(tx0, ty, ((ms || 0) / tmax) * tw, 8);
  if (rec.execute_ms) { ctx.fillStyle = "#7a86b8"; ctx.fillRect(tx0, ty, (rec.execute_ms / tmax) * tw, 8); }
  if (pred) { ctx.fillStyle = "#000"; ctx.fillRect(tx0 + (pred / tmax) * tw - 1, ty - 3, 2, 14); }
  if (target) { ctx.fillStyle = COLORS.preempt; ctx.fillRect(tx0 + (target / tmax) * tw - 1, ty - 3, 2, 14); }
  ctx.fillStyle = "#333";
  const parts = [`step ${fmt(ms)} ms`];
  if (rec.execute_ms) parts.push(`worker ${fmt(rec.execute_ms)} ms`);
  parts.push(pred ? `predicted ${fmt(pred)} ms` : "no prediction");
  parts.push(target ? `target ${fmt(target)} ms` : "no time target");
  ctx.fillText(parts.join(" · "), tx0, ty + 20);
}

const fmt = (v) => (v == null ? "–" : v < 10 ? v.toFixed(2) : v.toFixed(0));

export function drawBlocks(canvas, model, grid) {
  const { ctx, w, h } = fit(canvas);
  const n = model.numBlocks;
  const cell = Math.max(1, Math.min(22, Math.floor(Math.sqrt((w * h) / Math.max(n, 1)))));
  const cols = Math.max(1, Math.floor(w / cell));
  Object.assign(grid, { cell, cols, n });
  const map = model.blocks;
  for (let b = 0; b < n; b++) {
    const x = (b % cols) * cell, y = Math.floor(b / cols) * cell;
    const owners = map ? map.owners[b] : null;
    ctx.fillStyle = owners ? requestColor(owners[0]) : map && map.cached.has(b) ? COLORS.cached : COLORS.free;
    ctx.fillRect(x, y, cell - (cell > 3 ? 1 : 0), cell - (cell > 3 ? 1 : 0));
    if (owners && owners.length > 1 && cell >= 5) { // shared prefix: a white ring and the ref count
      ctx.strokeStyle = "#fff"; ctx.lineWidth = Math.max(1, cell / 6);
      ctx.strokeRect(x + cell * 0.2, y + cell * 0.2, cell * 0.55, cell * 0.55); ctx.lineWidth = 1;
      if (cell >= 14) { ctx.fillStyle = "#000"; ctx.fillText(String(owners.length), x + cell * 0.3, y + cell * 0.72); }
    }
  }
}

export function blockText(model, grid, px, py) {
  const b = Math.floor(py / grid.cell) * grid.cols + Math.floor(px / grid.cell);
  if (px >= grid.cols * grid.cell || b < 0 || b >= grid.n) return null;
  const map = model.blocks;
  const owners = map && map.owners[b];
  if (owners) return `block ${b}\nheld by ${owners.map((k) => model.nameOf(k)).join(", ")}${owners.length > 1 ? `\nshared prefix, ref count ${owners.length}` : ""}`;
  return `block ${b}\n${map && map.cached.has(b) ? "free, holds a cached prefix" : "free"}`;
}

export const LANE_H = 11;

export function drawLanes(canvas, model, [t0, t1]) {
  const lanes = [...model.lanes.values()];
  const { ctx, w } = fit(canvas, Math.max(40, lanes.length * LANE_H + 4));
  const x = (t) => ((Math.max(t, t0) - t0) / Math.max(t1 - t0, 1e-9)) * (w - 4);
  lanes.forEach((lane, i) => {
    const y = i * LANE_H + 2;
    if (lane.finish !== null && lane.finish < t0) return;
    for (const s of lane.segments) {
      if (s.t1 < t0) continue;
      ctx.fillStyle = laneColor(s.kind, lane.id);
      ctx.fillRect(x(s.t0), y, Math.max(1, x(s.t1) - x(s.t0)), LANE_H - 2);
      if (s.kind === "prefill") { ctx.fillStyle = "#fff"; ctx.fillRect(x(s.t1) - 0.5, y, 1, LANE_H - 2); }
    }
    if (lane.since !== null && lane.state !== "running") { // still waiting, preempted or swapped
      ctx.fillStyle = laneColor(lane.state, lane.id);
      ctx.fillRect(x(lane.since), y, Math.max(1, x(t1) - x(lane.since)), LANE_H - 2);
    }
    if (lane.firstToken !== null) { ctx.fillStyle = "#000"; ctx.fillRect(x(lane.firstToken) - 1, y, 2, LANE_H - 2); }
    if (lane.finish !== null) {
      ctx.fillStyle = lane.reason === "abort" ? COLORS.preempt : "#333";
      ctx.fillRect(x(lane.finish), y - 1, 3, LANE_H);
    }
    if (lane.slo || lane.lost.length) drawDeadlines(ctx, lane, x, y, t0, t1);
  });
  return lanes;
}

// Objectives on a lane: the TTFT deadline as a thin line, the slack as a strip along the
// lane's foot (coloured by slackColor, each value until the next one, the finish or now),
// and each lost deadline as a triangle where it fell due.
function drawDeadlines(ctx, lane, x, y, t0, t1) {
  const ttft = lane.slo && lane.slo.ttft_ms;
  if (ttft) {
    const due = lane.arrival + ttft / 1000;
    if (due >= t0 && due <= t1) { ctx.fillStyle = COLORS.deadline; ctx.fillRect(x(due) - 0.5, y - 1, 1, LANE_H); }
  }
  const pts = lane.slackPts, end = lane.finish ?? t1;
  for (let i = 0; i < pts.length; i++) {
    const a = pts[i].t, b = i + 1 < pts.length ? pts[i + 1].t : end;
    if (b < t0 || pts[i].ratio === null) continue;
    ctx.fillStyle = slackColor(pts[i].ratio);
    ctx.fillRect(x(a), y + LANE_H - 5, Math.max(1, x(b) - x(a)), 3);
  }
  ctx.fillStyle = COLORS.lost;
  for (const m of lane.lost) if (m.t >= t0) lostMark(ctx, x(m.t), y - 1, true);
}

function laneColor(kind, id) {
  if (kind === "decode") return requestColor(id, 55);
  if (kind === "prefill") return requestColor(id, 35);
  return { waiting: COLORS.wait, preempted: COLORS.preempted, swapped: COLORS.swappedLane, padding: COLORS.padding }[kind] || "#ccc";
}

export function laneText(model, lane) {
  const ttft = lane.firstToken !== null ? `${((lane.firstToken - lane.arrival) * 1000).toFixed(1)} ms` : "–";
  const lines = [model.nameOf(lane.id), `arrived ${lane.arrival.toFixed(3)} s`];
  if (lane.prompt !== null) lines.push(`prompt ${lane.prompt} tokens${lane.cached ? ` (${lane.cached} cached)` : ""}`);
  lines.push(`TTFT ${ttft}`, `preemptions ${lane.preemptions}`);
  if (lane.slo) {
    const o = lane.slo, parts = [];
    if (o.ttft_ms) parts.push(`TTFT ≤ ${o.ttft_ms} ms`);
    if (o.tpot_ms) parts.push(`TPOT ≤ ${o.tpot_ms} ms`);
    lines.push(`objectives: ${parts.join(", ")} (${o.class})`);
    if (lane.slack !== null) lines.push(`slack ${lane.slack} ms (${lane.slackPhase}) at ${lane.slackPts[lane.slackPts.length - 1].t.toFixed(3)} s`);
  }
  for (const m of lane.lost) lines.push(`${m.objective.toUpperCase()} deadline lost at ${m.t.toFixed(3)} s`);
  lines.push(lane.finish !== null ? `finished: ${lane.reason} at ${lane.finish.toFixed(3)} s` : `now ${lane.state}`);
  return lines.join("\n");
}
