// Bench page: a `shardwise bench` report (its JSON) as interactive charts.
"use strict";
sw.nav("bench");
const charts = {};
window.shardwise = { charts };

function pairChart(id, title, labels, measured, predicted) {
  if (charts[id]) charts[id].destroy();
  const datasets = [{ label: "measured", data: measured, backgroundColor: sw.colors[0] }];
  if (predicted) datasets.push({ label: "predicted", data: predicted, backgroundColor: "#9db9e8" });
  charts[id] = new Chart(document.getElementById("c-" + id), { type: "bar", data: { labels, datasets },
    options: { animation: false, maintainAspectRatio: false, plugins: { title: { display: true, text: title } } } });
}

async function show(name) {
  const d = await sw.get("/api/bench/report?report=" + encodeURIComponent(name));
  document.getElementById("report").hidden = false;
  document.getElementById("report-command").textContent = `${d.created} · ${d.command}`;
  document.getElementById("verdict").innerHTML = (d.verdict || []).map(v => `<li>${sw.esc(v).replace(/\*\*(.+?)\*\*/g, "<b>$1</b>")}</li>`).join("");
  const ok = d.results.filter(r => r.status === "ok");
  const labels = ok.map(r => r.strategy);
  const pred = (r, k) => r.predicted && r.predicted.available ? r.predicted[k] : null;
  pairChart("tps", "tokens/s (median over steps)", labels, ok.map(r => r.measured.tokens_per_s.median), ok.map(r => pred(r, "tokens_per_s")));
  pairChart("mem", "peak memory per rank (GiB)", labels, ok.map(r => r.measured.peak_mem_gib && r.measured.peak_mem_gib.max), ok.map(r => pred(r, "peak_mem_gib")));
  pairChart("step", "step time (s, median)", labels, ok.map(r => r.measured.step_time_s.median), ok.map(r => pred(r, "step_time_s")));
  if (charts.loss) charts.loss.destroy();
  const longest = Math.max(0, ...ok.map(r => (r.measured.losses || []).length));
  charts.loss = new Chart(document.getElementById("c-loss"), { type: "line",
    data: { labels: Array.from({ length: longest }, (_, i) => i + 1),
      datasets: ok.map((r, i) => ({ label: r.strategy, data: r.measured.losses || [], borderColor: sw.colors[i], pointRadius: 2 })) },
    options: { animation: false, maintainAspectRatio: false, plugins: { title: { display: true, text: "loss per logged step" } } } });
  document.querySelector("#results tbody").innerHTML = d.results.map(r => {
    const m = r.measured || {};
    return `<tr><td>${sw.esc(r.strategy)}</td><td>${sw.esc(r.result)}${r.reason ? ` <span class="muted">(${sw.esc(r.reason)})</span>` : ""}</td>
      <td class="num">${sw.esc(r.world_size || "—")}</td><td class="num">${sw.fmt(m.tokens_per_s && m.tokens_per_s.median, 0)}</td><td class="num">${sw.fmt(pred(r, "tokens_per_s"), 0)}</td>
      <td class="num">${sw.fmt(m.peak_mem_gib && m.peak_mem_gib.max)}</td><td class="num">${sw.fmt(pred(r, "peak_mem_gib"))}</td><td class="num">${sw.fmt(m.final_loss, 4)}</td></tr>`;
  }).join("");
}

(async () => {
  const d = await sw.get("/api/bench");
  const sel = document.getElementById("reports");
  sel.innerHTML = d.reports.map(r => `<option value="${sw.esc(r.name)}">${sw.esc(r.name)} (${sw.esc(r.created)})</option>`).join("");
  document.getElementById("none").hidden = d.reports.length > 0;
  sel.addEventListener("change", () => show(sel.value));
  const want = new URLSearchParams(location.search).get("report");
  if (want) sel.value = want;
  if (sel.value) show(sel.value);
})();
