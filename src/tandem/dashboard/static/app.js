// tandem dashboard: plain JS, no build, no network beyond this server. Charts are inline SVG.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#1a5fb4", "#c01c28", "#26a269", "#e66100", "#613583", "#865e3c", "#0a8a8a", "#a51d6d"];
const RUN_NAME = decodeURIComponent(location.pathname.split("/").pop());

function el(tag, attrs = {}, text = null) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) throw new Error(`${url}: ${response.status}`);
  return response.json();
}

function fmt(value) {
  if (value === null || value === undefined) return "";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  return Math.abs(value) >= 1000 || Math.abs(value) < 0.001 ? value.toExponential(2) : value.toFixed(3);
}

// Draw `series` ([{label, points: [[x, y], ...]}]) into the SVG `svg` as polylines with axis labels.
function drawChart(svg, series) {
  const width = 360, height = 160, left = 48, right = 8, top = 8, bottom = 20;
  svg.replaceChildren();
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const all = series.flatMap((s) => s.points);
  svg.dataset.points = String(all.length);
  if (!all.length) {
    svg.appendChild(el("svg:text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, "no data"));
    return;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const sx = (x) => left + ((x - x0) / (x1 - x0)) * (width - left - right);
  const sy = (y) => top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom);
  svg.appendChild(el("svg:rect", { x: left, y: top, width: width - left - right, height: height - top - bottom, fill: "none", stroke: "#ddd" }));
  const label = (x, y, text, anchor) => svg.appendChild(el("svg:text", { x, y, "font-size": 10, "text-anchor": anchor, fill: "#666" }, text));
  label(left - 4, top + 8, fmt(y1), "end");
  label(left - 4, height - bottom, fmt(y0), "end");
  label(left, height - 6, fmt(x0), "start");
  label(width - right, height - 6, fmt(x1), "end");
  series.forEach((s, i) => {
    if (!s.points.length) return;
    const color = COLORS[i % COLORS.length];
    const attrs = {
      fill: "none", stroke: color, "stroke-width": 1.5, class: "series",
      "data-series": s.label, "data-points": s.points.length, "data-last-step": s.points[s.points.length - 1][0],
      points: s.points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "),
    };
    svg.appendChild(el("svg:polyline", attrs));
    if (s.points.length === 1) {
      svg.appendChild(el("svg:circle", { cx: sx(s.points[0][0]), cy: sy(s.points[0][1]), r: 2.5, fill: color }));
    }
  });
}

function points(records, key) {
  return records
    .filter((r) => typeof r[key] === "number" && typeof r.step === "number")
    .map((r) => [r.step, r[key]]);
}

function keysMatching(records, pattern) {
  const keys = new Set();
  for (const r of records) for (const k of Object.keys(r)) if (pattern.test(k)) keys.add(k);
  return [...keys].sort();
}

// Each chart: a title and its series as [records group, key, label] or a pattern over one group's keys.
const CHARTS = [
  { id: "reward", title: "reward", series: [["orchestrator", "reward", "overall"]], pattern: ["orchestrator", /^reward\/.+/] },
  { id: "loss", title: "loss", series: [["trainer", "loss", "loss"]] },
  { id: "masked", title: "masked token fraction", series: [["trainer", "masked_low", "low"], ["trainer", "masked_high", "high"]] },
  { id: "mismatch_kl", title: "mismatch KL", series: [["trainer", "mismatch_kl", "mismatch KL"]] },
  { id: "entropy", title: "entropy", series: [["trainer", "entropy", "entropy"]] },
  { id: "grad_norm", title: "grad norm", series: [["trainer", "grad_norm", "grad norm"]] },
  { id: "tokens_per_s", title: "tokens per second", series: [["trainer", "tokens_per_s", "trainer"], ["orchestrator", "rollout_tokens_per_s", "rollouts"]] },
  { id: "step_time", title: "step time (s)", series: [["trainer", "step_time_s", "trainer step"], ["orchestrator", "batch_time_s", "orchestrator batch"]] },
  { id: "idle", title: "idle time (s)", series: [["trainer", "idle_s", "trainer"], ["orchestrator", "inference_idle_s", "inference"]] },
  { id: "staleness", title: "staleness (mean version lag)", series: [["orchestrator", "staleness_mean", "mean lag"]] },
  { id: "online_eval", title: "online eval reward", series: [], pattern: ["evals", /^eval\/.+\/reward$/] },
  { id: "online_eval_pass", title: "online eval pass@k", series: [], pattern: ["evals", /^eval\/.+\/pass@\d+$/] },
];

function chartSeries(chart, data) {
  const series = chart.series.map(([group, key, label]) => ({ label, points: points(data[group], key) }));
  if (chart.pattern) {
    const [group, pattern] = chart.pattern;
    for (const key of keysMatching(data[group], pattern)) series.push({ label: key, points: points(data[group], key) });
  }
  return series;
}

async function runPage() {
  document.getElementById("title").textContent = RUN_NAME;
  const container = document.getElementById("charts");
  const views = CHARTS.map((chart) => {
    const box = el("div", { class: "chart", id: `chart-${chart.id}` });
    box.append(el("h3", {}, chart.title), el("div", { class: "legend" }));
    const svg = el("svg:svg", { "data-chart": chart.id });
    box.appendChild(svg);
    container.appendChild(box);
    return { chart, box, svg };
  });
  async function refresh() {
    const data = await getJSON(`/api/runs/${encodeURIComponent(RUN_NAME)}/metrics?max_points=400`);
    document.getElementById("info").textContent =
      `${data.kind} · trainer steps ${data.steps.trainer} · orchestrator steps ${data.steps.orchestrator}`;
    for (const { chart, box, svg } of views) {
      const series = chartSeries(chart, data);
      drawChart(svg, series);
      const legend = series.map((s, i) => s.points.length &&
        el("span", { style: `color:${COLORS[i % COLORS.length]}` }, `${s.label}: ${fmt(s.points[s.points.length - 1][1])}`));
      box.querySelector(".legend").replaceChildren(...legend.filter(Boolean));
    }
  }
  await refresh();
  setInterval(() => refresh().catch(console.error), 3000);
}

function row(cells, attrs = {}) {
  const tr = el("tr", attrs);
  for (const cell of cells) tr.appendChild(cell instanceof Node ? cell : el("td", {}, fmt(cell)));
  return tr;
}

async function indexPage() {
  async function refresh() {
    const data = await getJSON("/api/runs");
    document.getElementById("outputs").textContent = `outputs: ${data.outputs}`;
    document.querySelector("#runs tbody").replaceChildren(...data.runs.map((run) => {
      const link = el("td");
      link.appendChild(el("a", { href: `/${run.kind === "eval" ? "eval" : "run"}/${encodeURIComponent(run.name)}` }, run.name));
      const status = el("td", { class: `status-${run.status}` }, run.status);
      const started = new Date(run.started * 1000).toLocaleString();
      return row([link, run.kind, status, started, run.steps, run.last_reward], { "data-run": run.name });
    }));
  }
  await refresh();
  setInterval(() => refresh().catch(console.error), 5000);
}

const OUTCOMES = ["ok", "truncated", "timeout", "error"];
const FILTERS = ["source", "outcome", "min_reward", "max_reward"];

// A prompt or completion: a string, or chat messages shown as "role: content" lines.
function chatText(value) {
  if (Array.isArray(value)) return value.map((m) => `${m.role}: ${m.content}`).join("\n");
  return value === null || value === undefined ? "" : String(value);
}

async function evalPage() {
  document.getElementById("title").textContent = RUN_NAME;
  const base = `/api/evals/${encodeURIComponent(RUN_NAME)}`;
  let offset = 0, total = 0;
  const limit = 50;
  async function refreshSummary() {
    const data = await getJSON(`${base}/summary`);
    document.getElementById("info").textContent = data.final ? "finished (summary.json)" : "in progress (from traces)";
    const sources = Object.entries(data.sources);
    const select = document.getElementById("source");
    for (const [name] of sources) {
      if (![...select.options].some((o) => o.value === name)) select.appendChild(el("option", { value: name }, name));
    }
    const ks = [...new Set(sources.flatMap(([, s]) => Object.keys(s.pass_at_k)))].sort((a, b) => a - b);
    const head = ["source", "rollouts", "mean reward", ...ks.map((k) => `pass@${k}`), ...OUTCOMES];
    document.querySelector("#summary thead").replaceChildren(row(head.map((h) => el("th", {}, h))));
    document.querySelector("#summary tbody").replaceChildren(...sources.map(([name, s]) => {
      const cells = [name, s.rollouts, s.mean_reward, ...ks.map((k) => s.pass_at_k[k])];
      const tr = row(cells, { "data-source": name });
      for (const outcome of OUTCOMES) tr.appendChild(el("td", { "data-outcome": outcome }, fmt(s.outcomes[outcome] ?? 0)));
      return tr;
    }));
  }
  async function refreshSamples() {
    const query = new URLSearchParams({ offset, limit });
    for (const id of FILTERS) {
      const value = document.getElementById(id).value;
      if (value !== "") query.set(id, value);
    }
    const data = await getJSON(`${base}/samples?${query}`);
    document.getElementById("count").textContent =
      `${data.total} matching, showing ${data.total ? offset + 1 : 0}-${offset + data.samples.length}`;
    document.querySelector("#samples tbody").replaceChildren(...data.samples.map((s) => {
      const pre = (text) => { const td = el("td"); td.appendChild(el("pre", {}, text ?? "")); return td; };
      return row([s.source, s.task?.id, s.outcome, s.reward, pre(chatText(s.prompt ?? s.messages)), pre(chatText(s.completion)), pre(JSON.stringify(s.metrics ?? {}))],
        { "data-outcome": s.outcome });
    }));
    total = data.total;
    document.getElementById("samples").dataset.total = String(total);
  }
  const initial = new URLSearchParams(location.search);  // filters can come from the URL: ?outcome=timeout
  for (const id of FILTERS) {
    if (initial.has(id)) document.getElementById(id).value = initial.get(id);
    document.getElementById(id).addEventListener("change", () => { offset = 0; refreshSamples().catch(console.error); });
  }
  document.getElementById("prev").onclick = () => { offset = Math.max(0, offset - limit); refreshSamples(); };
  document.getElementById("next").onclick = () => { if (offset + limit < total) { offset += limit; refreshSamples(); } };
  await refreshSummary();
  if (initial.has("source")) document.getElementById("source").value = initial.get("source");
  await refreshSamples();
  setInterval(() => refreshSummary().catch(console.error), 5000);
}

const PAGES = { index: indexPage, run: runPage, eval: evalPage };
PAGES[document.body.dataset.page]().catch((error) => {
  document.body.appendChild(el("p", { class: "status-failed" }, `error: ${error.message}`));
});
