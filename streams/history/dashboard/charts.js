// Small SVG charts, no libraries: a line chart (series over days) and a grouped bar chart.
// Every mark carries its numbers as data-series / data-x / data-value and a <title>, so a person
// hovering and a test reading the DOM see the same values the chart is drawn from.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
                 "#4b5563", "#65a30d"];

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (parent) parent.appendChild(node);
  return node;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function frame(container, xs, yMin, yMax, yFormat, opts) {
  const W = 640, H = 260, L = 56, R = 12, T = 12, B = 46;
  const svg = el("svg", {viewBox: `0 0 ${W} ${H + 24}`, role: "img", "aria-label": opts.label || "chart"});
  container.replaceChildren(svg);
  const plotW = W - L - R, plotH = H - T - B;
  const y = v => T + plotH - (v - yMin) / (yMax - yMin || 1) * plotH;
  const grid = el("g", {class: "grid"}, svg), axis = el("g", {class: "axis"}, svg);
  for (let i = 0; i <= 4; i++) {
    const v = yMin + (yMax - yMin) * i / 4;
    el("line", {x1: L, x2: W - R, y1: y(v), y2: y(v)}, grid);
    const t = el("text", {x: L - 6, y: y(v) + 4, "text-anchor": "end"}, axis);
    t.textContent = yFormat(v);
  }
  // Bars sit in the middle of equal slots; line points run edge to edge.
  const step = opts.slots ? plotW / xs.length : (xs.length > 1 ? plotW / (xs.length - 1) : 0);
  const x = opts.slots ? (i => L + (i + 0.5) * step) : (i => xs.length > 1 ? L + i * step : L + plotW / 2);
  const every = Math.max(1, Math.ceil(xs.length / 8));
  xs.forEach((label, i) => {
    if (i % every) return;
    const t = el("text", {x: x(i), y: H - B + 16, "text-anchor": "middle"}, axis);
    t.textContent = label.slice(5);  // MM-DD
  });
  return {svg, x, y, L, R, T, B, W, H, plotW, plotH, step};
}

function legend(f, names) {
  const g = el("g", {class: "legend"}, f.svg);
  let at = f.L;
  names.forEach((name, i) => {
    el("rect", {x: at, y: f.H + 6, width: 10, height: 10, fill: PALETTE[i % PALETTE.length]}, g);
    const t = el("text", {x: at + 14, y: f.H + 15}, g);
    t.textContent = name;
    at += 24 + 7 * name.length;
  });
}

function empty(container, message) {
  const svg = el("svg", {viewBox: "0 0 640 80", "data-empty": "true"});
  const t = el("text", {x: 320, y: 44, "text-anchor": "middle", class: "empty"}, svg);
  t.textContent = message;
  container.replaceChildren(svg);
}

// series: [{name, points: [{x: "YYYY-MM-DD", y: number}]}]
function lineChart(container, series, opts) {
  opts = opts || {};
  const xs = [...new Set(series.flatMap(s => s.points.map(p => p.x)))].sort();
  if (!xs.length) return empty(container, opts.empty || "no data yet");
  const values = series.flatMap(s => s.points.map(p => p.y)).filter(v => v !== null && isFinite(v));
  const lowest = Math.min(0, ...values);
  const yMin = opts.yMin !== undefined ? opts.yMin : (lowest < 0 ? -niceMax(-lowest) : 0);
  const yMax = opts.yMax !== undefined ? opts.yMax : niceMax(Math.max(...values));
  const fmt = opts.format || (v => String(Math.round(v * 100) / 100));
  const f = frame(container, xs, yMin, yMax, fmt, opts);
  const index = new Map(xs.map((x, i) => [x, i]));
  series.forEach((s, si) => {
    const color = PALETTE[si % PALETTE.length];
    const pts = s.points.filter(p => p.y !== null && isFinite(p.y)).sort((a, b) => a.x < b.x ? -1 : 1);
    const g = el("g", {class: "series", "data-series": s.name}, f.svg);
    if (pts.length > 1) {
      el("polyline", {fill: "none", stroke: color, "stroke-width": 2,
                      points: pts.map(p => `${f.x(index.get(p.x))},${f.y(p.y)}`).join(" ")}, g);
    }
    for (const p of pts) {
      const c = el("circle", {cx: f.x(index.get(p.x)), cy: f.y(p.y), r: 3.5, fill: color,
                              "data-series": s.name, "data-x": p.x, "data-value": p.y}, g);
      el("title", {}, c).textContent = `${s.name} ${p.x}: ${fmt(p.y)}`;
    }
  });
  legend(f, series.map(s => s.name));
  return f.svg;
}

// groups: x labels; series: [{name, values: {x: number}}]
function barChart(container, xs, series, opts) {
  opts = opts || {};
  if (!xs.length) return empty(container, opts.empty || "no data yet");
  const values = series.flatMap(s => xs.map(x => s.values[x] || 0));
  const yMax = niceMax(Math.max(...values));
  const fmt = opts.format || (v => String(Math.round(v)));
  const f = frame(container, xs, 0, yMax, fmt, Object.assign({slots: true}, opts));
  const barW = Math.max(2, Math.min(28, f.step * 0.8 / series.length));
  series.forEach((s, si) => {
    const color = PALETTE[si % PALETTE.length];
    const g = el("g", {class: "series", "data-series": s.name}, f.svg);
    xs.forEach((x, i) => {
      const v = s.values[x] || 0;
      const left = f.x(i) - barW * series.length / 2 + si * barW;
      const r = el("rect", {x: left, y: f.y(v), width: barW - 1, height: f.y(0) - f.y(v), fill: color,
                            "data-series": s.name, "data-x": x, "data-value": v}, g);
      el("title", {}, r).textContent = `${s.name} ${x}: ${fmt(v)}`;
    });
  });
  legend(f, series.map(s => s.name));
  return f.svg;
}

function valuesTable(container, columns, rows) {
  const details = document.createElement("details");
  details.className = "values";
  const summary = document.createElement("summary");
  summary.textContent = "values";
  const table = document.createElement("table");
  const head = table.createTHead().insertRow();
  for (const c of columns) { const th = document.createElement("th"); th.textContent = c; head.appendChild(th); }
  const body = table.createTBody();
  for (const r of rows) {
    const tr = body.insertRow();
    for (const c of columns) tr.insertCell().textContent = r[c] === null || r[c] === undefined ? "" : String(r[c]);
  }
  details.append(summary, table);
  container.appendChild(details);
}

window.TabloopCharts = {lineChart, barChart, valuesTable};
