// The dashboard page: live (records from /dashboard/stream) or replay (a timeline file from
// ?timeline=URL or the file picker). Draws on animation frames, only when something changed.

import { RunModel } from "./model.js";
import { Player, parseTimeline } from "./player.js";
import * as V from "./views.js";

const $ = (id) => document.getElementById(id);
const ui = { runs: $("runs"), status: $("status"), tooltip: $("tooltip"), play: $("play"), speed: $("speed") };
// Exposed for tests and the curious: the models, the player, and how many errors were shown.
const dash = { mode: "live", panels: [], player: null, source: null, dirty: true, errors: [] };
window.stepserveDashboard = dash;

function setStatus(text, kind = "") {
  ui.status.textContent = text;
  ui.status.className = `status ${kind}`;
  document.body.dataset.status = text;
}

function reportError(message) {
  dash.errors.push(message);
  setStatus(message, "bad");
}

function clearRuns() {
  ui.runs.textContent = "";
  dash.panels = [];
}

function addPanel(model) {
  const el = $("run-template").content.firstElementChild.cloneNode(true);
  el.querySelector(".run-name").textContent = model.name;
  const q = (cls) => el.querySelector(cls);
  const panel = { el, model, queues: q(".queues-canvas"), batch: q(".batch-canvas"), blocks: q(".blocks-canvas"),
                  lanes: q(".lanes-canvas"), scroll: q(".lanes-scroll"), stats: q(".run-stats"),
                  sloLegend: q(".slo-legend"),
                  batchHits: [], grid: {}, laneList: [], follow: true };
  panel.scroll.addEventListener("scroll", () => {
    const s = panel.scroll;
    panel.follow = s.scrollTop + s.clientHeight >= s.scrollHeight - 4;
  });
  hover(panel.batch, (x) => panel.batchHits.find((h) => x >= h.x0 && x < h.x1)?.text);
  hover(panel.blocks, (x, y) => V.blockText(panel.model, panel.grid, x, y));
  hover(panel.lanes, (x, y) => { const lane = panel.laneList[Math.floor((y - 2) / V.LANE_H)]; return lane && V.laneText(panel.model, lane); });
  hover(panel.queues, (x) => queueText(panel, x));
  ui.runs.appendChild(el);
  dash.panels.push(panel);
  dash.dirty = true;
  return panel;
}

function hover(canvas, text) {
  canvas.addEventListener("mousemove", (e) => {
    const r = canvas.getBoundingClientRect();
    const t = text(e.clientX - r.left, e.clientY - r.top);
    if (!t) { ui.tooltip.hidden = true; return; }
    ui.tooltip.textContent = t;
    ui.tooltip.style.left = `${e.clientX + 12}px`;
    ui.tooltip.style.top = `${e.clientY + 12}px`;
    ui.tooltip.hidden = false;
  });
  canvas.addEventListener("mouseleave", () => { ui.tooltip.hidden = true; });
}

function queueText(panel, x) {
  const [t0, t1] = windowOf(panel.model);
  const t = t0 + (x - 34) / Math.max(panel.queues.clientWidth - 42, 1) * (t1 - t0);
  const p = panel.model.history.find((h) => h.t >= t);
  return p && `t ${p.t.toFixed(3)} s\nrunning ${p.running}, waiting ${p.waiting}, swapped ${p.swapped}\nKV blocks used ${p.kvUsed}`;
}

function windowOf(model) {
  if (dash.mode === "live") return V.timeWindow(model, Number($("window").value));
  return [0, Math.max(dash.player ? dash.player.clock : model.now, 1e-6)];
}

function render() {
  for (const p of dash.panels) {
    const m = p.model, win = windowOf(m), c = m.counts;
    V.drawQueues(p.queues, m, win);
    V.drawBatch(p.batch, m, p.batchHits);
    V.drawBlocks(p.blocks, m, p.grid);
    p.laneList = V.drawLanes(p.lanes, m, win);
    if (p.follow) p.scroll.scrollTop = p.scroll.scrollHeight;
    const last = m.last ? `step ${m.last.step}` : "no step yet";
    p.stats.textContent = `${last} · ${m.steps} steps shown${m.gapSteps ? ` (+${m.gapSteps} dropped)` : ""} · ` +
      `${m.preemptions} preemptions · running ${c.running}, waiting ${c.waiting}` +
      (c.grammar ? ` (+${c.grammar} for a grammar's compile)` : "") + `, swapped ${c.swapped} · ` +
      `KV used ${c.kv[0]}, cached ${c.kv[1]}, free ${c.kv[2]} of ${m.numBlocks} · ${m.tokens} tokens` +
      (m.lost.ttft || m.lost.tpot ? ` · deadlines lost: TTFT ${m.lost.ttft}, TPOT ${m.lost.tpot}` : "") +
      (m.truncated ? " · viewer fell behind: some request events lost" : "");
    p.sloLegend.hidden = !m.hasSLO;
    Object.assign(p.el.dataset, { steps: m.steps, preemptions: m.preemptions, finished: m.finished,
                                  lost: m.lost.ttft + m.lost.tpot });
  }
  const pl = dash.player;
  if (pl) {
    document.body.dataset.ended = String(pl.ended);
    ui.play.textContent = pl.playing ? "pause" : "play";
    setStatus(pl.ended ? `replay ended at ${pl.clock.toFixed(3)} s` : `replay ${pl.playing ? "playing" : "paused"} ` +
      `${pl.clock.toFixed(3)} / ${pl.duration.toFixed(3)} s`, pl.ended ? "ok" : "");
  }
}

let lastFrame = performance.now();
function frame(now) {
  const dt = Math.min((now - lastFrame) / 1000, 0.25);
  lastFrame = now;
  if (dash.player && dash.player.tick(dt)) dash.dirty = true;
  if (dash.dirty) {
    dash.dirty = false;
    try { render(); } catch (err) { reportError(`draw failed: ${err.message}`); throw err; }
  }
  requestAnimationFrame(frame);
}

// -- live ----------------------------------------------------------------------------------

function connectLive() {
  setStatus("connecting");
  const source = new EventSource("/dashboard/stream");
  dash.source = source;
  let panel = null;
  source.onmessage = (e) => {
    const rec = JSON.parse(e.data);
    if (rec.type === "hello") {
      clearRuns();
      panel = addPanel(new RunModel(`live: ${rec.model || "server"}`, rec));
      setStatus("live", "ok");
    } else if (panel) {
      panel.model.apply(rec);
    }
    dash.dirty = true;
  };
  source.onerror = () => {
    if (source.readyState !== EventSource.CLOSED) { setStatus("reconnecting"); return; }
    setStatus("disconnected; retrying", "bad");
    setTimeout(() => { if (dash.source === source) connectLive(); }, 2000);
  };
}

// -- replay --------------------------------------------------------------------------------

function startReplay(text, label) {
  if (dash.source) { dash.source.close(); dash.source = null; }
  let runs;
  try { runs = parseTimeline(text); } catch (err) { reportError(`cannot read ${label}: ${err.message}`); return; }
  dash.mode = "replay";
  document.body.classList.remove("live");
  $("mode").textContent = `replay of ${label}`;
  clearRuns();
  const panels = runs.map((r) => addPanel(new RunModel(r.name, r.hello)));
  dash.player = new Player(runs, (i, rec) => panels[i].model.apply(rec));
  dash.player.setSpeed(ui.speed.value);
  dash.dirty = true;
}

async function loadTimeline(url) {
  setStatus(`loading ${url}`);
  try {
    const resp = await fetch(url);
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    startReplay(await resp.text(), url);
  } catch (err) {
    reportError(`cannot load ${url}: ${err.message}`);
  }
}

function wireControls() {
  $("file").addEventListener("change", async (e) => {
    const file = e.target.files[0];
    if (file) startReplay(await file.text(), file.name);
  });
  ui.play.addEventListener("click", () => {
    const pl = dash.player;
    if (!pl) return;
    if (pl.ended) { startReplay(JSON.stringify({ format: "stepserve-timeline", runs: pl.runs }), "the same timeline"); return; }
    pl.playing = !pl.playing; dash.dirty = true;
  });
  $("step").addEventListener("click", () => { if (dash.player) { dash.player.stepOnce(); dash.dirty = true; } });
  $("end").addEventListener("click", () => { if (dash.player) { dash.player.toEnd(); dash.dirty = true; } });
  ui.speed.addEventListener("change", () => { if (dash.player) dash.player.setSpeed(ui.speed.value); });
  $("window").addEventListener("change", () => { dash.dirty = true; });
  window.addEventListener("resize", () => { dash.dirty = true; });
}

wireControls();
const timeline = new URLSearchParams(location.search).get("timeline");
if (timeline) loadTimeline(timeline);
else { document.body.classList.add("live"); connectLive(); }
requestAnimationFrame(frame);
