// The studio's page: the API, the tabs, the new-job form (generated from the stage's schema) and the job list.
"use strict";

const SECRET = document.querySelector('meta[name="qie-secret"]').content;
const $ = (sel, root = document) => root.querySelector(sel);
const studio = { stage: "train", form: null, edits: new Map(), presets: new Map(), jobs: [], picked: new Set(), asked: 0 };

async function api(path, body) {
  const init = body === undefined ? {} : {
    method: "POST", body: JSON.stringify(body),
    headers: { "Content-Type": "application/json", "X-Qie-Token": SECRET },
  };
  const response = await fetch(path, init);
  const data = await response.json().catch(() => ({ error: `${response.status} ${response.statusText}` }));
  if (!response.ok) throw new Error(data.error || `${response.status}`);
  return data;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") node.textContent = v; else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  node.append(...children);
  return node;
}

function notice(text) {
  const n = $("#notice");
  n.textContent = text;
  n.hidden = !text;
}

function showTab(name) {
  for (const b of document.querySelectorAll("nav button")) b.setAttribute("aria-selected", b.dataset.tab === name);
  for (const s of document.querySelectorAll("[role=tabpanel]")) s.hidden = s.id !== `tab-${name}`;
}

// ---- the form ----------------------------------------------------------------------------------------------

// A value as Hydra's override grammar reads it: plain where that is unambiguous, else quoted.
function hydraValue(field, text) {
  if (text === "" && (field.nullable || field.kind !== "str")) return "null";
  if (field.kind !== "str" || field.value === null && /^(null)$/.test(text)) return text;
  if (/^[A-Za-z_/.][\w\-./:@]*$/.test(text) && !/^(true|false|null|nan|inf)$/i.test(text)) return text;
  return "'" + text.replace(/\\/g, "\\\\").replace(/'/g, "\\'") + "'";
}

function shown(field, value) {
  if (value === null || value === undefined) return "";
  if (field.kind === "list" || field.kind === "any") return typeof value === "string" ? value : JSON.stringify(value);
  return String(value);
}

function fieldInput(field) {
  const attrs = { name: field.key, id: `f-${field.key}`, "data-kind": field.kind };
  let input;
  if (field.kind === "bool") {
    input = el("input", { ...attrs, type: "checkbox" });
    input.checked = field.value === true;
  } else if (field.kind === "choice") {
    input = el("select", attrs, ...(field.nullable ? [el("option", { value: "", text: "(null)" })] : []),
      ...field.choices.map((c) => el("option", { value: c, text: c })));
    input.value = field.value ?? "";
  } else {
    const number = field.kind === "int" || field.kind === "float";
    input = el("input", { ...attrs, type: number ? "number" : "text", step: field.kind === "int" ? "1" : "any",
      min: field.min ?? undefined, max: field.max ?? undefined });
    input.value = shown(field, field.value);
  }
  input.dataset.initial = field.kind === "bool" ? String(input.checked) : input.value;
  for (const event of ["input", "change"]) input.addEventListener(event, () => edited(field, input));
  return input;
}

function edited(field, input) {
  const text = field.kind === "bool" ? String(input.checked) : input.value;
  const row = input.closest(".field");
  const key = (field.add ? "+" : "") + field.key;
  if (text === input.dataset.initial) studio.edits.delete(field.key);
  else studio.edits.set(field.key, `${key}=${field.kind === "bool" ? text : hydraValue(field, text)}`);
  row.classList.toggle("changed", studio.edits.has(field.key));
  scheduleCheck();
}

function renderForm(form) {
  studio.form = form;
  const presets = $("#presets");
  presets.replaceChildren(...form.presets.map((p) => {
    const select = el("select", { name: p.group, "data-preset": p.group },
      el("option", { value: "", text: `(default${p.default && !studio.presets.has("experiment") ? ": " + p.default : ""})` }),
      ...p.choices.map((c) => el("option", { value: c, text: c })));
    select.value = studio.presets.get(p.group) || "";
    select.addEventListener("change", () => {
      if (select.value) studio.presets.set(p.group, select.value); else studio.presets.delete(p.group);
      loadForm();
    });
    return el("label", {}, `${p.group} `, select);
  }));
  const open = { train: "train", demo: "demo", eval: "eval", caption: "caption" }[form.stage];
  $("#groups").replaceChildren(...form.groups.map((g) => el("details", { open: g.name === open, "data-group": g.name },
    el("summary", { text: `${g.name} (${g.fields.length})` }),
    ...g.fields.map((f) => {
      const input = fieldInput(f);
      const bounds = f.min !== null && f.min !== undefined || f.max !== null && f.max !== undefined
        ? ` [${f.min ?? "-inf"}, ${f.max ?? "inf"}]` : "";
      const row = el("div", { class: "field" }, el("label", { for: input.id, text: f.key }), input,
        ...(f.help || bounds ? [el("div", { class: "help", text: `${f.help || ""}${bounds}` })] : []));
      if (studio.edits.has(f.key)) {
        const given = studio.edits.get(f.key).split("=").slice(1).join("=");
        if (f.kind === "bool") input.checked = given === "true"; else input.value = given.replace(/^'(.*)'$/, "$1");
        row.classList.add("changed");
      }
      return row;
    }))));
}

function overrides() {
  const extra = $("#extra").value.split("\n").map((l) => l.trim()).filter(Boolean);
  return [...[...studio.presets].map(([g, v]) => `${g}=${v}`), ...studio.edits.values(), ...extra];
}

function jobRequest() {
  return { stage: $("#stage").value, overrides: overrides(), multirun: $("#multirun").checked };
}

async function loadForm() {
  const query = new URLSearchParams({ stage: $("#stage").value });
  for (const [g, v] of studio.presets) query.append("o", `${g}=${v}`);
  try {
    renderForm(await api(`/api/form?${query}`));
    showError("");
  } catch (e) { showError(e.message); }
  scheduleCheck();
}

function showError(text) {
  $("#error").textContent = text;
  $("#error").hidden = !text;
}

let checkTimer = null;
function scheduleCheck() {
  clearTimeout(checkTimer);
  checkTimer = setTimeout(checkJob, 300);
}

// The answer to the form's latest question only: an earlier one that arrives late says nothing of the form now.
async function ask(path) {
  const asked = ++studio.asked;
  try {
    const answer = await api(path, jobRequest());
    if (asked === studio.asked) showError("");
    return answer;
  } catch (e) {
    if (asked === studio.asked) showError(e.message);
    return null;
  }
}

async function checkJob() {
  const checked = await ask("/api/check");
  if (checked) $("#command").textContent = checked.command_line;
}

async function queueJob(event) {
  event.preventDefault();
  const job = await ask("/api/jobs");
  if (!job) return;
  notice(`queued job ${job.id}: ${job.command_line}`);
  await refreshJobs();
}

// Fill the form for another stage with given overrides (an evaluation of compared runs, a caption job).
async function prefill(stage, given) {
  $("#stage").value = stage;
  studio.presets.clear();
  studio.edits.clear();
  $("#extra").value = given.join("\n");
  $("#multirun").checked = false;
  showTab("queue");
  await loadForm();
}

// The demo as a training job: the tiny demo model on the built-in data set, its cache filled as it trains.
const DEMO = { presets: [["experiment", "demo"]], edits: [["train.max_steps", "120"], ["cache.mode", "lazy"]] };

async function fillDemo() {
  $("#stage").value = "train";
  studio.presets = new Map(DEMO.presets);
  studio.edits = new Map(DEMO.edits.map(([k, v]) => [k, `${k}=${v}`]));
  $("#extra").value = "";
  $("#multirun").checked = false;
  await loadForm();
}

// ---- the job list ------------------------------------------------------------------------------------------

function progressText(job) {
  const p = job.progress;
  return p && p.max_steps ? `${p.step}/${p.max_steps}` : "";
}

function renderJobs() {
  const rows = [...studio.jobs].reverse().map((job) => {
    const pick = el("input", { type: "checkbox", "aria-label": `pick job ${job.id}` });
    pick.checked = studio.picked.has(job.id);
    pick.addEventListener("change", () => pick.checked ? studio.picked.add(job.id) : studio.picked.delete(job.id));
    const actions = el("td", {}, el("button", { type: "button", text: "watch", onclick: () => watchJob(job.id) }));
    if (["queued", "running", "stopping"].includes(job.state))
      actions.append(" ", el("button", { type: "button", text: "stop", onclick: () => stopJob(job.id) }));
    if (["stopped", "failed"].includes(job.state) && job.continued_by === null)
      actions.append(" ", el("button", { type: "button", text: "resume", onclick: () => resumeJob(job.id) }));
    return el("tr", { "data-job": job.id },
      el("td", {}, pick), el("td", { text: job.resumed_from ? `${job.id} (of ${job.resumed_from})` : job.id }),
      el("td", { text: job.stage + (job.multirun ? " -m" : "") }),
      el("td", { class: "overrides", text: job.overrides.join(" "), title: job.command_line }),
      el("td", {}, el("span", { class: `state ${job.state}`, text: job.state, title: job.message || "" })),
      el("td", { text: progressText(job) }), actions);
  });
  $("#jobs tbody").replaceChildren(...rows);
}

async function refreshJobs() {
  try {
    studio.jobs = (await api("/api/jobs")).jobs;
    renderJobs();
  } catch (e) { notice(e.message); }
}

async function stopJob(id) {
  try { await api(`/api/jobs/${id}/stop`, {}); } catch (e) { notice(e.message); }
  await refreshJobs();
}

async function resumeJob(id) {
  try {
    const job = await api(`/api/jobs/${id}/resume`, {});
    notice(`job ${id} resumes as job ${job.id}`);
    await refreshJobs();
    return job;
  } catch (e) { notice(e.message); }
}

async function start() {
  const info = await api("/api/stages");
  $("#home").textContent = `runs in ${info.home}`;
  $("#stage").replaceChildren(...info.stages.map((s) => el("option", { value: s, text: s })));
  $("#stage").value = "train";
  $("#stage").addEventListener("change", () => { studio.presets.clear(); studio.edits.clear(); loadForm(); });
  $("#multirun").addEventListener("change", scheduleCheck);
  $("#extra").addEventListener("input", scheduleCheck);
  $("#job-form").addEventListener("submit", queueJob);
  $("#demo").addEventListener("click", fillDemo);
  for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => showTab(b.dataset.tab));
  await Promise.all([loadForm(), refreshJobs()]);
  setInterval(refreshJobs, 2000);
}

start();
