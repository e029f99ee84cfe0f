// Plan page: the form answers as you type through /api/plan (the planner of `shardwise plan --json`).
"use strict";
sw.nav("plan");
let memChart = null, seq = 0, timer = null, lastTrain = null;
window.shardwise = { plan: null, rehearsed: null };

function fieldRow(f) {
  const id = "f-" + f.name;
  let input;
  if (f.kind === "bool") input = `<input type="checkbox" id="${id}" name="${f.name}" ${f.default === "true" ? "checked" : ""}>`;
  else if (f.kind === "choice") input = `<select id="${id}" name="${f.name}">${f.choices.map(c => `<option ${c === f.default ? "selected" : ""}>${sw.esc(c)}</option>`).join("")}</select>`;
  else input = `<input type="text" id="${id}" name="${f.name}" value="${sw.esc(f.default)}">`;
  return `<div class="row" title="${sw.esc(f.help)}"><label for="${id}">${sw.esc(f.label)}</label>${input}<span class="err" id="e-${f.name}"></span></div>`;
}

function values() {
  const v = {};
  for (const el of document.querySelectorAll("#form [name]")) v[el.name] = el.type === "checkbox" ? el.checked : el.value;
  return v;
}

function showError(msg, field) {
  document.querySelectorAll(".err").forEach(e => e.textContent = "");
  document.querySelectorAll("input.bad, select.bad").forEach(e => e.classList.remove("bad"));
  document.getElementById("form-error").textContent = "";
  if (!msg) return;
  const slot = field && document.getElementById("e-" + field);
  if (slot) { slot.textContent = msg; document.getElementById("f-" + field).classList.add("bad"); }
  else document.getElementById("form-error").textContent = msg;
}

function render(d) {
  const p = d.plan, h = p.hardware;
  window.shardwise.plan = p;
  document.getElementById("recommended").textContent = p.recommended;
  document.getElementById("reasons").innerHTML = p.reasons.map(r => `<li>${sw.esc(r)}</li>`).join("");
  document.getElementById("hardware").textContent =
    `${p.model.name}: ${sw.fmt(p.model.params / 1e9, 3)}B params · ${h.gpus_per_node} × ${h.device} (${sw.fmt(h.device_mem_gib, 1)} GiB) × ${h.nodes} node(s) = ${h.world_size} ranks`;
  const t = p.decision_tree;
  document.querySelectorAll(".tree .leaf").forEach(li => li.classList.toggle("taken", t.path.includes(li.dataset.match)));
  document.getElementById("tree-verdict").innerHTML = `${sw.esc(t.path)}<br>says <b>${sw.esc(t.says)}</b>; planner <b>${sw.esc(t.planner)}</b> — ${t.agree ? "agree" : "differ"}`;
  document.getElementById("tree-why").innerHTML = t.why.map(w => `<li>${sw.esc(w)}</li>`).join("");
  document.querySelector("#strategies tbody").innerHTML = p.strategies.map(s =>
    `<tr data-strategy="${sw.esc(s.strategy)}"${s.strategy === p.recommended ? ' class="sel"' : ""}><td>${sw.esc(s.strategy)}${s.strategy === p.recommended ? " ★" : ""}</td><td>${s.fits ? "yes" : "NO"}</td>
     <td class="num">${sw.fmt(s.mem_gib.total)}</td><td class="num">${sw.fmt(s.comm_gb_per_step)}</td>
     <td class="num">${sw.fmt(s.step_time_s, 4)}</td><td class="num">${sw.fmt(s.tokens_per_s, 0)}</td><td class="muted">${sw.esc(s.peak_phase)}</td>
     ${rehearsedCells(s.strategy)}</tr>`).join("");
  lastTrain = d.train;
  document.getElementById("command").textContent = d.train.command;
  document.getElementById("yaml").textContent = d.train.yaml;
  const parts = [["params", "parameters"], ["grads", "gradients"], ["optimizer", "optimizer"], ["activations", "activations"], ["buffers", "buffers"], ["allowance", "allowance"]];
  const labels = p.strategies.map(s => s.strategy);
  const datasets = parts.map(([k, name], i) => ({ type: "bar", label: name, stack: "m", backgroundColor: sw.colors[i],
    data: p.strategies.map(s => s.mem_gib[k] || 0) }));
  datasets.push({ type: "line", label: `device memory (${sw.fmt(h.device_mem_gib, 1)} GiB)`, data: labels.map(() => h.device_mem_gib),
    borderColor: "#c0262d", borderDash: [6, 4], pointRadius: 0, borderWidth: 2 });
  if (!memChart) {
    memChart = new Chart(document.getElementById("mem-chart"), { data: { labels, datasets },
      options: { animation: false, maintainAspectRatio: false, scales: { x: { stacked: true }, y: { stacked: true, title: { display: true, text: "GiB per rank" } } },
        plugins: { legend: { position: "bottom", labels: { boxWidth: 12 } } } } });
  } else { memChart.data.labels = labels; memChart.data.datasets = datasets; memChart.update(); }
  window.shardwise.memChart = memChart;
}

// The rehearsal's cells of a strategy's row: measured memory (GiB; MiB for the tiny model's), the difference from
// the plan, compute-only step time, and compute + the planner's communication; a row not rehearsed says why.
function rehearsedCells(name) {
  const rh = window.shardwise.rehearsed;
  const r = rh && rh.rows.find(x => x.strategy === name);
  if (!r) return `<td class="rh" colspan="4"></td>`;
  if (!r.ok) return `<td class="rh muted" colspan="4">${sw.esc(r.error)}</td>`;
  const cuda = rh.accelerator === "cuda", mib = !cuda && r.analytic_total_gib < 1;
  const mem = (cuda ? r.need_gib : r.peak_allocated_gib) * (mib ? 1024 : 1);
  return `<td class="num rh">${sw.fmt(mem, 2)}${mib ? " MiB" : ""}</td>
    <td class="num rh${r.disagrees ? " bad" : ""}">${r.memory_diff_pct > 0 ? "+" : ""}${sw.fmt(r.memory_diff_pct, 0)}%</td>
    <td class="num rh">${sw.fmt(r.compute_s, 3)}</td><td class="num rh">${sw.fmt(r.predicted_step_s, 3)}</td>`;
}

function showRehearsal(rh) {
  const notes = [];
  if (rh) {
    notes.push(`rehearsed on ${rh.device}, ${rh.steps} steps of one rank each: ${rh.note}`);
    for (const r of rh.rows) {
      if (r.ok && r.disagrees) notes.push(`${r.strategy}: rehearsal and plan disagree by ${sw.fmt(r.memory_diff_pct, 0)}% in memory; fits is the rehearsal's: ${r.fits ? "yes" : "NO"}`);
    }
    const first = rh.rows.find(r => r.ok);
    if (first) notes.push(first.rank_why);
  }
  document.getElementById("rehearse-notes").innerHTML = notes.map(n => `<li>${sw.esc(n)}</li>`).join("");
}

async function rehearse() {
  const b = document.getElementById("rehearse"), note = document.getElementById("rehearse-note");
  const err = document.getElementById("rehearse-error");
  const mine = seq;
  b.disabled = true; err.textContent = "";
  note.textContent = "rehearsing one rank of each job (minutes on a real model)…";
  try {
    const d = await sw.post("/api/rehearse", values());
    if (mine !== seq) return;  // the form changed meanwhile: this rehearsal is of another job
    window.shardwise.rehearsed = d.plan.rehearsed;
    render({ plan: d.plan, train: lastTrain });
    showRehearsal(d.plan.rehearsed);
    note.textContent = "";
  } catch (e) {
    err.textContent = e.message;
    note.textContent = "";
  } finally { b.disabled = false; }
}

async function replan() {
  const mine = ++seq;
  try {
    const d = await sw.post("/api/plan", values());
    if (mine !== seq) return;
    showError(null);
    render(d);
  } catch (e) {
    if (mine !== seq) return;
    showError(e.message, e.field);
    document.getElementById("recommended").textContent = "—";
  }
}

async function launch() {
  const b = document.getElementById("launch");
  clearTimeout(timer); seq++;  // a plan answer still on its way must not cover the launch's answer
  b.disabled = true;
  document.getElementById("launch-note").textContent = "checking…";
  try {
    const d = await sw.post("/api/launch", values());
    showError(null);
    location.href = "/runs?run=" + encodeURIComponent(d.name);
  } catch (e) {
    showError(e.message, e.field);
    document.getElementById("launch-note").textContent = "";
  } finally { b.disabled = false; }
}

(async () => {
  const d = await sw.get("/api/fields");
  document.getElementById("runs-dir").textContent = "runs: " + d.runs_dir;
  document.getElementById("plan-fields").innerHTML = d.fields.filter(f => !f.launch_only).map(fieldRow).join("");
  document.getElementById("launch-fields").innerHTML = d.fields.filter(f => f.launch_only).map(fieldRow).join("");
  document.getElementById("form").addEventListener("input", () => {
    clearTimeout(timer); seq++;  // a rehearsal of the earlier form no longer describes this one
    window.shardwise.rehearsed = null; showRehearsal(null);
    timer = setTimeout(replan, 250);
  });
  document.getElementById("rehearse").addEventListener("click", rehearse);
  document.getElementById("launch").addEventListener("click", launch);
  document.querySelectorAll("[data-copy]").forEach(b => b.addEventListener("click",
    () => navigator.clipboard && navigator.clipboard.writeText(document.getElementById(b.dataset.copy).textContent)));
  replan();
})();
