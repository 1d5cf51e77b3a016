// m3gate status page: polls /ui/state (and /admin/sessions when the gateway has it) and redraws. No libraries,
// no build step. The admin key lives in sessionStorage and goes only in the Authorization header.
"use strict";

const KEY = "m3gate.adminKey";
let timer = null;
let sessionsAvailable = true;
let failures = 0;

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

function table(headers, rows, attrs) {
  return h("table", attrs || {},
    h("thead", {}, h("tr", {}, headers.map(([label, cls]) => h("th", { class: cls || null }, label)))),
    h("tbody", {}, rows));
}

function authHeaders() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: "Bearer " + key } : {};
}

function showLogin(message) {
  document.getElementById("main").hidden = true;
  document.getElementById("login").hidden = false;
  document.getElementById("forget-key").hidden = true;
  document.getElementById("login-error").textContent = message || "";
  setLive("locked", "");
}

function setLive(text, cls) {
  const live = document.getElementById("live");
  live.textContent = text;
  live.className = "badge " + cls;
}

// ---------------------------------------------------------------------------------------------------------------

function renderReload(r) {
  const box = document.getElementById("reload");
  if (!r) { box.replaceChildren(h("span", { class: "mute" }, "config given in memory")); return; }
  const head = h("div", { id: "reload-status", "data-ok": String(r.ok) },
    h("span", { class: r.ok ? "ok" : "error" }, r.ok ? "OK" : "REJECTED"), " — ", r.message, " ",
    h("span", { class: "mute" }, "at " + fmt.time(r.at) + ` · ${r.successes} applied, ${r.failures} rejected`));
  const problems = (r.problems || []).map((p) => h("pre", { class: r.ok ? "mute" : "error reload-problem" }, p));
  box.replaceChildren(head, ...problems);
}

function renderPools(pools) {
  const box = document.getElementById("pools");
  box.replaceChildren(...pools.map((p) => {
    const head = h("div", { class: "pool-head" },
      h("h3", {}, p.name),
      h("span", {}, "ceiling " + fmt.tokens(p.max_model_len) + " tokens"),
      h("span", {}, "class " + p.class),
      h("span", {}, `${p.available}/${p.replicas.length} available` + (p.launch_replicas ? ` (launch: ${p.launch_replicas})` : "")),
      ...(p.capacity || []).map((c) => h("span", { class: "capacity", "data-role": c.role, "data-desired": String(c.desired) },
        (c.role === "both" ? "" : c.role + ": ") + (c.desired === null ? "sizing…" : `needs ${c.desired}`)
        + (c.desired !== null && c.bottleneck ? ` (${c.bottleneck.replace("_", " ")})` : ""))),
      h("span", { class: "mute" }, p.modalities.join(", ") + " · " + p.policy + (p.precise ? " · precise" : "")));
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
    return h("div", { class: "pool", id: "pool-" + p.name, "data-pool": p.name }, head,
      table([["replica"], ["state"], ["in flight", "num"], ["waiting / running", "num"], ["KV use"],
        ["prefix hits", "num"], ["exact index"], ["metrics age", "num"]], rows));
  }));
}

function targetCell(value, target) {
  if (value === null || value === undefined) return h("td", { class: "num" }, "—");
  const over = target !== undefined && target !== null && value > target;
  return h("td", { class: "num " + (over ? "fail" : ""), title: target ? "target " + fmt.ms(target) : null },
    fmt.ms(value) + (target ? (over ? " ✗" : " ✓") : ""));
}

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
      targetCell(ttft.p50_ms, tt.p50), targetCell(ttft.p95_ms, tt.p95),
      targetCell(tpot.p50_ms, tp.p50), targetCell(tpot.p95_ms, tp.p95),
      h("td", { class: "num mute" }, fmt.num(ttft.n)));
  });
  const span = !latency || !latency.enabled ? "metrics are off (telemetry.metrics: false): no latency" :
    latency.window_s === null ? "latency since the gateway started (the window fills while this page is open)" :
      `latency and rates over the last ${latency.window_s < 90 ? Math.round(latency.window_s) + " s" : (latency.window_s / 60).toFixed(1) + " min"}, from the gateway's own histograms`;
  box.replaceChildren(h("p", { class: "note", id: "latency-window" }, span),
    table([["class"], ["priority", "num"], ["queued / max", "num"], ["in flight", "num"], ["admitted", "num"],
      ["429s", "num"], ["TTFT P50", "num"], ["TTFT P95", "num"], ["TPOT P50", "num"], ["TPOT P95", "num"],
      ["streams", "num"]], rows));
}

function stageClass(name) { return "s-" + name.replace(/[^a-z]+/g, "-").replace(/-$/, ""); }

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
    return h("tr", { class: "recent-request", "data-status": r.status },
      h("td", {}, fmt.time(r.at)), h("td", {}, r.class || "—"), h("td", {}, r.pool || "—"),
      h("td", { class: r.status >= 400 ? "error" : "" }, status),
      h("td", { class: "num" }, fmt.num(r.prompt_tokens) + " → " + fmt.num(r.output_tokens)),
      h("td", { class: "num" }, fmt.ms(r.total_ms)),
      h("td", { class: "wf-cell" }, h("div", { class: "wf waterfall" }, bars)));
  });
  const legend = h("div", { class: "legend" }, [...names].map((n) => h("span", {}, h("i", { class: stageClass(n) }), n)));
  box.replaceChildren(legend, table([["at"], ["class"], ["pool"], ["status"], ["tokens in → out", "num"], ["total", "num"],
    ["waterfall"]], rows));
}

function renderSessions(data) {
  const box = document.getElementById("sessions");
  if (!data) { box.replaceChildren(); return; }
  // GET /admin/sessions: {open: [...], recent: [...]} (ids hashed, no prompt text), newest first
  const sessions = [...(data.open || []), ...(data.recent || [])];
  if (!sessions.length) { box.replaceChildren(h("p", { class: "mute" }, "No recent agent sessions.")); return; }
  const secs = (v) => (v == null ? "–" : `${Number(v).toFixed(v < 10 ? 2 : 0)} s`);
  const share = (v) => (v == null ? "–" : `${Math.round(v * 100)}%`);
  const rows = sessions.slice(0, 30).map((s) => h("tr", {}, [
    h("td", {}, s.id), h("td", {}, s.state), h("td", {}, s.id_source), h("td", { class: "num" }, String(s.turns)),
    h("td", { class: "num" }, secs(s.task_s)), h("td", { class: "num" }, secs(s.model_s)),
    h("td", { class: "num" }, `${secs(s.tool_s)} (${s.tool_waits})`), h("td", { class: "num" }, `${secs(s.think_s)} (${s.think_waits})`),
    h("td", { class: "num" }, share(s.cached_share)), h("td", { class: "num" }, `${s.warm_turns} / ${s.cold_turns}`),
  ]));
  const head = [`${data.open_sessions ?? (data.open || []).length} open`];
  box.replaceChildren(h("p", { class: "mute" }, head.join(" · ")),
    table([["session"], ["state"], ["found by"], ["turns", "num"], ["task", "num"], ["model", "num"],
      ["tools (waits)", "num"], ["think (waits)", "num"], ["cached", "num"], ["warm / cold", "num"]], rows));
}

// ---------------------------------------------------------------------------------------------------------------

async function fetchSessions(offered) {
  if (!offered || !sessionsAvailable) return null;
  try {
    const r = await fetch("/admin/sessions", { headers: authHeaders(), cache: "no-store" });
    if (r.status === 404) { sessionsAvailable = false; return null; }  // not in this build: the panel stays empty
    return r.ok ? await r.json() : null;
  } catch (e) { return null; }
}

async function poll() {
  let interval = 2000;
  try {
    const r = await fetch("/ui/state", { headers: authHeaders(), cache: "no-store" });
    if (r.status === 401 || r.status === 403) {
      const body = await r.json().catch(() => ({}));
      sessionStorage.removeItem(KEY);
      showLogin(sessionStorage.getItem(KEY + ".tried") ? ((body.error && body.error.message) || "refused") : "");
      return;  // no more polling until a key is entered
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    const s = await r.json();
    failures = 0;
    document.getElementById("login").hidden = true;
    document.getElementById("main").hidden = false;
    document.getElementById("forget-key").hidden = !sessionStorage.getItem(KEY);
    document.getElementById("model").textContent = s.model;
    renderReload(s.reload);
    renderPools(s.pools);
    renderClasses(s.classes, s.latency);
    renderRecent(s.recent);
    renderSessions(await fetchSessions(s.sessions_api));
    setLive("live", "live");
    document.getElementById("updated").textContent = "updated " + fmt.time(s.at);
    interval = Math.max(500, Math.min(2000, 500 * s.health_interval_s));
  } catch (e) {
    if (!(e instanceof TypeError && /fetch/i.test(e.message))) console.warn("m3gate ui:", e);
    failures += 1;
    setLive(failures > 1 ? "gateway unreachable" : "retrying", "stale");
  }
  timer = setTimeout(poll, interval);
}

function start() {
  document.getElementById("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = document.getElementById("key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    sessionStorage.setItem(KEY + ".tried", "1");
    document.getElementById("key").value = "";
    if (timer) clearTimeout(timer);
    poll();
  });
  document.getElementById("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    sessionStorage.removeItem(KEY + ".tried");
    if (timer) clearTimeout(timer);
    showLogin("");
  });
  // A hidden tab stops polling (the gateway then keeps nothing for the page); it resumes when shown.
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) { if (timer) clearTimeout(timer); timer = null; }
    else if (!timer) poll();
  });
  poll();
}

start();
