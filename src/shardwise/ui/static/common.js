// Shared by the pages: the navigation bar and JSON requests.
"use strict";
const sw = {
  nav(here) {
    const n = document.createElement("nav");
    n.innerHTML = `<span class="brand">shardwise</span>
      <a href="/" ${here === "plan" ? 'class="here"' : ""}>Plan</a>
      <a href="/runs" ${here === "runs" ? 'class="here"' : ""}>Runs</a>
      <a href="/bench" ${here === "bench" ? 'class="here"' : ""}>Bench</a>
      <span class="dir" id="runs-dir"></span>`;
    document.body.prepend(n);
  },
  async get(url) {
    const r = await fetch(url);
    const d = await r.json();
    if (!r.ok) throw Object.assign(new Error(d.error || r.statusText), { field: d.field });
    return d;
  },
  async post(url, body) {
    const r = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    const d = await r.json();
    if (!r.ok) throw Object.assign(new Error(d.error || r.statusText), { field: d.field });
    return d;
  },
  esc(s) { return String(s ?? "").replace(/[&<>"']/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c])); },
  fmt(x, d = 3) { return x == null || Number.isNaN(x) ? "—" : Number(x).toLocaleString(undefined, { maximumFractionDigits: d }); },
  colors: ["#2f6fd6", "#e8833a", "#2ca25f", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c"],
};
