// Comparing runs (their curves overlaid, the settings in which they differ, an evaluation of their LoRAs) and the
// data tab (a data set's samples read through qie's data code; captioning the ones without a prompt).
"use strict";

const compared = { eval: [] };
const dataTab = { path: "", offset: 0, limit: 24, total: 0 };

async function compareJobs() {
  const ids = [...studio.picked].map(String);
  if (!ids.length) { notice("pick the jobs to compare (their boxes in the job list)"); return; }
  try {
    const c = await api(`/api/compare?ids=${ids.join(",")}`);
    compared.eval = c.eval;
    $("#compare-empty").hidden = true;
    $("#compare").hidden = false;
    $("#compare-title").textContent = `runs ${c.jobs.map((j) => j.id).join(", ")}`;
    const curves = (name) => c.jobs.map((j) => ({ name: `run ${j.id}`, points: j.curves[name] || [] }));
    const names = ["loss", "lr", "heldout_loss"].filter((n) => c.jobs.some((j) => (j.curves[n] || []).length));
    $("#compare-charts").replaceChildren(...names.map((n) => chart(n.replace("_", " "), curves(n), 480, 220)));
    const head = el("tr", {}, el("th", { text: "setting" }), ...c.jobs.map((j) => el("th", { text: `run ${j.id}` })));
    const rows = Object.entries(c.differences).map(([k, values]) => el("tr", {}, el("td", { text: k }),
      ...values.map((v) => el("td", { text: v === null ? "(none)" : v }))));
    $("#compare-diff").replaceChildren(head, ...rows);
    $("#compare-eval").disabled = !c.jobs.some((j) => j.lora);
    showTab("compare");
  } catch (e) { notice(e.message); }
}

async function loadDatasets() {
  try {
    const d = await api("/api/datasets");
    const select = $("#datasets");
    const current = select.value;
    select.replaceChildren(el("option", { value: "", text: "(pick one)" }),
      ...d.datasets.map((p) => el("option", { value: p, text: p })));
    select.value = d.datasets.includes(current) ? current : "";
  } catch (e) { notice(e.message); }
}

function image(path, alt) {
  return el("img", { src: `/files/data?${new URLSearchParams({ path, thumb: 1 })}`, alt, loading: "lazy" });
}

async function showData(path, offset = 0) {
  try {
    const d = await api(`/api/data?${new URLSearchParams({ path, offset, limit: dataTab.limit })}`);
    Object.assign(dataTab, { path, offset, total: d.total });
    $("#data-summary").textContent = `${d.format}: ${d.total} samples, ${d.without_prompt} without a prompt` +
      (d.problems.length ? `, ${d.problems.length} problem(s)` : "") +
      ` (showing ${offset + 1}-${Math.min(offset + dataTab.limit, d.total)})`;
    $("#data-caption").hidden = !d.without_prompt;
    $("#data-problems").replaceChildren(...d.problems.map((p) => el("div", { text: `${p.id}: ${p.reason}` })));
    $("#data-samples").replaceChildren(...d.samples.map((s) => el("div", { class: "sample", "data-id": s.id },
      el("div", { class: "muted", text: s.id }),
      el("div", { class: "pictures" }, ...s.controls.map((c) => image(c, `control of ${s.id}`)),
        ...(s.target ? [image(s.target, `target of ${s.id}`)] : []), ...(s.mask ? [image(s.mask, `mask of ${s.id}`)] : []),
        ...s.layers.map((l) => image(l, `layer of ${s.id}`))),
      el("div", { class: `prompt${s.prompt ? "" : " missing"}`, text: s.prompt || "(no prompt)" }))));
  } catch (e) { notice(e.message); }
}

$("#compare-picked").addEventListener("click", compareJobs);
$("#compare-eval").addEventListener("click", () => prefill("eval", compared.eval));
$("#datasets").addEventListener("change", () => $("#datasets").value && showData($("#datasets").value));
$("#data-open").addEventListener("click", async () => {
  const path = $("#data-path").value.trim();
  if (!path) return;
  try {
    const d = await api("/api/datasets", { path });
    await loadDatasets();
    const added = d.datasets[d.datasets.length - 1];
    $("#datasets").value = d.datasets.find((p) => p === path) || added;
    await showData($("#datasets").value);
  } catch (e) { notice(e.message); }
});
$("#data-prev").addEventListener("click", () => dataTab.path && showData(dataTab.path, Math.max(0, dataTab.offset - dataTab.limit)));
$("#data-next").addEventListener("click", () => dataTab.path && dataTab.offset + dataTab.limit < dataTab.total &&
  showData(dataTab.path, dataTab.offset + dataTab.limit));
$("#data-caption").addEventListener("click", () => prefill("caption", [`data.path=${hydraValue({ kind: "str" }, dataTab.path)}`]));
for (const b of document.querySelectorAll('nav button[data-tab="data"]')) b.addEventListener("click", loadDatasets);
