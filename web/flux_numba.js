// FluxNumba web extension (ComfyUI frontend >= 1.x, served from /extensions/<pack>/flux_numba.js).
//
// * FluxNumbaStepTimer: a live bar chart of step times (one bar per step; colour per label, so a
//   "stock" and a "patched" run are told apart), with mean/min/max/total ms and it/s per label.
//   Every number comes from the server's "flux_numba.run" / "flux_numba.step" messages
//   (nodes/timer.py); this file only draws.  The series live in node.properties.flux_numba_series,
//   so they are saved with the workflow and survive a page reload.  "export JSON" button + menu entry.
// * FluxNumbaTimingReport / FluxNumbaQualityCompare: show the node's {"ui": {"text": [...]}} output.
//
// Test hooks: the chart element is  div[data-flux-numba-chart][data-node-id="<id>"]  with
// data-bars="<number of bars>", data-slots="<step slots>" and one  rect.flux-numba-bar  per bar; a
// row  .flux-numba-stats-row[data-label][data-run][data-status][data-model]  per series;
// window.fluxNumba.bars(id).  What is said in words comes from flux_numba_view.js.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import {
  BAD, GRAPH_COLOURS, axisCaption, drawnAsIs, emptyPlotText, fmt, notes, runStatus, seriesColour, showsGraphs,
  slotCount, stateWords, statsText,
} from "./flux_numba_view.js";

const TIMER = "FluxNumbaStepTimer";
const TEXT_NODES = ["FluxNumbaTimingReport", "FluxNumbaQualityCompare"];
const PROP = "flux_numba_series";
const TEXT_PROP = "flux_numba_text";
const MAX_LABELS = 8;
const SVGNS = "http://www.w3.org/2000/svg";

// every timer chart on the page shares one y-scale, so two charts compare at a glance
function timerNodes() {
  const out = [];
  const walk = (g) => {
    for (const n of g?._nodes ?? g?.nodes ?? []) if (n.comfyClass === TIMER) out.push(n);
    for (const sg of g?.subgraphs?.values?.() ?? []) walk(sg);
  };
  walk(app.graph);
  return out;
}

function globalMaxMs() {
  let m = 0;
  for (const n of timerNodes()) {
    const st = n.properties?.[PROP];
    for (const s of Object.values(st?.series ?? {})) for (const p of s.steps ?? []) m = Math.max(m, p.ms || 0);
  }
  return m;
}

function redrawAll() {
  for (const n of timerNodes()) redraw(n);
}

function findNode(id) {
  if (id === null || id === undefined) return null;
  const g = app.graph;
  let n = g.getNodeById(id) ?? g.getNodeById(Number(id));
  if (!n && typeof id === "string" && id.includes(":")) {
    // node inside a subgraph: "<parent>:<child>" -- look for the child in the subgraphs
    const last = id.split(":").pop();
    for (const sg of g.subgraphs?.values?.() ?? []) {
      n = sg.getNodeById?.(Number(last)) ?? sg.getNodeById?.(last);
      if (n) break;
    }
  }
  return n && n.comfyClass === TIMER ? n : null;
}

function state(node) {
  node.properties = node.properties || {};
  let st = node.properties[PROP];
  if (!st || typeof st !== "object" || !st.series) st = node.properties[PROP] = { series: {}, order: [] };
  return st;
}

function seriesFor(node, d) {
  const st = state(node);
  const label = String(d.label ?? "");
  let s = st.series[label];
  if (!s || s.run !== d.run) {
    s = st.series[label] = {
      run: d.run, label, total_steps: d.total_steps ?? null, device: d.device ?? null,
      patch: d.patch ?? null, steps: [], summary: null, backends: null, profile: null, done: false,
      model: d.model ?? null, error: null, graphs: null,
    };
    st.order = st.order.filter((l) => l !== label);
    st.order.push(label);
    while (st.order.length > MAX_LABELS) delete st.series[st.order.shift()];
  }
  return s;
}

function onRun(ev) {
  const d = ev.detail;
  const node = findNode(d?.node);
  if (!node) return;
  const s = seriesFor(node, d);
  if (d.phase === "start") {
    s.total_steps = d.total_steps ?? s.total_steps;
    s.device = d.device ?? s.device;
    s.steps = [];
    s.done = false;
    s.summary = null;
    s.error = null;
    s.model = d.model ?? s.model;
  } else if (d.phase === "end") {
    s.done = true;
    s.summary = d.summary ?? s.summary;
    s.backends = d.backends ?? null;
    s.profile = d.profile ?? null;
    s.error = d.error ?? null;
    s.model = d.model ?? s.model;
    s.graphs = d.graphs ?? null;
    if (d.patch !== undefined) s.patch = d.patch;
  }
  redrawAll();
  if (d.phase === "end") markChanged();
}

// node.properties changed outside the frontend's change tracking: let it notice, so the workflow
// (with the series) is persisted for a page reload.  captureCanvasState() is the call on newer
// frontends (1.49: checkState() is deprecated); checkState() where it is the only one (1.35).
function markChanged() {
  try {
    const tracker = app.extensionManager?.workflow?.activeWorkflow?.changeTracker;
    if (typeof tracker?.captureCanvasState === "function") tracker.captureCanvasState();
    else tracker?.checkState?.();
  } catch (e) {
    console.debug("FluxNumba: saving the chart's series in the workflow failed", e);
  }
}

function onStep(ev) {
  const d = ev.detail;
  const node = findNode(d?.node);
  if (!node) return;
  const s = seriesFor(node, d);
  s.steps.push({ index: d.index, step: d.step, ms: d.ms, sigma: d.sigma ?? null, profiled: !!d.profiled,
    graphs: d.graphs ?? null, host_ms: d.host_ms ?? null, host_bound: !!d.host_bound });
  s.summary = d.summary ?? s.summary;
  s.total_steps = d.total_steps ?? s.total_steps;
  if (d.profile) s.profile = d.profile;
  redrawAll();
}

function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (parent) parent.appendChild(el);
  return el;
}

// the chart is drawn in the SVG's own pixels (viewBox = its size, redrawn when that changes), so the
// text is never stretched: no preserveAspectRatio="none"
function chartSize(ui) {
  const w = Math.round(ui.svg.clientWidth || 0), h = Math.round(ui.svg.clientHeight || 0);
  return w >= 60 && h >= 40 ? [w, h] : [400, 150];
}

function wrapWords(text, perLine) {
  const out = [];
  let cur = "";
  for (const word of String(text).split(/\s+/)) {
    for (let w = word; w.length; w = w.slice(perLine)) {
      const piece = w.slice(0, perLine);
      if (cur && cur.length + 1 + piece.length > perLine) { out.push(cur); cur = piece; } else cur = cur ? cur + " " + piece : piece;
    }
  }
  if (cur) out.push(cur);
  return out;
}

function redraw(node) {
  const ui = node.__fluxNumba;
  if (!ui) return;
  const st = state(node);
  const labels = st.order.filter((l) => st.series[l]);
  const series = labels.map((l) => st.series[l]);
  const nSlots = slotCount(series);
  const nBarsIn = series.reduce((a, s) => a + s.steps.length, 0);
  const maxMs = Math.max(0, globalMaxMs(), ...series.flatMap((s) => s.steps.map((p) => p.ms || 0)));
  const [W, H] = chartSize(ui);
  ui.size = [W, H];
  const padL = 40, padB = 26, padT = 6, padR = 6;
  const chart = ui.svg;
  chart.setAttribute("viewBox", `0 0 ${W} ${H}`);
  chart.replaceChildren();
  svg("rect", { x: 0, y: 0, width: W, height: H, fill: "#1e1e1e" }, chart);
  const defs = svg("defs", {}, chart);
  const pat = svg("pattern", { id: `flux-numba-hatch-${node.id}`, width: 4, height: 4, patternUnits: "userSpaceOnUse",
    patternTransform: "rotate(45)" }, defs);
  svg("rect", { width: 4, height: 4, fill: "#b0b0b0" }, pat);
  svg("line", { x1: 0, y1: 0, x2: 0, y2: 4, stroke: "#555", "stroke-width": 1.5 }, pat);
  let bars = 0;
  const withGraphs = series.some(showsGraphs);
  if (nBarsIn > 0 && maxMs > 0 && nSlots > 0) {
    const plotW = W - padL - padR, plotH = H - padB - padT - (withGraphs ? 4 : 0);
    const slot = plotW / nSlots;
    const bw = Math.max(1, (slot * 0.85) / series.length);
    const tickNd = maxMs >= 100 ? 0 : 1;  // one format for the three ticks ("0" / "547" / "1093", "0.0" / "42.5" / "85.0")
    for (const frac of [0, 0.5, 1]) {
      const y = padT + plotH * (1 - frac);
      svg("line", { x1: padL, x2: W - padR, y1: y, y2: y, stroke: "#444", "stroke-width": 0.5 }, chart);
      const t = svg("text", { class: "flux-numba-tick", "data-axis": "y", x: padL - 3, y: y + 3, "text-anchor": "end", "font-size": 9, fill: "#aaa" }, chart);
      t.textContent = fmt(maxMs * frac, tickNd);
    }
    series.forEach((s, j) => {
      const col = seriesColour(s);
      const fill = drawnAsIs(s) ? col : `url(#flux-numba-hatch-${node.id})`;
      const strip = showsGraphs(s);
      s.steps.forEach((p, k) => {
        const h = Math.max(1, (plotH * (p.ms || 0)) / maxMs);
        const x = padL + k * slot + slot * 0.075 + j * bw;
        const g = strip ? p.graphs : null;
        const r = svg("rect", {
          class: "flux-numba-bar", x, y: padT + plotH - h,
          width: Math.max(1, bw - 0.5), height: h, fill, opacity: p.profiled ? 0.45 : 1,
          "data-label": s.label, "data-step": p.step, "data-ms": p.ms, "data-graphs": g?.state ?? "",
          "data-profiled": p.profiled ? "1" : "0", "data-host-bound": p.host_bound ? "1" : "0",
        }, chart);
        const tip = svg("title", {}, r);
        tip.textContent = `${s.label} step ${p.step}: ${fmt(p.ms)} ms` +
          (p.profiled ? " (profiled: slower, left out of the mean)" : "") +
          (p.host_ms !== null && p.host_ms !== undefined ? `; host ${fmt(p.host_ms)} ms${p.host_bound ? " (host-bound)" : ""}` : "") +
          (g ? `; CUDA graphs replayed: ${g.state}${g.blocks ? ` (${g.blocks[0]} of ${g.blocks[1]} blocks)` : g.mode ? ` (${g.mode})` : ""}` +
            `${g.why ? " -- " + g.why : ""}` : "");
        // under a patched CUDA step's bar: did it replay graphs (green all / amber some / red none);
        // a red cap on a host-bound step (the GPU waited for the host)
        if (g) svg("rect", { class: "flux-numba-graph", x, y: padT + plotH + 1, width: Math.max(1, bw - 0.5), height: 3,
          fill: GRAPH_COLOURS[g.state] ?? "#666" }, chart);
        if (p.host_bound) svg("rect", { class: "flux-numba-hostbound", x, y: padT + plotH - h, width: Math.max(1, bw - 0.5),
          height: Math.min(2, h), fill: BAD }, chart);
        bars++;
      });
      const mean = s.summary?.steps ? s.summary.mean_ms : null;
      if (mean) {
        const y = padT + plotH * (1 - mean / maxMs);
        svg("line", { x1: padL, x2: W - padR, y1: y, y2: y, stroke: col, "stroke-dasharray": "4 3", "stroke-width": 1 }, chart);
      }
    });
    // step numbers: about eight ticks whatever the step count, on the fixed slots
    const every = Math.max(1, Math.ceil(nSlots / 8));
    for (let k = 0; k < nSlots; k += every) {
      const tx = svg("text", { class: "flux-numba-tick", x: padL + (k + 0.5) * slot, y: H - 13, "text-anchor": "middle", "font-size": 8, fill: "#aaa" }, chart);
      tx.textContent = String(k);
    }
    const xl = svg("text", { class: "flux-numba-caption", x: W - padR, y: H - 2, "text-anchor": "end", "font-size": 8, fill: "#aaa" }, chart);
    xl.textContent = axisCaption(series, nSlots);
  } else {
    // a failed run's error in its place, wrapped to the plot's width
    const failed = series.some((s) => s.error);
    const perLine = Math.max(20, Math.floor((W - 16) / 6.3));
    const lines = wrapWords(emptyPlotText(series), perLine).slice(0, Math.max(1, Math.floor((H - 10) / 14)));
    const t = svg("text", { class: "flux-numba-empty", x: W / 2, y: H / 2 - ((lines.length - 1) * 14) / 2,
      "text-anchor": "middle", "font-size": 11, fill: failed ? BAD : "#aaa" }, chart);
    lines.forEach((ln, i) => { svg("tspan", { x: W / 2, dy: i ? 14 : 0 }, t).textContent = ln; });
  }
  ui.root.dataset.nodeId = String(node.id);
  ui.root.dataset.bars = String(bars);
  ui.root.dataset.slots = String(nSlots);
  ui.root.dataset.runs = String(series.length);
  ui.root.dataset.labels = labels.join(",");

  ui.stats.replaceChildren();
  for (const s of series) {
    const row = document.createElement("div");
    row.className = "flux-numba-stats-row";
    row.dataset.label = s.label;
    row.dataset.model = s.model?.state ?? "";
    row.dataset.failed = s.error ? "1" : "0";
    row.dataset.run = String(s.run);
    row.dataset.status = runStatus(s);
    const head = document.createElement("div");
    const sw = document.createElement("span");
    sw.style.cssText = `display:inline-block;width:9px;height:9px;margin-right:4px;background:${seriesColour(s)}`;
    head.appendChild(sw);
    const name = document.createElement("b");
    name.textContent = `${s.label} (run ${s.run}, ${runStatus(s)}): `;
    head.appendChild(name);
    const words = document.createElement("span");
    words.className = "flux-numba-state";
    words.textContent = stateWords(s);
    if (!drawnAsIs(s)) words.style.color = BAD;
    head.appendChild(words);
    row.appendChild(head);
    const line = document.createElement("div");
    line.className = "flux-numba-line";
    line.style.cssText = "padding-left:13px";
    line.textContent = statsText(s);
    row.appendChild(line);
    for (const n of notes(s)) {
      const p = document.createElement("div");
      p.className = "flux-numba-note";
      p.style.cssText = `padding-left:13px;${n.bad ? "color:" + BAD : "opacity:.8"}`;
      p.textContent = n.text;
      row.appendChild(p);
    }
    ui.stats.appendChild(row);
  }
  node.setDirtyCanvas?.(true, true);
}

function exportJSON(node) {
  const data = { node: node.id, title: node.title, exported: new Date().toISOString(), ...state(node) };
  const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `flux_numba_timings_node${node.id}.json`;
  document.body.appendChild(a);
  a.click();
  setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
}

function clearSeries(node) {
  node.properties[PROP] = { series: {}, order: [] };
  redraw(node);
  markChanged();
}

function buildChart(node) {
  const root = document.createElement("div");
  root.className = "flux-numba-chart";
  root.dataset.fluxNumbaChart = "";
  root.dataset.nodeId = String(node.id);
  root.dataset.bars = "0";
  root.style.cssText = "display:flex;flex-direction:column;gap:3px;width:100%;height:100%;" +
    "font:11px sans-serif;color:#ddd;overflow:hidden;box-sizing:border-box";
  const chart = document.createElementNS(SVGNS, "svg");
  chart.setAttribute("viewBox", "0 0 400 150");
  // flex-basis 0: the plot takes the room the stats leave, its own content never sizes it
  chart.style.cssText = "display:block;width:100%;flex:1 1 0;min-height:110px";
  const stats = document.createElement("div");
  stats.className = "flux-numba-stats";
  stats.style.cssText = "flex:0 0 auto;max-height:50%;overflow:auto";
  const bar = document.createElement("div");
  bar.style.cssText = "display:flex;gap:4px";
  const mk = (label, fn, attr) => {
    const b = document.createElement("button");
    b.textContent = label;
    b.dataset[attr] = "";
    b.style.cssText = "font:11px sans-serif;padding:1px 6px;cursor:pointer";
    b.addEventListener("click", (e) => { e.stopPropagation(); fn(node); });
    bar.appendChild(b);
  };
  mk("export JSON", exportJSON, "fluxNumbaExport");
  mk("clear", clearSeries, "fluxNumbaClear");
  root.append(chart, stats, bar);
  const ui = { root, svg: chart, stats, size: null };
  // redraw in the new pixel size when the node is resized (text keeps its size, nothing stretches)
  if (typeof ResizeObserver === "function") {
    let queued = false;
    new ResizeObserver(() => {
      if (queued) return;
      queued = true;
      requestAnimationFrame(() => {
        queued = false;
        const [w, h] = chartSize(ui);
        if (!ui.size || Math.abs(ui.size[0] - w) >= 1 || Math.abs(ui.size[1] - h) >= 1) redraw(node);
      });
    }).observe(chart);
  }
  return ui;
}

const TEXT_FONT = "10px monospace";
const TEXT_LINE_PX = 13;

function textWidget(node) {
  if (node.__fluxNumbaText) return node.__fluxNumbaText;
  const pre = document.createElement("pre");
  pre.dataset.fluxNumbaText = "";
  pre.dataset.nodeId = String(node.id);
  pre.style.cssText = `margin:0;width:100%;height:100%;overflow:auto;font:${TEXT_FONT};line-height:${TEXT_LINE_PX}px;` +
    "color:#ddd;white-space:pre;background:#1e1e1e;box-sizing:border-box;padding:3px";
  const w = node.addDOMWidget("flux_numba_text", "flux_numba_text", pre, {
    hideOnZoom: false, getMinHeight: () => pre.__fitHeight ?? 60,
  });
  w.serialize = false;
  node.__fluxNumbaText = pre;
  return pre;
}

// the node grows to its text: the table (the lines before the first blank line) whole, the lines
// after it scroll where longer; never shrunk below what the user made it
function fitToText(node, pre, text) {
  const lines = String(text ?? "").split("\n");
  const blank = lines.indexOf("");
  const table = blank > 0 ? lines.slice(0, blank) : lines;
  const ctx = (fitToText.ctx ??= document.createElement("canvas").getContext("2d"));
  ctx.font = TEXT_FONT;
  const widest = (ls) => Math.max(0, ...ls.map((l) => ctx.measureText(l).width));
  const textW = widest(table);
  pre.__fitHeight = Math.min(520, lines.length * TEXT_LINE_PX + 22);
  pre.dataset.tableWidth = String(Math.ceil(widest(table)));
  const min = node.computeSize?.() ?? node.size;
  const want = [Math.ceil(textW) + 6 + 40, min[1]];
  if (want[0] > node.size[0] || want[1] > node.size[1]) {
    node.setSize([Math.max(node.size[0], want[0]), Math.max(node.size[1], want[1])]);
    node.setDirtyCanvas?.(true, true);
  }
}

app.registerExtension({
  name: "FluxNumba.StepTimer",
  setup() {
    api.addEventListener("flux_numba.step", onStep);
    api.addEventListener("flux_numba.run", onRun);
    window.fluxNumba = {
      bars: (id) => Number(document.querySelector(`[data-flux-numba-chart][data-node-id="${id}"]`)?.dataset.bars ?? 0),
      series: (id) => findNode(id)?.properties?.[PROP] ?? null,
    };
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name === TIMER) {
      const created = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const r = created?.apply(this, arguments);
        const ui = buildChart(this);
        const w = this.addDOMWidget("flux_numba_chart", "flux_numba_chart", ui.root, {
          hideOnZoom: false, getMinHeight: () => 190,
        });
        w.serialize = false;
        this.__fluxNumba = ui;
        state(this);
        this.setSize?.([Math.max(this.size[0], 380), Math.max(this.size[1], 330)]);
        redraw(this);
        return r;
      };
      const configure = nodeType.prototype.onConfigure;
      nodeType.prototype.onConfigure = function () {
        const r = configure?.apply(this, arguments);
        if (this.__fluxNumba) this.__fluxNumba.root.dataset.nodeId = String(this.id);
        redraw(this); // series restored from node.properties (saved workflow / page reload)
        return r;
      };
      const added = nodeType.prototype.onAdded;
      nodeType.prototype.onAdded = function () {
        const r = added?.apply(this, arguments);
        redraw(this); // the node id is known only once it is in the graph
        return r;
      };
      const menu = nodeType.prototype.getExtraMenuOptions;
      nodeType.prototype.getExtraMenuOptions = function (_, options) {
        const r = menu?.apply(this, arguments);
        options.push(null,
          { content: "FluxNumba: export timings JSON", callback: () => exportJSON(this) },
          { content: "FluxNumba: clear chart", callback: () => clearSeries(this) });
        return r;
      };
    } else if (TEXT_NODES.includes(nodeData.name)) {
      const created = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const r = created?.apply(this, arguments);
        textWidget(this);
        // a new report node is wide enough for its table (a loaded workflow keeps its saved size)
        if (nodeData.name === "FluxNumbaTimingReport") this.setSize?.([Math.max(this.size[0], 780), Math.max(this.size[1], 440)]);
        return r;
      };
      const executed = nodeType.prototype.onExecuted;
      nodeType.prototype.onExecuted = function (message) {
        const r = executed?.apply(this, arguments);
        const text = (message?.text ?? []).join("\n");
        this.properties = this.properties || {};
        this.properties[TEXT_PROP] = text;
        const pre = textWidget(this);
        pre.textContent = text;
        if (nodeData.name === "FluxNumbaTimingReport") fitToText(this, pre, text);
        markChanged();
        return r;
      };
      const configure = nodeType.prototype.onConfigure;
      nodeType.prototype.onConfigure = function () {
        const r = configure?.apply(this, arguments);
        if (this.properties?.[TEXT_PROP]) textWidget(this).textContent = this.properties[TEXT_PROP];
        if (this.__fluxNumbaText) this.__fluxNumbaText.dataset.nodeId = String(this.id);
        return r;
      };
    }
  },
});
