// memwall's live dashboard. One event every 0.25 s from /dashboard/api/events (hub.py):
//   {reset, steps: [{i, t, ms, r: [[id, prefill, decode, new, proposed, accepted], ...]}],
//    state: {stats, view: {states, tables, running, waiting}, throughput, batching, ...}}
// The key: the first visit is /dashboard?key=<key>; the server answers with a cookie that the
// page's own requests carry, and the key is taken out of the address bar here.
"use strict";

const MAX_STEPS = 512;       // steps kept: the server's ring, the window of its figures
const SHOWN_ROWS = 80;       // timeline rows drawn
const MAX_CELLS = 4096;      // block map cells; a bigger cache shows several blocks a cell

const $ = (id) => document.getElementById(id);
const state = { steps: [], last: null, cells: [], cellSpan: 1, highlighted: null };

// ---- small helpers ------------------------------------------------------------------------
function hue(id) {
  let h = 2166136261;
  for (let k = 0; k < id.length; k++) { h ^= id.charCodeAt(k); h = Math.imul(h, 16777619); }
  return (h >>> 0) % 360;
}
const color = (id) => `hsl(${hue(id)}, 62%, 58%)`;
const pct = (x) => `${(100 * x).toFixed(1)}%`;
const num = (x, digits = 1) => (x >= 100 ? x.toFixed(0) : x.toFixed(digits));
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}
function shortId(id) { return id.length > 22 ? id.slice(0, 10) + "…" + id.slice(-8) : id; }

// ---- tabs ---------------------------------------------------------------------------------
for (const button of document.querySelectorAll(".tab")) {
  button.addEventListener("click", () => {
    for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b === button);
    for (const panel of document.querySelectorAll(".tab-panel")) {
      panel.hidden = panel.id !== "tab-" + button.dataset.tab;
    }
  });
}

// ---- cards --------------------------------------------------------------------------------
function renderCards(s) {
  const st = s.stats, tp = s.throughput;
  $("model").textContent = s.model;
  $("description").textContent = s.description +
    (s.data_parallel > 1 ? ` — data parallel ${s.data_parallel}: the block map, queues and ` +
      "timeline are replica 0's; the counters are all replicas'" : "");
  $("k-running").textContent = st.running;
  $("k-waiting").textContent = st.waiting;
  $("k-kv").textContent = pct(st.kv_usage);
  $("k-kv-sub").textContent = `${st.total_blocks - st.free_blocks} of ${st.total_blocks} blocks`;
  $("k-hit").textContent = st.prefix_queries ? pct(st.prefix_hit_rate) : "–";
  $("k-hit-sub").textContent = `${st.prefix_hits} of ${st.prefix_queries} prompt tokens`;
  $("k-tps").textContent = `${num(tp.generated_tok_s)} tok/s`;
  $("k-tps-sub").textContent = `prefill ${num(tp.prefill_tok_s)} tok/s · last ${num(tp.window_s)} s`;
  $("k-step").textContent = tp.steps ? `${num(tp.step_ms_mean, 2)} ms` : "–";
  $("k-step-sub").textContent = `${tp.steps} steps, engine busy ${pct(tp.busy_share)}`;
  const specOn = st.spec_draft_tokens > 0;
  $("k-spec").textContent = specOn ? pct(st.spec_acceptance) : "off";
  $("k-spec-sub").textContent = specOn ?
    `${st.spec_accepted_tokens}/${st.spec_draft_tokens} drafts · ${num(st.spec_mean_accepted_length, 2)} tok/step` : "";
  $("k-preempt").textContent = st.preemptions;
  $("k-evict").textContent = st.evictions;
  $("pv-live").textContent = `${num(tp.generated_tok_s)} tok/s`;
}

// ---- block map ----------------------------------------------------------------------------
function renderBlockMap(view, stats) {
  const total = view ? view.states.length : stats.total_blocks;
  const states = view ? view.states : ".".repeat(total);
  const span = Math.max(1, Math.ceil(total / MAX_CELLS));
  const count = Math.ceil(total / span);
  const map = $("blockmap");
  if (state.cells.length !== count || state.cellSpan !== span) {
    map.replaceChildren();
    state.cells = [];
    for (let c = 0; c < count; c++) {
      const cell = el("div", "blk");
      cell.dataset.block = String(c * span);
      state.cells.push(cell);
      map.appendChild(cell);
    }
    state.cellSpan = span;
    // few blocks: big cells; many: small ones, so that the map stays one screen
    map.style.setProperty("--cell", `${count <= 160 ? 20 : count <= 640 ? 14 : 10}px`);
  }
  const holders = new Map();  // block -> [request ids]
  for (const [rid, blocks] of Object.entries(view ? view.tables : {})) {
    for (const b of blocks) {
      const list = holders.get(b);
      if (list) list.push(rid); else holders.set(b, [rid]);
    }
  }
  for (let c = 0; c < count; c++) {
    const first = c * span;
    const st = cellState(states, first, span);
    const held = holders.get(first) || [];
    const cell = state.cells[c];
    const cls = "blk " + st + (held.includes(state.highlighted) ? " hl" : "");
    if (cell.className !== cls) cell.className = cls;
    const bg = held.length ? color(held[0]) : (st === "U" || st === "S" ? "#8a96a6" : "");
    if (cell.style.backgroundColor !== bg) cell.style.backgroundColor = bg;
    cell.dataset.state = st;
    cell.title = `block ${first}${span > 1 ? "–" + (first + span - 1) : ""}: ${stateName(st)}` +
      (held.length ? ` · ${held.join(", ")}` : "");
  }
  const used = [...states].filter((x) => x === "U" || x === "S").length;
  const cached = [...states].filter((x) => x === "C").length;
  $("bm-count").textContent = `${total} blocks · ${used} in use · ${cached} cached`;
  $("bm-note").textContent = (span > 1 ? `Each cell is ${span} blocks (its busiest state). ` : "") +
    (view ? `Built ${new Date(view.built * 1000).toLocaleTimeString()}, at most 4 times a second.`
      : "No block map yet: it comes with the engine's first step.");
}

function cellState(states, first, span) {
  if (span === 1) return states[first];
  const part = states.slice(first, first + span);
  for (const s of ["S", "U", "C"]) if (part.includes(s)) return s;
  return ".";
}
function stateName(s) {
  return { ".": "free", U: "in use", S: "shared", C: "cached" }[s] || s;
}

// ---- queues -------------------------------------------------------------------------------
function renderQueues(view, stats) {
  const running = view ? view.running : [], waiting = view ? view.waiting : [];
  $("q-running-count").textContent = `(${stats.running})`;
  $("q-waiting-count").textContent = `(${stats.waiting})`;
  fillQueue($("q-running").tBodies[0], running, (q) => {
    const known = q[2] + q[3];
    const bar = el("div", "prog");
    const fill = el("i");
    fill.style.width = `${known ? (100 * q[1]) / known : 0}%`;
    bar.append(fill, el("span", "", `${q[1]} / ${known}`));
    return [bar, String(q[2]), String(q[3])];
  });
  fillQueue($("q-waiting").tBodies[0], waiting, (q) => [q[4], String(q[2]), String(q[3])]);
}

function fillQueue(body, rows, cells) {
  body.replaceChildren();
  for (const q of rows) {
    const tr = el("tr");
    tr.dataset.request = q[0];
    const name = el("span", "rid");
    const dot = el("i", "dot");
    dot.style.background = color(q[0]);
    name.append(dot, el("span", "", shortId(q[0])));
    name.title = q[0];
    const first = el("td");
    first.appendChild(name);
    tr.appendChild(first);
    for (const c of cells(q)) {
      const td = el("td");
      if (typeof c === "string") td.textContent = c; else td.appendChild(c);
      tr.appendChild(td);
    }
    tr.addEventListener("mouseenter", () => highlight(q[0]));
    tr.addEventListener("mouseleave", () => highlight(null));
    body.appendChild(tr);
  }
  if (!rows.length) {
    const tr = el("tr");
    const td = el("td", "muted", "empty");
    td.colSpan = 4;
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

// ---- timeline -----------------------------------------------------------------------------
function addSteps(steps, reset) {
  if (reset) state.steps = [];
  state.steps.push(...steps);
  if (state.steps.length > MAX_STEPS) state.steps.splice(0, state.steps.length - MAX_STEPS);
}

function renderTimeline() {
  const box = $("timeline");
  const shown = state.steps.slice(-SHOWN_ROWS).reverse();
  const maxMs = Math.max(1e-6, ...shown.map((s) => s.ms));
  const rows = shown.map((s) => {
    const row = el("div", "step-row");
    row.dataset.index = String(s.i);
    row.appendChild(el("span", "idx", `#${s.i}`));
    const ms = el("span", "ms");
    const bar = el("i");
    bar.style.width = `${(100 * s.ms) / maxMs}%`;
    ms.append(bar, el("span", "", `${num(s.ms, 2)} ms`));
    row.appendChild(ms);
    const segs = el("div", "bar");
    let proposed = 0, accepted = 0;
    for (const [rid, prefill, decode, made, prop, acc] of s.r) {
      const tokens = prefill || decode;
      const seg = el("span", "seg " + (prefill ? "prefill" : "decode"));
      seg.style.width = `${Math.round(6 + 10 * Math.log2(1 + tokens))}px`;
      seg.style.backgroundColor = color(rid);
      seg.title = `${rid}: ${prefill ? `prefill ${prefill} tokens` : `decode ${decode} token(s)`}` +
        (prop ? `, ${acc}/${prop} drafts accepted` : "") + `, +${made} output`;
      segs.appendChild(seg);
      proposed += prop; accepted += acc;
    }
    row.appendChild(segs);
    row.appendChild(el("span", "spec", proposed ? `✓${accepted}/${proposed}` : ""));
    return row;
  });
  box.replaceChildren(...rows);
}

// ---- continuous vs static -----------------------------------------------------------------
function renderBatching(b) {
  $("eff-cont").textContent = b.continuous_slots ? pct(b.continuous) : "–";
  $("eff-cont-sub").textContent =
    `${b.continuous_busy} busy of ${b.continuous_slots} slot-steps (B=${b.batch_size}, ${b.num_steps} steps)`;
  $("eff-static").textContent = b.static_slots ? pct(b.static) : "–";
  $("eff-static-sub").textContent =
    `${b.static_busy} busy of ${b.static_slots}; ${b.static_idle} idle in ${b.num_batches} batches`;
  drawGantt(b);
}

function drawGantt(b) {
  // Two pictures on one step axis: the lanes continuous batching ran (the steps kept: the same
  // window the server computed both figures over), and the static batches it would have run.
  const canvas = $("gantt");
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 640, h = canvas.clientHeight || 220;
  if (canvas.width !== Math.round(w * ratio)) {
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
  }
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, w, h);
  const B = b.batch_size;
  if (!B) { label(g, "no steps yet", 8, 16); return; }
  const steps = state.steps;
  const longest = (batch) => Math.max(...batch.map((r) => r[1]));
  const staticLen = b.batches.reduce((t, batch) => t + longest(batch), 0);
  const span = Math.max(steps.length, staticLen, 1);
  const x0 = 8, xw = (w - x0 - 8) / span;
  const laneH = Math.max(3, Math.min(16, (h / 2 - 34) / B));
  const top1 = 20, top2 = h / 2 + 20;
  label(g, `continuous: ${steps.length} steps`, x0, 13);
  label(g, `static, batches of ${B}: ${staticLen} decode steps (hatched: idle slots)`, x0, h / 2 + 13);
  const lanes = new Array(B).fill(null);  // a request keeps its lane while it runs
  steps.forEach((s, x) => {
    const ran = new Set(s.r.map((r) => r[0]));
    for (let l = 0; l < B; l++) if (lanes[l] && !ran.has(lanes[l])) lanes[l] = null;
    for (const [rid, prefill] of s.r) {
      let lane = lanes.indexOf(rid);
      if (lane < 0) { lane = lanes.indexOf(null); if (lane < 0) continue; lanes[lane] = rid; }
      g.fillStyle = color(rid);
      g.globalAlpha = prefill ? 0.5 : 1;
      g.fillRect(x0 + x * xw, top1 + lane * laneH, Math.max(1, xw), laneH - 1);
    }
  });
  g.globalAlpha = 1;
  let x = 0;
  for (const batch of b.batches) {
    const end = longest(batch);
    for (let l = 0; l < B; l++) {
      const [rid, out] = batch[l] || ["", 0];
      if (out) {
        g.fillStyle = color(rid);
        g.fillRect(x0 + x * xw, top2 + l * laneH, Math.max(1, out * xw), laneH - 1);
      }
      hatch(g, x0 + (x + out) * xw, top2 + l * laneH, (end - out) * xw, laneH - 1);
    }
    x += end;
    g.fillStyle = "#ffffff40";
    g.fillRect(x0 + x * xw - 0.5, top2 - 3, 1, B * laneH + 4);
  }
}

function hatch(g, x, y, w, h) {
  if (w <= 0) return;
  g.fillStyle = "#ff6b6b22";
  g.fillRect(x, y, w, h);
  g.strokeStyle = "#ff6b6b88";
  g.beginPath();
  for (let k = x - h; k < x + w; k += 5) {
    g.moveTo(Math.max(k, x), y + h - Math.max(0, x - k));
    g.lineTo(Math.min(k + h, x + w), y + Math.max(0, k + h - x - w));
  }
  g.stroke();
}
function label(g, text, x, y) { g.fillStyle = "#8a96a6"; g.font = "11px system-ui"; g.fillText(text, x, y); }

// ---- planner prediction next to the live figure --------------------------------------------
// The served model on this machine at the running batch and its mean context: the planner's
// decode rate (GET /dashboard/api/prediction) beside the measured one. Asked every 2 s at most,
// and only while requests run: the planner computes in the server's thread pool.
let predictionAsked = 0;
async function refreshPrediction(s) {
  const batch = s.stats.running;
  if (!batch || Date.now() - predictionAsked < 2000) return;
  predictionAsked = Date.now();
  const running = s.view ? s.view.running : [];
  const context = running.length
    ? Math.max(1, Math.round(running.reduce((sum, q) => sum + q[1], 0) / running.length)) : 512;
  let answer;
  try {
    const r = await fetch(`/dashboard/api/prediction?batch=${batch}&context=${context}`);
    answer = await r.json();
    if (!r.ok) throw new Error(answer.error ? answer.error.message : r.status);
  } catch (e) {
    $("pv-note").textContent = `no prediction: ${e.message || e}`;
    return;
  }
  if (answer.tokens_per_s == null) {
    $("pv-plan").textContent = "–";
    $("pv-note").textContent = (answer.notes || []).join("; ") || "no prediction for this device";
    return;
  }
  $("pv-plan").textContent = `${num(answer.tokens_per_s)} tok/s`;
  $("pv-note").textContent = `decode at batch ${answer.batch}, context ${answer.context} ` +
    `(${answer.bound}-bound), ${answer.device}`;
}

// ---- plan tab -----------------------------------------------------------------------------
function flatten(value, prefix = "", out = []) {
  if (value !== null && typeof value === "object") {
    const entries = Array.isArray(value) ? value.map((v, k) => [String(k), v]) : Object.entries(value);
    if (!entries.length) out.push([prefix, Array.isArray(value) ? "[]" : "{}"]);
    for (const [k, v] of entries) flatten(v, prefix ? `${prefix}.${k}` : k, out);
  } else {
    out.push([prefix, value]);
  }
  return out;
}

function showValue(v) {
  if (typeof v !== "number") return String(v);
  return Number.isInteger(v) ? v.toLocaleString("en-US") : String(+v.toPrecision(6));
}

$("plan-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const body = {};
  for (const [k, v] of new FormData(event.target).entries()) {
    if (v === "") continue;
    const input = event.target.elements[k];
    body[k] = input.type === "number" ? Number(v) : v;
  }
  if (String(body.gpu).toLowerCase() === "this") {  // the planner's name for this machine
    body.device = "this";
    delete body.gpu;
  }
  $("plan-status").textContent = "planning…";
  const table = $("plan-result").tBodies[0];
  table.replaceChildren();
  let answer, response;
  try {
    response = await fetch("/dashboard/api/plan", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    answer = await response.json();
  } catch (e) {
    $("plan-status").textContent = `the plan request failed: ${e}`;
    return;
  }
  if (!response.ok) {
    const msg = answer && answer.error ? answer.error.message : JSON.stringify(answer);
    $("plan-status").textContent = `${response.status}: ${msg}`;
    $("plan-status").className = "error";
    return;
  }
  $("plan-status").className = "muted";
  $("plan-status").textContent = "plan:";
  const flat = flatten(answer);
  for (const [k, v] of flat) {
    const tr = el("tr");
    tr.append(el("td", "", k), el("td", "", showValue(v)));
    table.appendChild(tr);
  }
});

// ---- the stream ---------------------------------------------------------------------------
function onEvent(message) {
  // Draw only what changed: a browser on the engine's own machine takes CPU from it.
  const event = JSON.parse(message.data);
  const s = event.state;
  const viewChanged = !state.last || (s.view && s.view.built) !== (state.last.view && state.last.view.built)
    || s.stats.total_blocks !== state.last.stats.total_blocks;
  state.last = s;
  addSteps(event.steps, event.reset);
  renderCards(s);
  if (viewChanged) {
    renderBlockMap(s.view, s.stats);
    renderQueues(s.view, s.stats);
  }
  if (event.steps.length || event.reset) {
    renderTimeline();
    renderBatching(s.batching);
  }
  $("p-model").placeholder = `the planner's default (serving: ${s.model})`;
  refreshPrediction(s);
}

function highlight(rid) {
  state.highlighted = rid;
  if (state.last) renderBlockMap(state.last.view, state.last.stats);
}

async function explainFailure() {
  // EventSource hides the HTTP status: ask once, so that a missing key says so.
  try {
    const r = await fetch("/dashboard/api/snapshot");
    if (r.status === 401) {
      const body = await r.json();
      $("auth-error").hidden = false;
      $("auth-error").textContent = body.error.message;
    }
  } catch (e) { /* the server is down: the badge says so */ }
}

function connect() {
  const source = new EventSource("/dashboard/api/events");
  source.onopen = () => { $("conn").textContent = "live"; $("conn").className = "conn live"; };
  source.onmessage = onEvent;
  source.onerror = () => {
    $("conn").textContent = "reconnecting…";
    $("conn").className = "conn down";
    explainFailure();
  };
}

if (new URLSearchParams(location.search).has("key")) {
  history.replaceState(null, "", location.pathname + location.hash);  // the cookie has it now
}
connect();
