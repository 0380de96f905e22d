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

// A formatter for the tick labels of an axis from `lo` to `hi`: as many decimals as the range needs for its two
// ends to read differently (at least two significant digits of the range), in exponent form past 1e6 or under 1e-3.
function tickFormat(lo, hi) {
  const range = hi - lo, magnitude = Math.max(Math.abs(lo), Math.abs(hi));
  const whole = Number.isInteger(lo) && Number.isInteger(hi) && range >= 1;  // steps, counts
  const decimals = whole ? 0 : range > 0 ? Math.max(0, Math.ceil(-Math.log10(range)) + 1) : 3;
  if (magnitude >= 1e6 || (magnitude > 0 && magnitude < 1e-3)) {
    const digits = Math.floor(Math.log10(magnitude)) + decimals;
    return (value) => value.toExponential(Math.min(Math.max(digits, 2), 15));
  }
  return (value) => value.toFixed(Math.min(decimals, 15));
}

// Draw `series` ([{label, points: [[x, y], ...]}]) into the SVG `svg` as polylines with axis labels, and a dashed
// line at each step in `resumes` (where the run resumed from a checkpoint) when x is the step.
function drawChart(svg, series, resumes = []) {
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
  const label = (x, y, text, anchor, axis) =>
    svg.appendChild(el("svg:text", { x, y, "font-size": 10, "text-anchor": anchor, fill: "#666", class: `tick-${axis}` }, text));
  const [fx, fy] = [tickFormat(x0, x1), tickFormat(y0, y1)];
  label(left - 4, top + 8, fy(y1), "end", "y");
  label(left - 4, height - bottom, fy(y0), "end", "y");
  label(left, height - 6, fx(x0), "start", "x");
  label(width - right, height - 6, fx(x1), "end", "x");
  for (const step of resumes.filter((step) => step >= x0 && step <= x1)) {
    const line = el("svg:line", {
      x1: sx(step), x2: sx(step), y1: top, y2: height - bottom, stroke: "#999", "stroke-dasharray": "3 2",
      class: "resume", "data-step": step,
    });
    line.appendChild(el("svg:title", {}, `resumed from step ${step}'s checkpoint`));
    svg.appendChild(line);
  }
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

function points(records, key, x = "step") {
  return records
    .filter((r) => typeof r[key] === "number" && typeof r[x] === "number")
    .map((r) => [r[x], r[key]]);
}

function keysMatching(records, pattern) {
  const keys = new Set();
  for (const r of records) for (const k of Object.keys(r)) if (pattern.test(k)) keys.add(k);
  return [...keys].sort();
}

// Each chart: a title and its series as [records group, key, label] or a pattern over one group's keys, over
// `x` (default: step). The trainer logs its idle time per step, the orchestrator the inference servers'
// cumulatively; the server derives each from the other, so each idle chart has one kind of quantity.
const CHARTS = [
  { id: "reward", title: "reward", series: [["orchestrator", "reward", "overall"]], pattern: ["orchestrator", /^reward\/.+/] },
  { id: "loss", title: "loss", series: [["trainer", "loss", "loss"]] },
  { id: "masked", title: "masked token fraction", series: [["trainer", "masked_low", "low"], ["trainer", "masked_high", "high"]] },
  { id: "mismatch_kl", title: "trainer vs sampler KL by policy lag (versions the trainer's policy is ahead of the token's sampler; lag 0: the pure mismatch)", series: [["trainer", "mismatch_kl", "lag 0"], ["trainer", "off_policy_kl", "all tokens"]], pattern: ["trainer", /^off_policy_kl\/lag.+/] },
  { id: "entropy", title: "entropy", series: [["trainer", "entropy", "entropy"]] },
  { id: "grad_norm", title: "grad norm", series: [["trainer", "grad_norm", "grad norm"]] },
  { id: "tokens_per_s", title: "tokens per second", series: [["trainer", "tokens_per_s", "trainer"], ["orchestrator", "rollout_tokens_per_s", "rollouts"]] },
  { id: "step_time", title: "step time (s)", series: [["trainer", "step_time_s", "trainer step"], ["orchestrator", "batch_time_s", "orchestrator batch"]] },
  { id: "idle_step", title: "idle time per step (s): trainer waiting for a batch, inference with nothing in flight", series: [["trainer", "idle_s", "trainer"], ["orchestrator", "inference_idle_step_s", "inference"]] },
  { id: "idle_total", title: "cumulative idle time (s)", series: [["trainer", "idle_total_s", "trainer"], ["orchestrator", "inference_idle_s", "inference"]] },
  { id: "staleness", title: "staleness: batch step minus a rollout's oldest policy version (mean; its oldest token's policy lag + 1)", series: [["orchestrator", "staleness_mean", "mean staleness"]] },
  { id: "online_eval", title: "online eval reward", series: [], pattern: ["evals", /^eval\/.+\/reward$/] },
  { id: "online_eval_pass", title: "online eval pass@k", series: [], pattern: ["evals", /^eval\/.+\/pass@\d+$/] },
  { id: "inference_tokens", title: "inference tokens per second (x: seconds up)", x: "uptime_s", series: [["inference", "tokens_per_s", "tokens/s"]] },
  { id: "inference_queue", title: "inference requests (x: seconds up)", x: "uptime_s", series: [["inference", "running", "running"], ["inference", "waiting", "waiting"]] },
  { id: "kv_usage", title: "KV cache use (x: seconds up)", x: "uptime_s", series: [["inference", "kv_usage", "used"]] },
];

function chartSeries(chart, data) {
  const x = chart.x ?? "step";
  const series = chart.series.map(([group, key, label]) => ({ label, points: points(data[group], key, x) }));
  if (chart.pattern) {
    const [group, pattern] = chart.pattern;
    for (const key of keysMatching(data[group], pattern)) series.push({ label: key, points: points(data[group], key, x) });
  }
  return series;
}

const RL_KINDS = ["rl", "orchestrator"];

async function runPage() {
  document.getElementById("title").textContent = RUN_NAME;
  const base = `/api/runs/${encodeURIComponent(RUN_NAME)}`;
  const container = document.getElementById("charts");
  const views = CHARTS.map((chart) => {
    const box = el("div", { class: "chart", id: `chart-${chart.id}` });
    box.append(el("h3", {}, chart.title), el("div", { class: "legend" }));
    const svg = el("svg:svg", { "data-chart": chart.id });
    box.appendChild(svg);
    container.appendChild(box);
    return { chart, box, svg };
  });
  let browser = null;
  async function refresh() {
    const data = await getJSON(`${base}/metrics?max_points=400`);
    let shown = 0;
    for (const { chart, box, svg } of views) {
      const series = chartSeries(chart, data);
      drawChart(svg, series, (chart.x ?? "step") === "step" ? data.resumes : []);
      const legend = series.map((s, i) => s.points.length &&
        el("span", { style: `color:${COLORS[i % COLORS.length]}` }, `${s.label}: ${fmt(s.points[s.points.length - 1][1])}`));
      box.querySelector(".legend").replaceChildren(...legend.filter(Boolean));
      box.hidden = !series.some((s) => s.points.length);  // a chart this kind of run has no data for
      shown += !box.hidden;
    }
    const { trainer, orchestrator, inference } = data.steps;
    document.getElementById("info").textContent = `${data.kind} · trainer steps ${trainer} · orchestrator steps ${orchestrator}` +
      (inference ? ` · inference heartbeats ${inference}` : "") +
      (data.resumes.length ? ` · resumed from step ${data.resumes.join(", ")} (dashed lines)` : "") + (shown ? "" : " · no metrics yet");
    if (!browser && RL_KINDS.includes(data.kind)) {
      const section = document.getElementById("rollouts");
      section.hidden = false;
      browser = sampleBrowser(section.querySelector(".browser"), { api: `${base}/samples`, filters: RL_FILTERS, columns: RL_COLUMNS });
      await browser.refresh();
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
      const problems = el("td", { class: "problems" }, (run.problems ?? []).join("; "));
      return row([link, run.kind, status, started, run.steps, run.last_reward, problems], { "data-run": run.name });
    }));
  }
  await refresh();
  setInterval(() => refresh().catch(console.error), 5000);
}

const OUTCOMES = ["ok", "truncated", "timeout", "error"];

// A message content's text: a string, or its parts (text as is, an image as "[image]", shown under the cell).
function contentText(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content) && content.every((part) => part?.type)) {
    return content.map((part) => (part.type === "text" ? part.text : "[image]")).join("");
  }
  return JSON.stringify(content);
}

// The inline images (data URLs only: the page loads nothing from elsewhere) of chat messages, in order.
function chatImages(value) {
  if (!Array.isArray(value)) return [];
  return value.flatMap((m) => (Array.isArray(m?.content) ? m.content : []))
    .map((part) => (part?.type === "image_url" ? part.image_url?.url : part?.type === "image" ? part.image : null))
    .filter((url) => typeof url === "string" && url.startsWith("data:image/"));
}

// A prompt or completion: a string, or chat messages shown as "role: content" lines, an assistant's tool calls
// under it ("  call name(arguments)") and a tool's result as "tool name: result".
function chatText(value) {
  const text = (content) => (typeof content === "string" ? content : contentText(content));
  const line = (m) => {
    const who = m?.role === "tool" && m?.name ? `tool ${m.name}` : m?.role;
    const calls = (m?.tool_calls ?? []).map((c) => `\n  call ${c?.function?.name}(${text(c?.function?.arguments)})`);
    return `${who}: ${m?.content === null || m?.content === undefined ? "" : text(m.content)}${calls.join("")}`;
  };
  if (Array.isArray(value)) return value.map(line).join("\n");
  return value === null || value === undefined ? "" : text(value);
}

// The sample browser's filters: a label and an input each, sent as the query value of the same name.
const FILTER_INPUTS = {
  source: () => ["source", el("select", { id: "source" })],
  outcome: () => ["outcome", el("select", { id: "outcome" })],
  step: () => ["step", el("input", { id: "step", type: "number", min: 0, step: 1, size: 5 })],
  min_reward: () => ["min reward", el("input", { id: "min_reward", type: "number", step: "any", size: 5 })],
  max_reward: () => ["max reward", el("input", { id: "max_reward", type: "number", step: "any", size: 5 })],
};
const EVAL_FILTERS = ["source", "outcome", "min_reward", "max_reward"];
const RL_FILTERS = ["step", "source", "outcome", "min_reward", "max_reward"];

// Columns: [header, value of a sample, "pre" for long text].
const TEXT_COLUMNS = [
  ["prompt", (s) => chatText(s.prompt ?? s.messages), "pre", (s) => chatImages(s.prompt ?? s.messages)],
  ["completion", (s) => chatText(s.completion), "pre"],
  ["metrics", (s) => JSON.stringify(s.metrics ?? {}), "pre"],
];
const EVAL_COLUMNS = [
  ["source", (s) => s.source], ["task", (s) => s.task?.id], ["outcome", (s) => s.outcome], ["reward", (s) => s.reward],
  ...TEXT_COLUMNS,
];
const RL_COLUMNS = [
  ["step", (s) => s.step], ["source", (s) => s.source], ["task", (s) => s.task_id], ["outcome", (s) => s.outcome],
  ["reward", (s) => s.reward], ["advantage", (s) => s.advantage], ["policy version", (s) => s.version],
  ...TEXT_COLUMNS,
];

// A filterable, paged table of the samples `api` serves, built into `container`. Filters start from the
// page's URL (`?outcome=timeout`); the source select lists the sources the file holds.
function sampleBrowser(container, { api, filters, columns }) {
  const limit = 50;
  const initial = new URLSearchParams(location.search);
  let offset = 0, total = 0;
  const inputs = {};
  const bar = el("div", { class: "filters" });
  for (const id of filters) {
    const [label, input] = FILTER_INPUTS[id]();
    if (input.tagName === "SELECT") input.appendChild(el("option", { value: "" }, "any"));
    inputs[id] = input;
    const wrap = el("label", {}, `${label} `);
    wrap.appendChild(input);
    bar.appendChild(wrap);
  }
  const button = (label, onclick) => { const b = el("button", {}, label); b.onclick = onclick; bar.append(b, " "); return b; };
  const count = el("span", { id: "count" });
  const table = el("table", { id: "samples" });
  table.append(el("thead"), el("tbody"));
  table.tHead.appendChild(row(columns.map(([header]) => el("th", {}, header))));
  container.append(bar, table);

  function addOption(id, value) {
    const select = inputs[id];
    if (!select || [...select.options].some((o) => o.value === value)) return;
    select.appendChild(el("option", { value }, value));
    if (initial.get(id) === value) select.value = value;
  }
  async function refresh() {
    const query = new URLSearchParams({ offset, limit });
    for (const [id, input] of Object.entries(inputs)) if (input.value !== "") query.set(id, input.value);
    const data = await getJSON(`${api}?${query}`);
    for (const source of data.sources ?? []) addOption("source", source);
    count.textContent = `${data.total} matching, showing ${data.total ? offset + 1 : 0}-${offset + data.samples.length}` +
      (data.error ? ` (${data.error})` : "");
    table.tBodies[0].replaceChildren(...data.samples.map((s) => {
      const cells = columns.map(([, value, kind, images]) => {
        if (kind !== "pre") return value(s);
        const td = el("td");
        td.appendChild(el("pre", {}, value(s) ?? ""));
        for (const url of images ? images(s) : []) td.appendChild(el("img", { src: url, class: "sample-image" }));
        return td;
      });
      return row(cells, { "data-outcome": s.outcome });
    }));
    total = data.total;
    table.dataset.total = String(total);
  }
  const reload = () => refresh().catch(console.error);
  button("prev", () => { offset = Math.max(0, offset - limit); reload(); });
  button("next", () => { if (offset + limit < total) { offset += limit; reload(); } });
  button("last", () => { offset = Math.max(0, Math.floor((total - 1) / limit) * limit); reload(); });
  bar.appendChild(count);
  for (const outcome of OUTCOMES) addOption("outcome", outcome);
  for (const [id, input] of Object.entries(inputs)) {
    if (input.tagName === "SELECT" && initial.get(id)) addOption(id, initial.get(id));
    else if (initial.has(id)) input.value = initial.get(id);
    input.addEventListener("change", () => { offset = 0; reload(); });
  }
  return { refresh };
}

async function evalPage() {
  document.getElementById("title").textContent = RUN_NAME;
  const base = `/api/evals/${encodeURIComponent(RUN_NAME)}`;
  const browser = sampleBrowser(document.getElementById("samples-browser"),
    { api: `${base}/samples`, filters: EVAL_FILTERS, columns: EVAL_COLUMNS });
  async function refreshSummary() {
    const data = await getJSON(`${base}/summary`);
    document.getElementById("info").textContent = data.final ? "finished (summary.json)" : "in progress (from traces)";
    const sources = Object.entries(data.sources);
    const ks = [...new Set(sources.flatMap(([, s]) => Object.keys(s.pass_at_k ?? {})))].sort((a, b) => a - b);
    const head = ["source", "rollouts", "mean reward", ...ks.map((k) => `pass@${k}`), ...OUTCOMES];
    document.querySelector("#summary thead").replaceChildren(row(head.map((h) => el("th", {}, h))));
    document.querySelector("#summary tbody").replaceChildren(...sources.map(([name, s]) => {
      const cells = [name, s.rollouts, s.mean_reward, ...ks.map((k) => s.pass_at_k?.[k])];
      const tr = row(cells, { "data-source": name });
      for (const outcome of OUTCOMES) tr.appendChild(el("td", { "data-outcome": outcome }, fmt(s.outcomes?.[outcome] ?? 0)));
      return tr;
    }));
  }
  await refreshSummary();
  await browser.refresh();
  setInterval(() => refreshSummary().catch(console.error), 5000);
}

const PAGES = { index: indexPage, run: runPage, eval: evalPage };
PAGES[document.body.dataset.page]().catch((error) => {
  document.body.appendChild(el("p", { class: "status-failed" }, `error: ${error.message}`));
});
