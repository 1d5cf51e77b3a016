// m3gate status page: asks /ui/access whether it needs the admin key, then polls /ui/state and redraws. No
// libraries, no build step. The admin key lives in sessionStorage and goes only in the Authorization header; a key is
// checked at /ui/access (always a 200), so a normal visit never makes a request the browser logs as failed.
"use strict";

const KEY = "m3gate.adminKey";
const HISTORY_S = 900;  // the charts' span: the gateway keeps 15 minutes of points
let timer = null;
let failures = 0;
const kept = { points: [], size: 180, every_s: 5, drawn: null };  // the history points this page holds

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "style") Object.assign(el.style, v);  // CSSOM, which the page's CSP allows (inline styles it does not)
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.appendChild(typeof c === "object" ? c : document.createTextNode(String(c)));
  }
  return el;
}

const fmt = {
  ms(v) { return v === null || v === undefined ? "—" : v >= 1000 ? (v / 1000).toFixed(2) + " s" : v.toFixed(v < 10 ? 1 : 0) + " ms"; },
  pct(v) { return v === null || v === undefined ? "—" : (100 * v).toFixed(1) + "%"; },
  num(v) { return v === null || v === undefined ? "—" : String(v); },
  rate(v) { return v === null || v === undefined ? "—" : v.toFixed(v < 10 ? 2 : 1) + "/s"; },
  tokens(n) { return n >= 1048576 && n % 1048576 === 0 ? n / 1048576 + "M" : n % 1024 === 0 ? n / 1024 + "K" : String(n); },
  time(t) { return new Date(t * 1000).toLocaleTimeString(); },
};

// headers: [label, css class, tooltip]; each cell without its own title gets its column's, so every figure says
// what it is on hover.
function table(headers, rows, attrs) {
  for (const row of rows) {
    Array.from(row.children).forEach((td, i) => {
      if (!td.getAttribute("title") && headers[i] && headers[i][2]) td.setAttribute("title", headers[i][2]);
    });
  }
  return h("table", attrs || {},
    h("thead", {}, h("tr", {}, headers.map(([label, cls, tip]) => h("th", { class: cls || null, title: tip || null }, label)))),
    h("tbody", {}, rows));
}

function authHeaders(key) {
  key = key === undefined ? sessionStorage.getItem(KEY) : key;
  return key ? { Authorization: "Bearer " + key } : {};
}

function showLogin(message) {
  document.getElementById("main").hidden = true;
  document.getElementById("login").hidden = false;
  document.getElementById("forget-key").hidden = true;
  document.getElementById("login-error").textContent = message || "";
  setLive("locked", "", "the page needs the admin key to read the gateway's state");
}

function setLive(text, cls, tip) {
  const live = document.getElementById("live");
  live.textContent = text;
  live.className = "badge " + cls;
  live.title = tip || "";
}

// ---------------------------------------------------------------------------------------------------------------

function renderReload(r) {
  const box = document.getElementById("reload");
  if (!r) { box.replaceChildren(h("span", { class: "mute", title: "the gateway was started with a config object, not a file: nothing to reload" }, "config given in memory")); return; }
  const head = h("div", { id: "reload-status", "data-ok": String(r.ok) },
    h("span", { class: r.ok ? "ok" : "error", title: "the last config reload: applied (OK) or rejected, the running config unchanged" }, r.ok ? "OK" : "REJECTED"), " — ", r.message, " ",
    h("span", { class: "mute", title: "when the last reload ran; reloads applied and rejected since the gateway started" },
      "at " + fmt.time(r.at) + ` · ${r.successes} applied, ${r.failures} rejected`));
  const problems = (r.problems || []).map((p) => h("pre", { class: r.ok ? "mute" : "error reload-problem", title: "what the reload found wrong, with its line in the file" }, p));
  box.replaceChildren(head, ...problems);
}

const REPLICA_COLUMNS = [
  ["replica", null, "the replica's URL"],
  ["state", null, "available: takes requests; draining: finishing its requests, takes no new ones; ejected: failed recently, back after the time shown; unhealthy: its health check fails"],
  ["in flight", "num", "requests this gateway has sent to the replica and not yet seen finish"],
  ["waiting / running", "num", "the replica's own queue and running batch (vllm:num_requests_waiting / running, scraped)"],
  ["KV use", null, "share of the replica's KV-cache blocks in use (vllm:kv_cache_usage_perc)"],
  ["prefix hits", "num", "share of prompt tokens the replica served from its prefix cache (scraped counters)"],
  ["exact index", null, "with precise routing: the replica's KV-event stream (fresh, stale or disconnected) and the blocks indexed"],
  ["metrics age", "num", "how old the replica's scraped metrics are"],
];

function renderPools(pools) {
  const box = document.getElementById("pools");
  box.replaceChildren(...pools.map((p) => {
    const head = h("div", { class: "pool-head" },
      h("h3", { title: "pool name (config pools[].name)" }, p.name),
      h("span", { title: "max_model_len: the longest prompt + output this pool's replicas take" }, "ceiling " + fmt.tokens(p.max_model_len) + " tokens"),
      h("span", { title: "the traffic class this pool's requests get unless the client or its key names one" }, "class " + p.class),
      h("span", { title: "replicas taking requests now / configured" + (p.launch_replicas ? " (launch: replicas the launch recipe starts)" : "") },
        `${p.available}/${p.replicas.length} available` + (p.launch_replicas ? ` (launch: ${p.launch_replicas})` : "")),
      ...(p.capacity || []).map((c) => h("span", { class: "capacity", "data-role": c.role, "data-desired": String(c.desired),
        title: "replicas this pool" + (c.role === "both" ? "" : "'s " + c.role + " side") + " needs for its classes' TTFT/TPOT p95 targets now, queueing included (m3gate_pool_desired_replicas; GET /admin/capacity)" },
        (c.role === "both" ? "" : c.role + ": ") + (c.desired === null ? "sizing…" : `needs ${c.desired}`)
        + (c.desired !== null && c.bottleneck ? ` (${c.bottleneck.replace("_", " ")})` : ""))),
      ...(p.background || []).map((b) => h("span", { class: "background", "data-class": b.class,
        title: "background class " + b.class + ": requests in flight / its window in this pool (it uses only spare capacity: m3gate_background_window) · streams paused for foreground requests, waiting to go on" },
        `${b.class}: ${b.in_flight}/${b.window} window` + (b.paused ? ` · ${b.paused} paused` : ""))),
      h("span", { class: "mute", title: "inputs the pool accepts · its replica-choice policy" + (p.precise ? " · precise: routed on the replicas' own KV events" : "") },
        p.modalities.join(", ") + " · " + p.policy + (p.precise ? " · precise" : "")));
    const rows = p.replicas.map((r) => {
      const kv = r.kv_usage === null || r.kv_usage === undefined ? "—" :
        h("span", {}, h("span", { class: "kv" }, h("span", { class: "bar", style: { width: `${Math.round(60 * Math.min(1, r.kv_usage))}px` } })), fmt.pct(r.kv_usage));
      const exact = r.exact_index ? (r.exact_index.connected ? (r.exact_index.stale_reason || "fresh") + ` · ${r.exact_index.blocks} blocks` : "disconnected") : "—";
      return h("tr", { class: "replica", "data-replica": r.url, "data-state": r.state },
        h("td", {}, r.url),
        h("td", { class: "state state-" + r.state }, r.state + (r.ejected_for_s > 0 ? ` (${r.ejected_for_s.toFixed(1)} s)` : "")),
        h("td", { class: "num" }, r.in_flight),
        h("td", { class: "num" }, fmt.num(r.waiting) + " / " + fmt.num(r.running)),
        h("td", {}, kv),
        h("td", { class: "num" }, fmt.pct(r.prefix_hit_rate)),
        h("td", {}, exact),
        h("td", { class: "num" }, r.metrics_age_s === null ? "—" : r.metrics_age_s.toFixed(1) + " s"));
    });
    return h("div", { class: "pool", id: "pool-" + p.name, "data-pool": p.name }, head, table(REPLICA_COLUMNS, rows));
  }));
}

function targetCell(value, target, what) {
  if (value === null || value === undefined) return h("td", { class: "num" }, "—");
  const over = target !== undefined && target !== null && value > target;
  return h("td", { class: "num " + (over ? "fail" : ""), title: what + (target ? "; target " + fmt.ms(target) + (over ? ": missed" : ": held") : "; no target set") },
    fmt.ms(value) + (target ? (over ? " ✗" : " ✓") : ""));
}

const CLASS_COLUMNS = [
  ["class", null, "traffic class (config traffic.classes)"],
  ["priority", "num", "lower is served first, in the gateway's queue and in the replicas' own"],
  ["queued / max", "num", "requests waiting in the gateway's queue / the queue's length per pool (one more gets a 429)"],
  ["in flight", "num", "requests of this class sent to replicas and not finished"],
  ["admitted", "num", "requests per second sent to a replica and answered"],
  ["429s", "num", "requests per second refused with 429 (queue full or shed), total since start in brackets"],
  ["TTFT P50", "num", "time to first token, median (streams)"], ["TTFT P95", "num", "time to first token, 95th percentile (streams)"],
  ["TPOT P50", "num", "time per output token after the first, median (streams)"], ["TPOT P95", "num", "time per output token, 95th percentile (streams)"],
  ["streams", "num", "streamed requests the percentiles are taken from"],
];

function renderClasses(classes, latency) {
  const box = document.getElementById("classes");
  const lat = (latency && latency.classes) || {};
  const rows = classes.map((c) => {
    const l = lat[c.name] || {};
    const ttft = l.ttft || {}, tpot = l.tpot || {};
    const t = c.targets_ms || {};
    const tt = t.ttft || {}, tp = t.tpot || {};
    return h("tr", { class: "traffic-class", "data-class": c.name },
      h("td", {}, c.name), h("td", { class: "num" }, c.priority),
      h("td", { class: "num" }, `${c.queued} / ${c.queue_length}`),
      h("td", { class: "num" }, c.in_flight),
      h("td", { class: "num" }, fmt.rate(l.admitted_per_s)),
      h("td", { class: "num" }, fmt.rate(l.r429_per_s) + (l.r429_total ? ` (${l.r429_total})` : "")),
      targetCell(ttft.p50_ms, tt.p50, "TTFT median"), targetCell(ttft.p95_ms, tt.p95, "TTFT 95th percentile"),
      targetCell(tpot.p50_ms, tp.p50, "TPOT median"), targetCell(tpot.p95_ms, tp.p95, "TPOT 95th percentile"),
      h("td", { class: "num mute" }, fmt.num(ttft.n)));
  });
  const span = !latency || !latency.enabled ? "metrics are off (telemetry.metrics: false): no latency" :
    latency.window_s === null ? "latency since the gateway started (the window fills while this page is open)" :
      `latency and rates over the last ${latency.window_s < 90 ? Math.round(latency.window_s) + " s" : (latency.window_s / 60).toFixed(1) + " min"}, from the gateway's own histograms`;
  box.replaceChildren(h("p", { class: "note", id: "latency-window" }, span), table(CLASS_COLUMNS, rows));
}

// ---------------------------------------------------------------------------------------------------------------
// History: small line charts drawn here as inline SVG from the points the gateway keeps (one every 5 s, 15 min).

const SVG = "http://www.w3.org/2000/svg";
const CHART_W = 200, CHART_H = 54;

function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) el.setAttribute(k, String(v));
  for (const c of children.flat()) if (c) el.appendChild(typeof c === "object" ? c : document.createTextNode(String(c)));
  return el;
}

function mergeHistory(view) {
  if (!view) return;
  kept.size = view.size;
  kept.every_s = view.every_s;
  const last = kept.points.length ? kept.points[kept.points.length - 1].t : -Infinity;
  for (const p of view.points) if (p.t > last) kept.points.push(p);
  const since = kept.points.length ? kept.points[kept.points.length - 1].t - HISTORY_S : 0;
  while (kept.points.length > kept.size || (kept.points.length && kept.points[0].t < since)) kept.points.shift();
}

// The charts' time axis: the points kept, at least a minute, at most 15 minutes (a young gateway's lines fill it).
function historySpan() {
  const pts = kept.points;
  return pts.length ? Math.min(HISTORY_S, Math.max(60, pts[pts.length - 1].t - pts[0].t)) : HISTORY_S;
}

// One chart: `series` = [[t, value or null]] over historySpan(); `target` a dashed line.
function chart({ id, title, tip, series, target, format, max }) {
  const now = kept.points.length ? kept.points[kept.points.length - 1].t : Date.now() / 1000;
  const span = historySpan();
  const values = series.map(([, v]) => v).filter((v) => v !== null && v !== undefined);
  const top = Math.max(max || 0, ...values, target || 0) * (max ? 1 : 1.15) || 1;
  const x = (t) => ((t - (now - span)) / span) * CHART_W;
  const y = (v) => CHART_H - 2 - (v / top) * (CHART_H - 4);
  // the line, broken where a point has no value; a value alone between gaps is a dot
  let d = "", run = [];
  const dots = [];
  const flush = () => {
    if (run.length === 1) dots.push(svg("circle", { cx: run[0][0], cy: run[0][1], r: 1.8, class: "chart-dot" }));
    else if (run.length) d += run.map(([px, py], i) => `${i ? "L" : "M"}${px},${py}`).join("");
    run = [];
  };
  for (const [t, v] of series) {
    if (v === null || v === undefined) flush();
    else run.push([x(t).toFixed(1), y(v).toFixed(1)]);
  }
  flush();
  const latest = values.length ? series.filter(([, v]) => v !== null && v !== undefined).pop()[1] : null;
  const over = target && latest !== null && latest > target;
  const chartTip = `${tip}. The last ${spanText(span)} (up to 15 min kept), one point every ${kept.every_s} s` + (target ? `; dashed: the target, ${format(target)}` : "") + `; top of the chart ${format(top)}.`;
  const picture = svg("svg", { class: "chart", viewBox: `0 0 ${CHART_W} ${CHART_H}`, width: CHART_W, height: CHART_H,
    "data-series": id, "data-points": values.length, role: "img", "aria-label": title },
    svg("title", {}, chartTip),
    svg("rect", { x: 0, y: 0, width: CHART_W, height: CHART_H, class: "chart-bg" }),
    target ? svg("line", { x1: 0, x2: CHART_W, y1: y(target), y2: y(target), class: "chart-target" }) : null,
    d ? svg("path", { d, class: "chart-line" }) : null, dots);
  return h("div", { class: "chart-card", title: chartTip, "data-chart": id },
    h("div", { class: "chart-head" }, h("span", {}, title),
      h("span", { class: "chart-value " + (over ? "fail" : ""), title: "the newest point" + (target ? (over ? ", above the target" : ", within the target") : "") }, latest === null ? "—" : format(latest))),
    picture);
}

function spanText(s) { return s < 90 ? Math.round(s) + " s" : (s / 60).toFixed(s < 600 ? 1 : 0) + " min"; }

function renderHistory(classes) {
  const box = document.getElementById("history");
  const newest = kept.points.length ? kept.points[kept.points.length - 1].t : null;
  if (newest === kept.drawn && box.childElementCount) return;  // nothing new since the last drawing
  kept.drawn = newest;
  if (!kept.points.length) { box.replaceChildren(h("p", { class: "mute", id: "history-empty" }, "The first points come within 5 s.")); return; }
  const pts = kept.points;
  const pick = (group, name, field) => pts.map((p) => [p.t, ((p[group] || {})[name] || {})[field] ?? null]);
  const classNames = classes.map((c) => c.name);
  const poolNames = [...new Set(pts.flatMap((p) => Object.keys(p.pools || {})))];
  const targets = Object.fromEntries(classes.map((c) => [c.name, c.targets_ms || {}]));
  const pct = (v) => (100 * v).toFixed(0) + "%";
  const count = (v) => (Number.isInteger(v) ? String(v) : v.toFixed(1));
  const rows = classNames.map((name) => h("div", { class: "chart-row", "data-class": name },
    h("div", { class: "chart-label", title: "traffic class" }, name),
    chart({ id: `${name}-ttft`, title: "TTFT p95", tip: `Class ${name}: time to first token, 95th percentile over the minute before each point (streams)`,
      series: pick("classes", name, "ttft_p95_ms"), target: (targets[name].ttft || {}).p95, format: fmt.ms }),
    chart({ id: `${name}-tpot`, title: "TPOT p95", tip: `Class ${name}: time per output token after the first, 95th percentile over the minute before each point (streams)`,
      series: pick("classes", name, "tpot_p95_ms"), target: (targets[name].tpot || {}).p95, format: fmt.ms }),
    chart({ id: `${name}-admitted`, title: "admitted", tip: `Class ${name}: requests per second sent to a replica and answered, over the minute before each point`,
      series: pick("classes", name, "admitted_per_s"), format: fmt.rate })));
  const poolRows = poolNames.map((name) => h("div", { class: "chart-row", "data-pool": name },
    h("div", { class: "chart-label", title: "pool" }, name),
    chart({ id: `${name}-in-flight`, title: "in flight", tip: `Pool ${name}: requests in flight at its replicas at each point`,
      series: pick("pools", name, "in_flight"), format: count }),
    chart({ id: `${name}-kv`, title: "KV use", tip: `Pool ${name}: share of KV-cache blocks in use, mean over its replicas, at each point`,
      series: pick("pools", name, "kv_use"), format: pct, max: 1 })));
  const legend = h("div", { class: "legend chart-legend" },
    h("span", { title: "the measured value" }, h("i", { class: "key-line" }), "value"),
    h("span", { title: "the class's target (traffic.classes.*.targets)" }, h("i", { class: "key-target" }), "target"),
    h("span", { class: "mute", title: "the charts' time axis: the points the gateway keeps, up to 15 minutes" },
      `time axis: the last ${spanText(historySpan())} → now`));
  box.replaceChildren(legend,
    h("div", { class: "chart-group", id: "history-classes" },
      h("h4", { title: "from the gateway's own latency histograms and request counts" }, "per traffic class"), ...rows),
    h("div", { class: "chart-group", id: "history-pools" },
      h("h4", { title: "from the gateway's in-flight counts and the replicas' scraped metrics" }, "per pool"), ...poolRows));
}

// ---------------------------------------------------------------------------------------------------------------

function stageClass(name) { return "s-" + name.replace(/[^a-z]+/g, "-").replace(/-$/, ""); }

const STAGE_TIPS = {
  "gateway": "the gateway's own work: reading the body, classifying, choosing the pool and replica",
  "gateway queue": "waiting in the gateway's admission queue for the class's turn",
  "dispatch": "sending the request to the replica",
  "engine queue + prefill": "at the replica until the first token: its queue and the prompt's prefill",
  "engine queue": "in the replica's queue (from its engine spans)",
  "prefill": "the prompt's prefill at the replica (from its engine spans)",
  "decode": "the first token to the last (or to the replica's failure, when the stream was resumed elsewhere)",
  "resumed decode": "after its replica failed mid-stream: resumed on another replica, to the last token",
};

function renderRecent(recent) {
  const box = document.getElementById("recent");
  if (!recent.length) { box.replaceChildren(h("p", { class: "mute", id: "recent-empty" }, "No request has finished since this page opened.")); return; }
  const scale = Math.max(...recent.map((r) => r.total_ms), 1);
  const names = new Set();
  const rows = recent.map((r) => {
    const bars = r.stages.map((s) => {
      names.add(s.stage);
      return h("span", { class: stageClass(s.stage), title: `${s.stage}: ${fmt.ms(s.ms)}`,
        style: { left: `${(100 * s.start_ms / scale).toFixed(2)}%`, width: `${Math.max(0.3, 100 * s.ms / scale).toFixed(2)}%` } });
    });
    const status = r.error ? `${r.status} ${r.error}` : String(r.status);
    return h("tr", { class: "recent-request", "data-status": r.status, "data-pool": r.pool || "" },
      h("td", {}, fmt.time(r.at)), h("td", {}, r.class || "—"), h("td", {}, r.pool || "—"),
      h("td", { class: r.status >= 400 ? "error" : "" }, status),
      h("td", { class: "num" }, fmt.num(r.prompt_tokens) + " → " + fmt.num(r.output_tokens)),
      h("td", { class: "num" }, fmt.ms(r.total_ms)),
      h("td", { class: "wf-cell" }, h("div", { class: "wf waterfall" }, bars)));
  });
  const legend = h("div", { class: "legend" }, [...names].map((n) => h("span", { title: STAGE_TIPS[n] || n }, h("i", { class: stageClass(n) }), n)));
  box.replaceChildren(legend, table([["at", null, "when the request arrived"], ["class", null, "its traffic class"],
    ["pool", null, "the pool that answered"], ["status", null, "the HTTP status the client got (499: the client left)"],
    ["tokens in → out", "num", "prompt tokens (the replica's count, else the gateway's estimate) → output tokens"],
    ["total", "num", "arrival to last byte"], ["waterfall", null, "its stages on a common time scale; hover a bar for its stage"]], rows));
}

const SESSION_COLUMNS = [
  ["session", null, "the session id, hashed"], ["state", null, "open, or ended (idle too long or closed by the client)"],
  ["found by", null, "how the gateway knew the session: a header, the body, a tool-call id or the history"],
  ["turns", "num", "requests in the session"], ["task", "num", "first arrival to the last answer"],
  ["model", "num", "time the model spent answering"],
  ["tools (waits)", "num", "time the agent spent running tools between turns (number of waits)"],
  ["think (waits)", "num", "time the user spent before the next message (number of waits)"],
  ["cached", "num", "share of prompt tokens served from the replicas' prefix cache"],
  ["warm / cold", "num", "turns mostly served from the prefix cache / mostly computed"],
];

function renderSessions(data) {
  const box = document.getElementById("sessions");
  if (!data) { box.replaceChildren(h("p", { class: "mute" }, "Session tracking is off (sessions.enabled: false).")); return; }
  // {open: [...], recent: [...]} (ids hashed, no prompt text), newest first
  const sessions = [...(data.open || []), ...(data.recent || [])];
  if (!sessions.length) { box.replaceChildren(h("p", { class: "mute" }, "No recent agent sessions.")); return; }
  const secs = (v) => (v == null ? "–" : `${Number(v).toFixed(v < 10 ? 2 : 0)} s`);
  const share = (v) => (v == null ? "–" : `${Math.round(v * 100)}%`);
  const rows = sessions.slice(0, 30).map((s) => h("tr", { class: "agent-session" }, [
    h("td", {}, s.id), h("td", {}, s.state), h("td", {}, s.id_source), h("td", { class: "num" }, String(s.turns)),
    h("td", { class: "num" }, secs(s.task_s)), h("td", { class: "num" }, secs(s.model_s)),
    h("td", { class: "num" }, `${secs(s.tool_s)} (${s.tool_waits})`), h("td", { class: "num" }, `${secs(s.think_s)} (${s.think_waits})`),
    h("td", { class: "num" }, share(s.cached_share)), h("td", { class: "num" }, `${s.warm_turns} / ${s.cold_turns}`),
  ]));
  box.replaceChildren(h("p", { class: "mute", title: "sessions open now (the table also lists recently ended ones)" },
    `${data.open_sessions ?? (data.open || []).length} open`), table(SESSION_COLUMNS, rows));
}

const BATCH_COLUMNS = [
  ["batch", null, "the batch id"], ["owner", null, "the API key that created it"], ["status", null, "validating, in_progress, finalizing or cancelling"],
  ["done", "num", "lines finished (completed + failed) of the total"], ["lines/s", "num", "over the last minute"],
  ["predicted finish", "num", "when the lines left end at the current rate"], ["deadline", "num", "the end of its completion window"],
  ["share step", "num", "raised while the job is predicted to miss its deadline (at risk: marked), lowered once back on track"],
];

function renderBatch(jobs) {
  const box = document.getElementById("batch");
  if (!jobs) { box.replaceChildren(h("p", { class: "mute" }, "The Batch API is off (batch.enabled: false).")); return; }
  if (!jobs.length) { box.replaceChildren(h("p", { class: "mute" }, "No active batch jobs.")); return; }
  const when = (t) => (t == null ? "–" : fmt.time(t));
  const rows = jobs.map((j) => h("tr", { class: "batch-job" }, [
    h("td", {}, j.id), h("td", {}, j.owner || "—"), h("td", {}, j.status),
    h("td", { class: "num" }, `${fmt.num(j.completed + j.failed)} / ${fmt.num(j.total)}`),
    h("td", { class: "num" }, String(j.lines_per_s)),
    h("td", { class: j.predicted_finish && j.predicted_finish > j.expires_at ? "num error" : "num" }, when(j.predicted_finish)),
    h("td", { class: "num" }, when(j.expires_at)),
    h("td", { class: j.at_risk ? "num error" : "num" }, `${j.share_step ?? 0}${j.at_risk ? " at risk" : ""}`),
  ]));
  box.replaceChildren(table(BATCH_COLUMNS, rows));
}

// ---------------------------------------------------------------------------------------------------------------

// Whether this client may read /ui/state, and with which key: GET /ui/access answers 200 either way.
async function access(key) {
  const r = await fetch("/ui/access", { headers: authHeaders(key), cache: "no-store" });
  if (!r.ok) throw new Error("HTTP " + r.status);
  return r.json();
}

async function unlock(key) {
  try {
    const a = await access(key);
    if (a.allowed) {
      if (a.key_needed && key) sessionStorage.setItem(KEY, key);
      if (!a.key_needed) sessionStorage.removeItem(KEY);
      poll();
      return;
    }
    sessionStorage.removeItem(KEY);
    if (a.key_needed) { showLogin(a.message || ""); return; }
    const denied = document.getElementById("denied");  // no key can open it from here
    denied.textContent = a.message || "The status page is not open to this client.";
    denied.hidden = false;
    setLive("closed", "stale", denied.textContent);
  } catch (e) {
    setLive("gateway unreachable", "stale", String(e));
    timer = setTimeout(() => unlock(sessionStorage.getItem(KEY)), 2000);
  }
}

async function poll() {
  timer = null;
  let interval = 2000;
  try {
    const since = kept.points.length ? "?history_since=" + kept.points[kept.points.length - 1].t : "";
    const r = await fetch("/ui/state" + since, { headers: authHeaders(), cache: "no-store" });
    if (r.status === 401 || r.status === 403) {  // the key changed under us (a config reload): ask again
      sessionStorage.removeItem(KEY);
      unlock(null);
      return;
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    const s = await r.json();
    failures = 0;
    document.getElementById("login").hidden = true;
    document.getElementById("main").hidden = false;
    document.getElementById("forget-key").hidden = !sessionStorage.getItem(KEY);
    document.getElementById("model").textContent = s.model;
    mergeHistory(s.history);
    renderReload(s.reload);
    renderPools(s.pools);
    renderClasses(s.classes, s.latency);
    renderHistory(s.classes);
    renderRecent(s.recent);
    renderSessions(s.sessions);
    renderBatch(s.batch);
    interval = Math.max(500, Math.min(2000, 500 * s.health_interval_s));
    setLive("live", "live", `redrawn every ${(interval / 1000).toFixed(1)} s from GET /ui/state`);
    const updated = document.getElementById("updated");
    updated.textContent = "updated " + fmt.time(s.at);
    updated.title = "the gateway's clock at the last poll";
  } catch (e) {
    if (!(e instanceof TypeError && /fetch/i.test(e.message))) console.warn("m3gate ui:", e);
    failures += 1;
    setLive(failures > 1 ? "gateway unreachable" : "retrying", "stale", String(e));
  }
  if (!document.hidden) timer = setTimeout(poll, interval);
}

function start() {
  document.getElementById("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = document.getElementById("key").value.trim();
    if (!key) return;
    document.getElementById("key").value = "";
    if (timer) clearTimeout(timer);
    unlock(key);
  });
  document.getElementById("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    if (timer) clearTimeout(timer);
    timer = null;
    showLogin("");
  });
  // A hidden tab stops polling (the gateway then keeps nothing for the page); it resumes when shown.
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) { if (timer) clearTimeout(timer); timer = null; }
    else if (!timer && !document.getElementById("main").hidden) poll();
  });
  unlock(sessionStorage.getItem(KEY));
}

start();
