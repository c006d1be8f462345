// The dashboard: fetches /api/dashboard with the history token and draws four charts.
// The token comes from the page's #token=… (what `tabloop history` prints) or the login form,
// and stays in this tab's sessionStorage only.
"use strict";

(function () {
  const {lineChart, barChart, valuesTable} = window.TabloopCharts;
  const statusEl = document.getElementById("status");
  const pct = v => `${Math.round(v * 1000) / 10}%`;

  function token() {
    const m = /(?:^|[#&])token=([^&]+)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem("tabloop-history-token", decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);  // keep it out of the address bar
    }
    return sessionStorage.getItem("tabloop-history-token");
  }

  function status(text, isError) {
    statusEl.textContent = text;
    statusEl.classList.toggle("error", !!isError);
  }

  function byVersion(rows, field) {
    const series = new Map();
    for (const r of rows) {
      const name = `v${r.policy_version}`;
      if (!series.has(name)) series.set(name, {name, version: r.policy_version, points: []});
      series.get(name).points.push({x: r.day, y: r[field]});
    }
    return [...series.values()].sort((a, b) => a.version - b.version);
  }

  function tile(label, value) {
    const div = document.createElement("div");
    div.className = "tile";
    div.innerHTML = `<div class="value"></div><div class="label"></div>`;
    div.querySelector(".value").textContent = value;
    div.querySelector(".label").textContent = label;
    return div;
  }

  function draw(data) {
    const plot = id => document.querySelector(`#${id} .plot`);
    lineChart(plot("acceptance-chart"), byVersion(data.acceptance, "acceptance_rate"),
              {yMin: 0, yMax: 1, format: pct, label: "acceptance rate per policy version",
               empty: "no decided episodes yet"});
    valuesTable(plot("acceptance-chart"), ["day", "policy_version", "episodes", "accepted", "rejected",
                                           "acceptance_rate"], data.acceptance);

    const days = data.shown.map(r => r.day);
    barChart(plot("shown-chart"), days, [
      {name: "shown", values: Object.fromEntries(data.shown.map(r => [r.day, r.shown]))},
      {name: "accepted", values: Object.fromEntries(data.shown.map(r => [r.day, r.accepted]))},
    ], {label: "suggestions shown vs accepted", empty: "no completions served yet"});
    valuesTable(plot("shown-chart"), ["day", "served", "shown", "accepted", "rejected", "gate_hidden"], data.shown);

    lineChart(plot("latency-chart"), ["p50", "p90", "p99"].map(q => ({
      name: q, points: data.latency.map(r => ({x: r.day, y: r[`latency_${q}`]})),
    })), {yMin: 0, format: v => `${Math.round(v)}`, label: "latency percentiles", empty: "no completions yet"});
    valuesTable(plot("latency-chart"), ["day", "completions", "latency_p50", "latency_p90", "latency_p99",
                                        "ttft_p50"], data.latency);

    lineChart(plot("reward-chart"), byVersion(data.reward, "reward_mean"),
              {format: v => (Math.round(v * 1000) / 1000).toString(), label: "mean reward per policy version",
               empty: "no episodes yet"});
    valuesTable(plot("reward-chart"), ["day", "policy_version", "episodes", "reward_mean"], data.reward);

    const sum = (rows, f) => rows.reduce((a, r) => a + (r[f] || 0), 0);
    const shown = sum(data.shown, "shown"), accepted = sum(data.shown, "accepted");
    const tiles = document.getElementById("tiles");
    tiles.replaceChildren(
      tile("suggestions shown", shown.toLocaleString("en")),
      tile("accepted", accepted.toLocaleString("en")),
      tile("accepted / shown", shown ? pct(accepted / shown) : "–"),
      tile("hidden by the show-gate", sum(data.shown, "gate_hidden").toLocaleString("en")),
      tile("episodes", sum(data.reward, "episodes").toLocaleString("en")),
    );
  }

  async function load() {
    const t = token();
    if (!t) {
      document.getElementById("login").hidden = false;
      status("token needed");
      document.body.dataset.ready = "login";
      return;
    }
    const days = document.getElementById("days").value;
    const project = document.getElementById("project").value.trim();
    const q = new URLSearchParams({days});
    if (project) q.set("project", project);
    status("loading…");
    const r = await fetch(`/api/dashboard?${q}`, {headers: {Authorization: `Bearer ${t}`}});
    if (r.status === 401) {
      sessionStorage.removeItem("tabloop-history-token");
      document.getElementById("login").hidden = false;
      status("that token was not accepted", true);
      document.body.dataset.ready = "login";
      return;
    }
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      status(`could not load: ${(body.error && body.error.message) || r.status}`, true);
      document.body.dataset.ready = "error";
      return;
    }
    draw(await r.json());
    document.getElementById("login").hidden = true;
    status(`updated ${new Date().toLocaleTimeString()}`);
    document.body.dataset.ready = "true";
  }

  document.getElementById("controls").addEventListener("submit", e => { e.preventDefault(); load(); });
  document.getElementById("login").addEventListener("submit", e => {
    e.preventDefault();
    sessionStorage.setItem("tabloop-history-token", document.getElementById("token").value.trim());
    load();
  });
  load().catch(err => { status(`could not load: ${err}`, true); document.body.dataset.ready = "error"; });
  setInterval(() => { if (document.body.dataset.ready === "true") load(); }, 60000);
})();
