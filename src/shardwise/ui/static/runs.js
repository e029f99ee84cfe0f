// Runs page: the run list and the selected run's curves arrive as server-sent events (/api/events).
"use strict";
sw.nav("runs");
const params = new URLSearchParams(location.search);
let selected = params.get("run"), source = null, listing = [], ticked = [];
const charts = {};
const series = { loss: ["loss", "loss"], lr: ["lr", "learning rate"], tps: ["tokens_per_s", "tokens/s"], mem: ["peak_mem_gib", "peak memory GiB (max over ranks)"],
  // task dpo's rewards (shown only for a run that logs them)
  margin: ["rewards/margins", "reward margin (chosen - rejected)"], acc: ["rewards/accuracies", "reward accuracy (chosen > rejected)"] };
window.shardwise = { charts };

function makeCharts() {
  for (const [id, [key, label]] of Object.entries(series)) {
    if (charts[id]) charts[id].destroy();
    charts[id] = new Chart(document.getElementById("c-" + id), {
      type: "line", data: { labels: [], datasets: [{ label, data: [], borderColor: sw.colors[Object.keys(series).indexOf(id)], pointRadius: 2, borderWidth: 2 }] },
      options: { animation: false, maintainAspectRatio: false, scales: { x: { title: { display: true, text: "step" } } }, plugins: { legend: { display: true } } } });
  }
}

function addMetrics(recs) {
  for (const r of recs) {
    for (const [id, [key]] of Object.entries(series)) {
      charts[id].data.labels.push(r.step);
      charts[id].data.datasets[0].data.push(r[key] ?? null);
    }
  }
  Object.values(charts).forEach(c => c.update());
  const pref = charts.margin.data.datasets[0].data.some(v => v != null);
  document.querySelectorAll(".chartbox.pref").forEach(b => { b.hidden = !pref; });
  document.getElementById("points").textContent = charts.loss.data.labels.length;
  if (recs.length) refreshDetail();
}

function renderList(runs) {
  listing = runs;
  document.querySelector("#runs tbody").innerHTML = runs.map(r => `<tr class="clickable${r.name === selected ? " sel" : ""}" data-run="${sw.esc(r.name)}">
    <td><input type="checkbox" class="tick" value="${sw.esc(r.name)}" ${ticked.includes(r.name) ? "checked" : ""}></td>
    <td>${sw.esc(r.name)}</td><td><span class="state ${r.state}">${r.state}</span></td><td class="muted">${sw.esc(r.why)}</td>
    <td${r.config_error ? ` class="muted" title="${sw.esc(r.config_error)}"` : ""}>${sw.esc(r.config_error ? "config unreadable" : r.strategy)}</td><td class="num">${sw.esc(r.world ?? "—")}</td><td class="num">${sw.fmt(r.summary && r.summary.final_loss, 4)}</td></tr>`).join("");
  const cur = runs.find(r => r.name === selected);
  if (cur) { setState(cur); }
}

function setState(r) {
  const s = document.getElementById("run-state");
  s.textContent = r.state; s.className = "state " + r.state;
  document.getElementById("run-why").textContent = r.why;
  document.getElementById("stop").disabled = r.state !== "running";
  document.getElementById("resume").disabled = !(r.state === "interrupted" || r.state === "failed");
}

let detailBusy = false;
async function refreshDetail() {
  if (!selected || detailBusy) return;
  detailBusy = true;
  try {
    const d = await sw.get("/api/run?run=" + encodeURIComponent(selected));
    setState(d);
    const m = d.metrics, last = m[m.length - 1] || {}, p = d.predicted || {}, s = d.summary || {};
    const steps = m.map(x => x.step_time_s).filter(x => x != null).sort((a, b) => a - b);
    const median = steps.length ? steps[Math.floor(steps.length / 2)] : null;
    const peak = s.peak_mem_gib ?? Math.max(...m.map(x => x.peak_mem_gib ?? 0), 0);
    document.querySelector("#pvm tbody").innerHTML = p.error ? `<tr><td colspan="3">${sw.esc(p.error)}</td></tr>` :
      `<tr><td>peak memory per rank (GiB)</td><td class="num">${sw.fmt(p.peak_mem_gib)}</td><td class="num">${sw.fmt(peak)}</td></tr>
       <tr><td>step time (s, median)</td><td class="num">${sw.fmt(p.step_time_s, 4)}</td><td class="num">${sw.fmt(median, 4)}</td></tr>
       <tr><td>tokens/s</td><td class="num">${sw.fmt(p.tokens_per_s, 0)}</td><td class="num">${sw.fmt(s.mean_tokens_per_s ?? last.tokens_per_s, 0)}</td></tr>`;
    const c = d.commands;
    document.getElementById("cmds").textContent = [`# resume\n${c.resume}`, c.export ? `# export the newest checkpoint\n${c.export}` : null,
      c.final ? `# the trained model (Hugging Face directory)\n${c.final}` : null].filter(Boolean).join("\n");
    document.getElementById("log").textContent = d.log_tail || "(started outside the page: no launcher output here)";
  } catch (e) { document.getElementById("action-msg").textContent = e.message; }
  finally { detailBusy = false; }
}

function select(name) {
  selected = name;
  history.replaceState(null, "", name ? "/runs?run=" + encodeURIComponent(name) : "/runs");
  document.getElementById("detail").hidden = !name;
  document.getElementById("run-name").textContent = name || "";
  document.getElementById("action-msg").textContent = "";
  makeCharts();
  document.getElementById("points").textContent = "0";
  connect();
  refreshDetail();
}

function connect() {
  if (source) source.close();
  source = new EventSource("/api/events" + (selected ? "?run=" + encodeURIComponent(selected) : ""));
  source.addEventListener("runs", e => { const before = JSON.stringify(listing.find(r => r.name === selected)?.state); renderList(JSON.parse(e.data));
    if (JSON.stringify(listing.find(r => r.name === selected)?.state) !== before) refreshDetail(); });
  source.addEventListener("metrics", e => addMetrics(JSON.parse(e.data)));
}

// a resume the server asks about (a copied run's remote code, a rendezvous beyond loopback): the user's yes to
// each is sent with the same request again
const ASKS = ["trust_remote_code", "listen_beyond_loopback"];

async function act(action, said = {}) {
  document.getElementById("action-msg").textContent = "";
  try {
    await sw.post("/api/run/" + action, { run: selected, ...said });
    if (action === "resume") { makeCharts(); document.getElementById("points").textContent = "0"; connect(); }
  } catch (e) {
    if (action === "resume" && ASKS.includes(e.field) && !said[e.field] && confirm(e.message + "?"))
      return act(action, { ...said, [e.field]: true });
    document.getElementById("action-msg").textContent = e.message;
  }
}

document.querySelector("#runs tbody").addEventListener("click", e => {
  if (e.target.classList.contains("tick")) {
    ticked = [...document.querySelectorAll(".tick:checked")].map(x => x.value).slice(-MAX_OVERLAY);
    document.getElementById("diff-btn").disabled = ticked.length !== 2;
    document.getElementById("overlay-btn").disabled = ticked.length < 1;
    return;
  }
  const tr = e.target.closest("tr[data-run]");
  if (tr) select(tr.dataset.run);
});
document.getElementById("diff-btn").addEventListener("click", async () => {
  const [a, b] = ticked;
  const d = await sw.get(`/api/diff?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
  document.getElementById("diff-a").textContent = a; document.getElementById("diff-b").textContent = b;
  document.querySelector("#diff tbody").innerHTML = d.diff.length ? d.diff.map(x =>
    `<tr><td>${sw.esc(x.key)}</td><td>${sw.esc(JSON.stringify(x.a))}</td><td>${sw.esc(JSON.stringify(x.b))}</td></tr>`).join("")
    : `<tr><td colspan="3">the two configs are the same</td></tr>`;
  document.getElementById("diff").hidden = false;
});
// the loss of every ticked run on one chart, against the step (runs log different steps: x is a number, not a label)
const MAX_OVERLAY = sw.colors.length;
async function overlay() {
  document.getElementById("overlay-msg").textContent = "";
  const names = [...ticked];
  let runs;
  try { runs = await Promise.all(names.map(n => sw.get("/api/run?run=" + encodeURIComponent(n)))); }
  catch (e) { document.getElementById("overlay-msg").textContent = e.message; return; }
  const datasets = runs.map((d, i) => ({ label: names[i], borderColor: sw.colors[i], pointRadius: 1, borderWidth: 2,
    data: d.metrics.filter(r => r.loss != null).map(r => ({ x: r.step, y: r.loss })) }));
  if (charts.overlay) charts.overlay.destroy();
  document.getElementById("overlay").hidden = false;
  charts.overlay = new Chart(document.getElementById("c-overlay"), { type: "line", data: { datasets },
    options: { animation: false, maintainAspectRatio: false, parsing: true,
      scales: { x: { type: "linear", title: { display: true, text: "step" } }, y: { title: { display: true, text: "loss" } } },
      plugins: { legend: { display: true } } } });
}
document.getElementById("overlay-btn").addEventListener("click", overlay);
document.getElementById("stop").addEventListener("click", () => act("stop"));
document.getElementById("resume").addEventListener("click", () => act("resume"));
sw.get("/api/runs").then(d => { document.getElementById("runs-dir").textContent = "runs: " + d.runs_dir; renderList(d.runs); });
select(selected);
