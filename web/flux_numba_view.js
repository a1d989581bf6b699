// What the step-timer chart says about a series, in words: pure functions of the series the server's
// "flux_numba.run" / "flux_numba.step" messages built (flux_numba.js keeps them in node.properties).
// No ComfyUI imports, no DOM: tests/test_web_view.py runs them under node.
//
// A series: { label, run, total_steps, device, patch, steps: [{step, ms, profiled, graphs, host_ms,
// host_bound}], summary: {steps, recorded_steps, mean_ms, min_ms, max_ms, total_ms, its}, profile,
// done, model: {state, why}, error }.

// same rule as nodes/timing_report.py label_colour()
const FIXED = { stock: "#8a8f98", torch: "#8a8f98", patched: "#e8743b", numba: "#e8743b" };
const PALETTE = ["#4c8bf5", "#19a979", "#ed4a7b", "#945ecf", "#13a4b4", "#f4c20d", "#6f7dd6", "#bf399e"];
export const HATCH_GREY = "#b0b0b0";
export const BAD = "#ed4a7b";
export const GRAPH_COLOURS = { all: "#19a979", some: "#f4c20d", none: "#ed4a7b" };

export function labelColour(label) {
  const key = String(label ?? "").trim().toLowerCase();
  if (key in FIXED) return FIXED[key];
  let s = 0;
  for (const ch of key) s += ch.codePointAt(0);
  return PALETTE[s % PALETTE.length];
}

export const fmt = (v, nd = 2) => (v === null || v === undefined || !isFinite(v) ? "-" : Number(v).toFixed(nd));

// nodes/runs.py model_state: "stock" (no FluxNumbaPatch before the timer), "patched", "partly patched",
// "not patched"; a series from before the server said so counts as stock
export const modelState = (s) => s?.model?.state ?? "stock";

// a series the pack did not (fully) run is drawn grey and hatched whatever its label says
export const drawnAsIs = (s) => ["patched", "stock"].includes(modelState(s));
export const seriesColour = (s) => (drawnAsIs(s) ? labelColour(s.label) : HATCH_GREY);

export const onCuda = (s) => String(s?.device ?? "").toLowerCase().startsWith("cuda");

// CUDA-graph replays are a fact only of patched steps on CUDA: nothing is drawn or said otherwise
// (a stock chart, a run on the CPU, a model the patch passed through)
export const showsGraphs = (s) =>
  onCuda(s) && ["patched", "partly patched"].includes(modelState(s)) && (s.steps ?? []).some((p) => p.graphs);

// the chart's step slots: the run's step count from its first message on (the server sends
// total_steps), so bars never reflow; more calls than steps (a 2nd-order sampler) widen it
export function slotCount(series) {
  let n = 0;
  for (const s of series) n = Math.max(n, Number(s.total_steps) || 0, (s.steps ?? []).length);
  return n;
}

// the words at the head of a series' row, read at a glance
export function stateWords(s) {
  const st = modelState(s);
  const head = st === "stock" ? "stock (no FluxNumbaPatch)" : st.toUpperCase();
  const why = st !== "stock" && st !== "patched" && s.model?.why ? `: ${s.model.why}` : "";
  return head + why;
}

export function runStatus(s) {
  if (s.error) return "FAILED";
  return s.done ? "done" : "running";
}

const profiledSteps = (s) => (s.steps ?? []).filter((p) => p.profiled);

// "3/3 steps, mean 12.30 ms (min 11.00 / max 13.10), total 36.9 ms, 81.301 it/s; step 1 profiled
// (dimmed, left out of mean / it/s)"; a run without a finished step says so instead of "mean - ms"
export function statsText(s) {
  const m = s.summary || {};
  const recorded = m.recorded_steps ?? (s.steps ?? []).length;
  const of = `${recorded}${s.total_steps ? "/" + s.total_steps : ""} steps`;
  if (!recorded || !m.steps) {
    if (s.error) return `no step finished (${of})`;
    return s.done ? `no step recorded (${of})` : `waiting for the first step (${of})`;
  }
  let t = `${of}, mean ${fmt(m.mean_ms)} ms (min ${fmt(m.min_ms)} / max ${fmt(m.max_ms)}), ` +
    `total ${fmt(m.total_ms, 1)} ms, ${fmt(m.its, 3)} it/s`;
  const prof = profiledSteps(s);
  if (prof.length && m.steps < recorded) {
    t += `; step ${prof.map((p) => p.step).join(", ")} profiled (dimmed, left out of mean / it/s: ` +
      `mean of ${m.steps})`;
  }
  return t;
}

// "CUDA graphs replayed: every block in 2 of 3 steps, some blocks in 1"
export function graphsText(s) {
  if (!showsGraphs(s)) return null;
  const steps = s.steps ?? [];
  const c = { all: 0, some: 0, none: 0 };
  for (const p of steps) if (p.graphs && p.graphs.state in c) c[p.graphs.state]++;
  const parts = [`every block in ${c.all} of ${steps.length} steps`];
  if (c.some) parts.push(`some blocks in ${c.some}`);
  if (c.none) parts.push(`none in ${c.none}`);
  return "CUDA graphs replayed: " + parts.join(", ");
}

// the lines under a series' row: { text, bad } (bad: drawn red)
export function notes(s) {
  const out = [];
  if (s.error) out.push({ text: `FAILED: ${s.error}`, bad: true });
  const g = graphsText(s);
  if (g) out.push({ text: g, bad: false });
  const timed = (s.steps ?? []).filter((p) => p.host_ms !== null && p.host_ms !== undefined);
  if (onCuda(s) && timed.length) {
    const hb = timed.filter((p) => p.host_bound).length;
    out.push({ text: `host-bound (the GPU waited for the host) in ${hb} of ${timed.length} steps`, bad: false });
  }
  const prof = s.profile;
  if (prof && prof.ms) {
    let t = `profiled step ${prof.step ?? ""} split: ` +
      Object.entries(prof.ms).map(([k, v]) => `${k} ${fmt(v)} ms`).join(", ");
    if (prof.gpu_busy_pct !== null && prof.gpu_busy_pct !== undefined) t += `; GPU busy ${fmt(prof.gpu_busy_pct, 0)}%`;
    out.push({ text: t, bad: false });
  }
  return out;
}

// what the plot area shows when no series has a bar: a failed run's error, never a stale placeholder
export function emptyPlotText(series) {
  const failed = series.filter((s) => s.error);
  if (failed.length) return failed.map((s) => `${s.label} FAILED: ${s.error}`).join("; ");
  if (series.some((s) => !s.done)) return "sampling: waiting for the first step";
  return "step times appear here while sampling";
}

// the x-axis caption: the graph strip is named only where one is drawn
export function axisCaption(series, nSlots) {
  const t = `step (${nSlots} steps), ms per step`;
  return series.some(showsGraphs) ? t + "; strip: CUDA graphs replayed for all / some / no blocks" : t;
}
