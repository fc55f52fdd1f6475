// Watching a job (polled once a second): progress and time left, live curves (drawn as SVG here, nothing fetched
// from elsewhere), validation pictures, the log's tail, its report, a sweep's members, an evaluation's table.
"use strict";

const watching = { id: null, member: "", offset: 0, series: new Map(), timer: null, busy: false };
const COLORS = ["#2f5fd0", "#d0462f", "#1a7f37", "#9a6700", "#7c3aed", "#0e7490", "#be185d", "#4b5563"];
// Logged numbers that are bookkeeping rather than measures.
const SKIP = new Set(["step", "seconds", "data_seconds"]);

function svgEl(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function fmt(v) {
  if (!isFinite(v)) return String(v);
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : Number(v.toPrecision(4)).toString();
}

// A line chart of several series ({name, points: [[x, y], ...]}) with its bounds written on the axes.
function chart(title, series, width = 360, height = 180) {
  const pad = { l: 48, r: 8, t: 18, b: 20 };
  const all = series.flatMap((s) => s.points).filter((p) => isFinite(p[1]));
  const svg = svgEl("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img",
    "aria-label": title });
  const label = (x, y, text, anchor = "end", color = undefined) => {
    const t = svgEl("text", { x, y, "text-anchor": anchor });
    if (color) t.setAttribute("style", `fill: ${color}`);
    t.textContent = text;
    svg.append(t);
  };
  label(pad.l, 12, title, "start");
  if (!all.length) return svg;
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const X = (x) => pad.l + (x - x0) / (x1 - x0) * (width - pad.l - pad.r);
  const Y = (y) => height - pad.b - (y - y0) / (y1 - y0) * (height - pad.t - pad.b);
  svg.append(svgEl("rect", { x: pad.l, y: pad.t, width: width - pad.l - pad.r, height: height - pad.t - pad.b,
    fill: "none", stroke: "#d8dce3" }));
  label(pad.l - 4, pad.t + 8, fmt(y1));
  label(pad.l - 4, height - pad.b, fmt(y0));
  label(pad.l, height - 6, fmt(x0), "start");
  label(width - pad.r, height - 6, fmt(x1));
  series.forEach((s, i) => {
    const pts = s.points.filter((p) => isFinite(p[1]));
    if (!pts.length) return;
    const d = pts.map((p, j) => `${j ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
    const color = COLORS[i % COLORS.length];
    svg.append(svgEl("path", { d, fill: "none", stroke: color, "stroke-width": 1.5, "data-series": s.name,
      "data-points": pts.length }));
    if (pts.length <= 40) {  // few points (a measure taken now and then): each one shown
      for (const p of pts) svg.append(svgEl("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: color }));
    }
    if (series.length > 1) label(width - pad.r - 2, pad.t + 12 + 11 * i, s.name, "end", COLORS[i % COLORS.length]);
  });
  return svg;
}

// Each measure's values by step (a step logged again, as after a resume, keeps its last value).
function addRows(rows) {
  for (const row of rows) {
    for (const [k, v] of Object.entries(row)) {
      if (SKIP.has(k) || typeof v !== "number" || k.startsWith("memory/")) continue;
      if (!watching.series.has(k)) watching.series.set(k, new Map());
      watching.series.get(k).set(row.step, v);
    }
  }
}

function points(byStep) {
  return [...byStep].sort((a, b) => a[0] - b[0]);
}

function duration(seconds) {
  const s = Math.round(seconds);
  const h = Math.floor(s / 3600), m = Math.floor(s % 3600 / 60);
  return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(s % 60).padStart(2, "0")}s` : `${s}s`;
}

function renderWatch(w) {
  const job = w.job;
  $("#run-title").textContent = `job ${job.id}: ${job.stage}${watching.member ? ` (sweep member ${watching.member})` : ""}`;
  $("#run-state").textContent = job.state;
  $("#run-state").className = `state ${job.state}`;
  $("#run-message").textContent = job.message || "";
  $("#run-command").textContent = job.command_line;
  $("#run-stop").hidden = !["queued", "running", "stopping"].includes(job.state);
  $("#run-resume").hidden = !["stopped", "failed"].includes(job.state) || job.continued_by !== null;
  if (job.continued_by !== null) $("#run-message").textContent += ` (continued by job ${job.continued_by})`;
  const p = w.progress;
  const bar = $("#run-progress progress");
  bar.value = p.fraction ?? 0;
  const left = p.seconds_left !== undefined && job.state === "running" ? `, ${duration(p.seconds_left)} left` : "";
  $("#run-progress span").textContent = p.max_steps ? `step ${p.step} of ${p.max_steps}${left}` : "";
  const report = $("#run-report");
  report.hidden = !w.outputs.report;
  if (w.outputs.report) report.href = `/files/run/${job.id}/${w.outputs.report}`;
  $("#run-lora").textContent = w.outputs.lora ? `LoRA: ${w.outputs.lora}` : "";
  const charts = [...watching.series].map(([k, byStep]) => chart(k, [{ name: k, points: points(byStep) }]));
  for (const [set, rows] of Object.entries(w.measures)) {
    const keys = [...new Set(rows.flatMap((r) => Object.keys(r)))].filter((k) => k !== "step");
    for (const k of keys) charts.push(chart(`${set}: ${k}`, [{ name: k, points: rows
      .filter((r) => typeof r[k] === "number").map((r) => [r.step, r[k]]) }]));
  }
  $("#run-charts").replaceChildren(...charts);
  renderPictures(job, w.pictures);
  renderMembers(job, w.members);
  renderEvaluation(job, w.evaluation);
  const log = $("#run-log");
  const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  log.textContent = w.log.join("\n");
  if (atEnd) log.scrollTop = log.scrollHeight;
}

function renderPictures(job, pictures) {
  $("#run-pictures").replaceChildren(...Object.entries(pictures).map(([name, shown]) => el("div", {},
    el("h3", { text: `${name}: step ${shown.step}` }),
    el("div", { class: "pictures" }, ...shown.files.map((f) => el("img", {
      src: `/files/run/${job.id}/${f}?step=${shown.step}`, alt: f, loading: "lazy" }))))));
}

function renderMembers(job, members) {
  if (watching.member) {
    $("#run-members").replaceChildren(el("button", { type: "button", text: "the whole sweep",
      onclick: () => watchJob(job.id) }));
    return;
  }
  if (!members.length) { $("#run-members").replaceChildren(); return; }
  $("#run-members").replaceChildren(el("h3", { text: "sweep members" }), el("table", {},
    ...members.map((m) => {
      const name = `${job.id}/${m.member}`;
      const pick = el("input", { type: "checkbox", "aria-label": `pick sweep member ${name}` });
      pick.checked = studio.picked.has(name);
      pick.addEventListener("change", () => pick.checked ? studio.picked.add(name) : studio.picked.delete(name));
      return el("tr", {}, el("td", {}, pick), el("td", { text: m.member }), el("td", { text: m.overrides.join(" ") }),
        el("td", {}, el("span", { class: `state ${m.state}`, text: m.state, title: m.message || "" })),
        el("td", { text: `step ${m.step}` }),
        el("td", {}, el("button", { type: "button", text: "watch", onclick: () => watchJob(job.id, m.member) })));
    })), el("p", {}, el("button", { type: "button", text: "Compare the picked runs", onclick: compareJobs })));
}

function renderEvaluation(job, evaluation) {
  if (!evaluation) { $("#run-eval").replaceChildren(); return; }
  const names = Object.keys(evaluation.runs);
  const metrics = [...new Set(names.flatMap((n) => Object.keys(evaluation.runs[n])))];
  const table = el("table", { id: "eval-table" }, el("tr", {}, el("th", { text: "metric" }),
    el("th", { text: "better" }), ...names.map((n) => el("th", { text: n, title: evaluation.loras[n] || "the base model" }))),
    ...metrics.map((m) => el("tr", {}, el("td", { text: m }), el("td", { text: evaluation.directions[m] || "" }),
      ...names.map((n) => el("td", { text: evaluation.runs[n][m] === null ? "-" : fmt(evaluation.runs[n][m]) })))));
  const picture = evaluation.picture
    ? el("img", { src: `/files/run/${job.id}/${evaluation.picture}`, alt: "eval.png", style: "max-width:100%" }) : "";
  const files = el("ul", { class: "muted" }, ...names.map((n) => el("li", { text: `${n}: ${evaluation.loras[n] || "the base model"}` })));
  $("#run-eval").replaceChildren(el("h3", { text: "evaluation" }), table, files, picture);
}

async function poll() {
  if (watching.id === null || watching.busy) return;
  const id = watching.id;
  watching.busy = true;
  try {
    const query = new URLSearchParams({ offset: watching.offset, member: watching.member });
    const w = await api(`/api/jobs/${id}/watch?${query}`);
    if (id !== watching.id) return;
    if (w.reset) watching.series.clear();
    watching.offset = w.offset;
    addRows(w.metrics);
    renderWatch(w);
  } catch (e) { notice(e.message); } finally { watching.busy = false; }
}

function watchJob(id, member = "") {
  watching.id = id;
  watching.member = member;
  watching.offset = 0;
  watching.series = new Map();
  $("#run-empty").hidden = true;
  $("#run").hidden = false;
  showTab("run");
  clearInterval(watching.timer);
  watching.timer = setInterval(poll, 1000);
  poll();
}

$("#run-stop").addEventListener("click", async () => { await stopJob(watching.id); poll(); });
$("#run-resume").addEventListener("click", async () => {
  const job = await resumeJob(watching.id);
  if (job) watchJob(job.id);
});
