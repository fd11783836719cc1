// Converge dashboard: renders /api/state, then every `state` server-sent event of
// /api/events. No dependencies; every chart is plain SVG.
"use strict";

const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) =>
  ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
// Significant digits without trailing zeros; tiny values (a curve's asymptote near 0) as ≈0.
const num = (x, digits = 3) => {
  if (x == null || !isFinite(x)) return "—";
  if (x !== 0 && Math.abs(x) < 1e-6) return "≈0";
  const a = Math.abs(x);
  if (a >= Math.pow(10, digits)) return Math.round(x).toLocaleString("en");
  return String(parseFloat(Number(x).toPrecision(digits)));
};
const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
// The allocator's sentences name the job and use "->": the row already names it.
const reasonText = (job, r) => String(r ?? "").replace(`job ${job}: `, "").replace(/ -> /g, " → ");
const int = (x) => (x == null ? "—" : Math.round(x).toLocaleString("en"));
const bytes = (b) => {
  if (b == null) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(b < 10 && i > 0 ? 1 : 0)} ${units[i]}`;
};
const rate = (b) => (b == null ? "—" : `${bytes(b)}/s`);
const ago = (s) => (s < 90 ? `${Math.round(s)} s ago` : s < 5400 ? `${Math.round(s / 60)} min ago` : `${(s / 3600).toFixed(1)} h ago`);
const clock = (t) => new Date(t * 1000).toLocaleTimeString("en-GB");
const inS = (s) => (s <= 1 ? "now" : s < 90 ? `in ${Math.round(s)} s` : s < 5400 ? `in ${Math.round(s / 60)} min` : `in ${(s / 3600).toFixed(1)} h`);

let rendered = false;

function renderSummary(st) {
  const c = st.cluster;
  const phases = Object.entries(c.jobs_by_phase).map(([p, n]) => `${n} ${p}`).join(", ") || "no jobs";
  document.getElementById("summary").textContent =
    `GPUs ${c.gpus_busy}/${c.gpus_total} busy · hosts ${c.hosts_live} live` +
    (c.hosts_lost ? `, ${c.hosts_lost} lost` : "") + ` · jobs: ${phases}` +
    (st.refused ? ` · ${st.refused} unreadable messages skipped` : "");
}

function renderHosts(st) {
  const rows = st.hosts.map((h) => {
    const util = Math.max(0, Math.min(100, h.gpu_utilization_pct));
    const gpus = h.gpus.map((g) =>
      `<span title="GPU ${g.index} (${esc(g.name)}): ${num(g.utilization_pct, 3)} %, ${bytes(g.memory_used_bytes)} of ${bytes(g.memory_total_bytes)}` +
      (g.power_w != null ? `, ${num(g.power_w, 3)} W` : "") + (g.job ? `, job ${esc(g.job)}` : ", idle") +
      `">${g.utilization_pct > 0 ? "▮" : "▯"}</span>`).join("");
    const labels = Object.entries(h.labels || {}).map(([k, v]) => `${k}=${v}`).join("\n");
    return `<tr data-host="${esc(h.host)}" class="${h.lost ? "lost" : ""}">
      <th scope="row" title="${esc(h.addr)} · GPUs from ${esc(h.gpu_source)}${labels ? `\nlabels:\n${esc(labels)}` : ""}">${esc(h.host)}</th>
      <td data-field="state">${h.lost ? "lost" : "live"}</td>
      <td data-field="gpus" class="num">${h.gpus_busy}/${h.gpus_total}</td>
      <td><span class="bar" aria-hidden="true"><span style="width:${util}%"></span></span>${util.toFixed(0)} %</td>
      <td>${bytes(h.gpu_memory_used_bytes)} / ${bytes(h.gpu_memory_total_bytes)}</td>
      <td class="gpus">${gpus}</td>
      <td>${rate(h.rx_bytes_per_s)} / ${rate(h.tx_bytes_per_s)}</td>
      <td class="num">${h.workers}</td>
      <td>${ago(h.age_s)}</td></tr>`;
  });
  document.querySelector("#hosts tbody").innerHTML =
    rows.join("") || `<tr><td colspan="9">No host has reported yet.</td></tr>`;
}

// A queue nobody uses: the implicit default with no job, no GPU and no job counted.
const unusedDefault = (q) => q.name === "default" && !q.active_jobs && !q.gpus_in_use &&
  !q.running_jobs && !q.pending_jobs;

function renderQueues(st) {
  const queues = st.queues || [];
  const section = document.getElementById("queues-section");
  // Shown once some queue is more than an unused default queue.
  section.hidden = queues.every(unusedDefault);
  if (section.hidden) return;
  const rows = queues.map((q) => {
    const known = q.updated_at != null;
    const share = known ? `${q.gpus_in_use} / ${num(q.fair_share_gpus, 3)}` : "—";
    const jobs = known ? `${q.running_jobs} / ${q.pending_jobs}` : "—";
    const usage = known ? `${num(q.usage_gpu_seconds / 3600, 3)}` : "—";
    const title = known ? `allocator's figures of ${clock(q.updated_at)}; usage half-life ${num(q.half_life_s / 3600, 3)} h`
      : "no figures from the allocator yet";
    return `<tr data-queue="${esc(q.name)}" title="${esc(title)}">
      <th scope="row">${esc(q.name)}${q.implicit ? ` <small title="nobody created it: quota 0, no borrowing limit, weight 1">(implicit)</small>` : ""}</th>
      <td data-field="quota" class="num">${q.quota_gpus}</td>
      <td data-field="limit" class="num">${q.borrowing_limit_gpus == null ? "unlimited" : q.borrowing_limit_gpus}</td>
      <td data-field="share" class="num">${share}</td>
      <td data-field="borrowed" class="num">${known ? q.borrowed_gpus : "—"}</td>
      <td data-field="lent" class="num">${known ? q.lent_gpus : "—"}</td>
      <td data-field="weight" class="num">${num(q.weight, 4)}</td>
      <td data-field="jobs" class="num">${jobs}</td>
      <td data-field="usage" class="num">${usage}</td></tr>`;
  });
  document.querySelector("#queues tbody").innerHTML = rows.join("");
}

function placementText(j) {
  const by = new Map();
  for (const p of j.placement) {
    if (!by.has(p.host)) by.set(p.host, []);
    by.get(p.host).push(...p.gpus);
  }
  return [...by].map(([h, g]) => `${h}:${g.join(",")}`).join(" ");
}

function waitText(j, now) {
  if (j.queue_position == null) return "—";
  const eta = j.estimated_start == null ? "start unknown" : `est. start ${inS(j.estimated_start - now)}`;
  return `#${j.queue_position} (${plural(j.gpus_needed, "GPU")}), ${eta}`;
}

function whyText(j) {
  const last = j.allocations.length ? j.allocations[j.allocations.length - 1] : null;
  if (j.end) {
    return `ended: ${j.end.reason.replace("_", " ")}, ${num(j.end.gpu_hours, 3)} GPU-hours`;
  }
  return j.message || (last ? reasonText(j.job, last.reason) : "");
}

function renderJobs(st) {
  const rows = st.jobs.map((j) => {
    const b = j.batch && j.batch.plan ? `${j.batch.plan.total} (${j.batch.plan.per_worker}×${j.batch.plan.accum_steps})` : "—";
    const workers = j.max_workers != null ? `${j.min_workers}–${j.max_workers}` : `≥${j.min_workers}`;
    return `<tr data-job="${esc(j.job)}">
      <th scope="row">${esc(j.job)}${j.sweep ? `<br><small>sweep ${esc(j.sweep)}</small>` : ""}${Object.keys(j.selector || {}).length ? `<br><small>on ${esc(Object.entries(j.selector).map(([k, v]) => `${k}=${v}`).join(", "))}</small>` : ""}${j.gpu_types ? `<br><small>GPU type ${esc(j.gpu_types.join(" or "))}</small>` : ""}</th>
      <td data-field="phase" class="phase ${esc(j.phase)}">${esc(j.phase)}</td>
      <td data-field="queue">${esc(j.queue)} · <span class="prio ${esc(j.priority)}">${esc(j.priority)}</span></td>
      <td data-field="workers" class="num" title="allowed ${workers}">${j.workers}</td>
      <td data-field="generation" class="num">${j.generation}</td>
      <td class="wrap">${esc(placementText(j)) || "—"}</td>
      <td>${b}</td>
      <td class="num">${num(j.samples_per_s, 4)}${j.sync_rounds_per_s != null || j.model_gap != null ? `<br><small title="shadow job: background sync rounds per second, model gap">sync ${num(j.sync_rounds_per_s, 3)}/s, gap ${num(j.model_gap, 3)}</small>` : ""}</td>
      <td class="num">${num(j.loss, 4)}</td>
      <td class="num">${num(j.predicted_loss, 4)}</td>
      <td data-field="wait" class="wrap">${esc(waitText(j, st.generated_at))}</td>
      <td class="why">${esc(whyText(j))}</td></tr>`;
  });
  document.querySelector("#jobs tbody").innerHTML =
    rows.join("") || `<tr><td colspan="12">No jobs. Submit one with <code>converge submit</code>.</td></tr>`;
}

// Linear scale helpers.
const scale = (d0, d1, r0, r1) => (v) => (d1 === d0 ? (r0 + r1) / 2 : r0 + ((v - d0) * (r1 - r0)) / (d1 - d0));
function ticks(lo, hi, n) {
  if (!(hi > lo)) return [lo];
  const step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
  const err = (hi - lo) / n / step;
  const s = step * (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1);
  const out = [];
  for (let v = Math.ceil(lo / s) * s; v <= hi + 1e-9 * s; v += s) out.push(v);
  return out;
}
const short = (v) => {
  const a = Math.abs(v);
  return a >= 1e9 ? `${+(v / 1e9).toFixed(1)}G` : a >= 1e6 ? `${+(v / 1e6).toFixed(1)}M` : a >= 1e3 ? `${+(v / 1e3).toFixed(1)}k` : `${+v.toPrecision(3)}`;
};
const path = (pts, x, y) => pts.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join("");

function curveSvg(j) {
  const c = j.curve;
  const W = 320, H = 170, L = 44, R = 8, T = 8, B = 24;
  const xs = c.points.map((p) => p[0]).concat(c.fit.map((p) => p[0]), c.ahead.map((p) => p.samples));
  const ys = c.points.map((p) => p[1]).concat(c.fit.map((p) => p[1]), c.ahead.map((p) => p.low), c.ahead.map((p) => p.high));
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  const pad = (y1 - y0) * 0.05 || 0.05; y0 = Math.max(0, y0 - pad); y1 += pad;
  const x = scale(x0, x1, L, W - R), y = scale(y0, y1, H - B, T);
  const grid = ticks(y0, y1, 4).map((v) => `<line class="grid" x1="${L}" x2="${W - R}" y1="${y(v).toFixed(1)}" y2="${y(v).toFixed(1)}"/><text x="${L - 4}" y="${(y(v) + 3).toFixed(1)}" text-anchor="end">${short(v)}</text>`).join("");
  const xt = ticks(x0, x1, 4).map((v) => `<text x="${x(v).toFixed(1)}" y="${H - B + 12}" text-anchor="middle">${short(v)}</text>`).join("");
  const band = c.ahead.length ? c.ahead.map((p, i) => `${i ? "L" : "M"}${x(p.samples).toFixed(1)},${y(p.high).toFixed(1)}`).join("") +
    c.ahead.slice().reverse().map((p) => `L${x(p.samples).toFixed(1)},${y(p.low).toFixed(1)}`).join("") + "Z" : "";
  const dots = c.points.length <= 80 ? c.points.map((p) => `<circle class="dot" r="1.6" cx="${x(p[0]).toFixed(1)}" cy="${y(p[1]).toFixed(1)}"/>`).join("") : "";
  const restarts = c.restarts.map(([s, g]) => `<line class="restart" x1="${x(s).toFixed(1)}" x2="${x(s).toFixed(1)}" y1="${T}" y2="${H - B}"><title>generation ${g} starts</title></line><text x="${(x(s) + 2).toFixed(1)}" y="${T + 9}">g${g}</text>`).join("");
  const asym = c.asymptote >= y0 && c.asymptote <= y1 ? `<line class="asymptote" x1="${L}" x2="${W - R}" y1="${y(c.asymptote).toFixed(1)}" y2="${y(c.asymptote).toFixed(1)}"><title>asymptote ${num(c.asymptote, 4)}</title></line>` : "";
  return `<svg viewBox="0 0 ${W} ${H}" width="100%" data-curve="${esc(j.job)}" role="img" aria-label="Loss of ${esc(j.job)} against samples">
    ${grid}${xt}<path class="axis" d="M${L},${T}V${H - B}H${W - R}"/>
    <text x="${W - R}" y="${H - 2}" text-anchor="end">samples</text>
    ${band ? `<path class="band" d="${band}"><title>p90 band of measured prediction errors</title></path>` : ""}
    ${asym}<path class="observed" d="${path(c.points, x, y)}"><title>reported loss</title></path>${dots}
    <path class="fit" d="${path(c.fit, x, y)}"><title>fitted ${esc(c.family)} curve, rmse ${num(c.rmse, 3)}</title></path>
    ${c.ahead.length ? `<path class="prediction" d="${path(c.ahead.map((p) => [p.samples, p.loss]), x, y)}"><title>prediction ahead</title></path>` : ""}
    ${restarts}</svg>`;
}

function renderCurves(st) {
  const cards = st.jobs.filter((j) => j.curve).map((j) => `<div class="card">
      <h3>${esc(j.job)} <small class="phase ${esc(j.phase)}">${esc(j.phase)} · ${plural(j.workers, "worker")}</small></h3>
      ${curveSvg(j)}
      <p>loss ${num(j.loss, 4)} · asymptote ${num(j.curve.asymptote, 4)} · ${esc(j.curve.family)} fit, rmse ${num(j.curve.rmse, 2)}${j.curve.ahead.length ? ` · prediction drawn ${plural(j.curve.ahead.length ? Math.round(j.curve.ahead[j.curve.ahead.length - 1].samples - j.curve.ahead[0].samples) : 0, "sample")} ahead` : " · ended: no prediction"}</p></div>`);
  const waiting = st.jobs.filter((j) => !j.curve && (j.phase === "running" || j.phase === "restarting")).map((j) => j.job);
  document.getElementById("curves").innerHTML = cards.join("") +
    (waiting.length ? `<p class="legend">No curve fitted yet (fewer than 5 reports): ${waiting.map(esc).join(", ")}</p>` : "") +
    (!cards.length && !waiting.length ? `<p class="legend">No curves yet.</p>` : "");
}

// Clock ticks at whole steps of 1 s up to 1 day, about n of them.
function timeTicks(t0, t1, n) {
  const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
  const step = steps.find((s) => (t1 - t0) / s <= n) ?? 86400;
  const out = [];
  for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) out.push(t);
  return out;
}

// Most lanes drawn: active jobs first, then the most recently ended.
const MAX_LANES = 40;

function renderTimeline(st) {
  const svg = document.getElementById("timeline");
  const changesTable = document.getElementById("changes");
  const jobs = st.jobs.filter((j) => j.allocations.length).slice(0, MAX_LANES);
  const now = st.generated_at;
  const W = Math.max(600, svg.clientWidth || 900), lane = 24, L = 160, R = 40, T = 6, axis = 18;
  const H = T + Math.max(1, jobs.length) * lane + axis;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("height", H);
  if (!jobs.length) {
    svg.setAttribute("height", 40);
    svg.setAttribute("viewBox", `0 0 ${W} 40`);
    svg.innerHTML = `<text x="12" y="24" style="font-size:14px">No allocation changes yet: jobs appear here once the allocator places them.</text>`;
    changesTable.classList.add("empty");
    return;
  }
  changesTable.classList.remove("empty");
  const t0 = Math.min(...jobs.map((j) => j.allocations[0].time));
  const x = scale(t0, Math.max(now, t0 + 1), L, W - R);
  const maxW = Math.max(1, ...jobs.flatMap((j) => j.allocations.map((a) => a.workers)));
  const bottom = T + jobs.length * lane;
  let out = timeTicks(t0, now, 6).map((t) => `<line class="grid" x1="${x(t).toFixed(1)}" x2="${x(t).toFixed(1)}" y1="${T}" y2="${bottom}"/><text x="${x(t).toFixed(1)}" y="${bottom + 13}" text-anchor="middle">${clock(t)}</text>`).join("");
  const changes = [];
  jobs.forEach((j, i) => {
    const top = T + i * lane, h = lane - 4;
    out += `<rect class="lane" x="${L}" y="${top}" width="${W - R - L}" height="${h}"/><text x="${L - 6}" y="${top + h - 6}" text-anchor="end">${esc(j.job)}</text>`;
    const end = j.finished_at ?? now;
    j.allocations.forEach((a, k) => {
      const next = k + 1 < j.allocations.length ? j.allocations[k + 1].time : end;
      if (a.workers > 0) {
        const bh = Math.max(5, (h * a.workers) / maxW);
        out += `<rect class="alloc" x="${x(a.time).toFixed(1)}" y="${(top + h - bh).toFixed(1)}" width="${Math.max(1, x(next) - x(a.time)).toFixed(1)}" height="${bh.toFixed(1)}"><title>${esc(j.job)}: ${plural(a.workers, "worker")} on ${plural(a.hosts, "host")} (generation ${a.generation})</title></rect>`;
      }
      const glyph = a.workers === 0 ? "✕" : "▲";
      out += `<text class="change ${a.cause === "host_lost" ? "lost" : ""}" x="${x(a.time).toFixed(1)}" y="${top + 11}" text-anchor="middle">${glyph}<title>${esc(clock(a.time))} ${esc(reasonText(j.job, a.reason))}</title></text>`;
      changes.push({ job: j.job, a });
    });
  });
  svg.innerHTML = out;
  changes.sort((p, q) => q.a.time - p.a.time);
  changesTable.querySelector("tbody").innerHTML = changes.slice(0, 30).map(({ job, a }) =>
    `<tr><td>${clock(a.time)}</td><td>${esc(job)}</td><td class="num">${a.from_workers} → ${a.workers}</td><td>${esc(a.cause.replace("_", " "))}</td><td class="why">${esc(reasonText(job, a.reason))}</td></tr>`).join("");
}

function render(st) {
  if (rendered && +document.body.dataset.version >= st.version) return;
  renderSummary(st);
  renderHosts(st);
  renderQueues(st);
  renderJobs(st);
  renderTimeline(st);
  renderCurves(st);
  document.body.dataset.version = st.version;
  if (!rendered) {
    rendered = true;
    document.body.dataset.firstRenderMs = performance.now().toFixed(1);
    document.body.dataset.ready = "1";
  }
}

function setConnection(live) {
  const c = document.getElementById("connection");
  c.textContent = live ? "live" : "reconnecting…";
  c.className = `conn ${live ? "live" : "down"}`;
}

function connect() {
  const es = new EventSource("/api/events");
  es.addEventListener("open", () => setConnection(true));
  es.addEventListener("error", () => setConnection(false));
  es.addEventListener("state", (e) => {
    setConnection(true);
    try { render(JSON.parse(e.data)); } catch (err) { console.error("bad state event", err); }
  });
}

fetch("/api/state", { cache: "no-store" })
  .then((r) => (r.ok ? r.json() : null))
  .then((st) => { if (st) render(st); })
  .catch(() => {})
  .finally(connect);
