"""FluxNumbaTimingReport: the step-timer chart as an IMAGE plus a text table, after sampling.

It takes the sampler's LATENT as a passthrough input only so that ComfyUI runs it after the sampler
(and passes the latent on unchanged); the numbers come from ``timer``'s run store.  The chart is drawn
with matplotlib's Agg canvas directly (``Figure`` + ``FigureCanvasAgg``; pyplot and the global
backend are never touched, so no display is needed).
"""
from __future__ import annotations

from typing import Dict, List

from . import timer

# label -> colour; the web extension (web/flux_numba.js) uses the same rule
FIXED_COLOURS = {"stock": "#8a8f98", "torch": "#8a8f98", "patched": "#e8743b", "numba": "#e8743b"}
PALETTE = ["#4c8bf5", "#19a979", "#ed4a7b", "#945ecf", "#13a4b4", "#f4c20d", "#6f7dd6", "#bf399e"]
CAT_COLOURS = {"attention": "#4c8bf5", "gemm": "#19a979", "fused": "#e8743b", "other": "#8a8f98"}


def label_colour(label: str) -> str:
    key = (label or "").strip().lower()
    if key in FIXED_COLOURS:
        return FIXED_COLOURS[key]
    # simple string hash shared with the JS side: sum of char codes
    return PALETTE[sum(ord(c) for c in key) % len(PALETTE)]


def _fmt(v, nd=2):
    return "-" if v is None else f"{v:.{nd}f}"


def backends_text(backends: Dict[str, Dict[str, int]]) -> str:
    if not backends:
        return "none (stock model: no registry ops)"
    parts = []
    for op in sorted(backends):
        per = backends[op]
        parts.append(op + ":" + "/".join(f"{b}x{n}" for b, n in sorted(per.items(), key=lambda kv: -kv[1])))
    return ", ".join(parts)


def table_text(runs: List[dict]) -> str:
    """A plain-text table: one row per run, then backends, patch and profile lines."""
    if not runs:
        return "FluxNumba timing: no timer runs recorded yet (is a FluxNumbaStepTimer before the sampler?)"
    hdr = f"{'run':>4} {'label':<12} {'steps':>5} {'mean ms':>9} {'min ms':>9} {'max ms':>9} {'total ms':>10} {'it/s':>7}"
    lines = [hdr, "-" * len(hdr)]
    for r in runs:
        s = r["summary"]
        lines.append(f"{r['run']:>4} {str(r['label'])[:12]:<12} {s['steps']:>5} {_fmt(s['mean_ms']):>9} "
                     f"{_fmt(s['min_ms']):>9} {_fmt(s['max_ms']):>9} {_fmt(s['total_ms'], 1):>10} "
                     f"{_fmt(s['its'], 3):>7}")
    lines.append("")
    for r in runs:
        lines.append(f"run {r['run']} [{r['label']}] device {r.get('device')}; backends: {backends_text(r.get('backends'))}")
        if r.get("patch") is not None:
            lines.append(f"run {r['run']} [{r['label']}] patch: {r['patch']}")
        prof = r.get("profile")
        if prof and "ms" in prof:
            split = ", ".join(f"{k} {v:.2f} ms" for k, v in prof["ms"].items())
            if prof.get("numba_ms"):
                split += f" (all Numba kernels: {prof['numba_ms']:.2f} ms)"
            lines.append(f"run {r['run']} [{r['label']}] profiled step {prof.get('step')} ({prof.get('source')}): {split}")
        if any(st.get("profiled") for st in r.get("steps", [])) and r["summary"]["steps"] < len(r["steps"]):
            lines.append(f"run {r['run']} [{r['label']}] (the profiled step is left out of mean/it/s)")
    base = next((r for r in runs if str(r["label"]).lower() == "stock" and r["summary"]["mean_ms"]), None)
    if base is not None:
        for r in runs:
            if r is not base and r["summary"]["mean_ms"]:
                lines.append(f"speed-up {r['label']} vs stock: {base['summary']['mean_ms'] / r['summary']['mean_ms']:.3f}x "
                             f"(mean step time)")
    return "\n".join(lines)


def chart_array(runs: List[dict], width: int = 1024, height: int = 512):
    """RGB float32 array [H, W, 3] in 0..1 with one bar per step per run (colour by label)."""
    import numpy as np
    from matplotlib.colors import to_rgba
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    dpi = 100
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    has_prof = any(r.get("profile") and "ms" in r["profile"] for r in runs)
    if has_prof:
        gs = fig.add_gridspec(1, 2, width_ratios=[3, 1])
        ax = fig.add_subplot(gs[0, 0])
        axp = fig.add_subplot(gs[0, 1])
    else:
        ax = fig.add_subplot(1, 1, 1)
        axp = None
    if not runs:
        ax.text(0.5, 0.5, "no FluxNumba timer runs yet", ha="center", va="center", fontsize=16)
        ax.set_axis_off()
    else:
        n = len(runs)
        w = 0.8 / n
        for i, r in enumerate(runs):
            ms = [st["ms"] for st in r["steps"]]
            xs = [k + (i - (n - 1) / 2) * w for k in range(len(ms))]
            s = r["summary"]
            lab = (f"{r['label']} (run {r['run']}): mean {_fmt(s['mean_ms'])} ms, "
                   f"{_fmt(s['its'], 3)} it/s, total {_fmt(s['total_ms'], 1)} ms")
            col = label_colour(r["label"])
            # the profiled step (slow, left out of the mean) is drawn faded
            cols = [to_rgba(col, 0.35 if st.get("profiled") else 1.0) for st in r["steps"]]
            ax.bar(xs, ms, width=w, color=cols, label=lab, edgecolor="none")
            if s["mean_ms"]:
                ax.axhline(s["mean_ms"], color=label_colour(r["label"]), linestyle="--", linewidth=1)
        from matplotlib.ticker import MaxNLocator
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers (no 0.5 ticks)
        ax.set_xlabel("sampling step (diffusion-model call)")
        ax.set_ylabel("ms")
        ax.set_title("FluxNumba step times")
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    if axp is not None:
        prof_runs = [r for r in runs if r.get("profile") and "ms" in r["profile"]]
        for j, r in enumerate(prof_runs):
            bottom = 0.0
            for cat in timer.CATEGORIES:
                v = float(r["profile"]["ms"].get(cat, 0.0))
                axp.bar([j], [v], bottom=bottom, color=CAT_COLOURS[cat], label=cat if j == 0 else None)
                bottom += v
        axp.set_xticks(range(len(prof_runs)))
        axp.set_xticklabels([str(r["label"])[:10] for r in prof_runs], fontsize=8)
        axp.set_title("profiled step split (ms)", fontsize=9)
        axp.legend(fontsize=7)
    fig.tight_layout()
    fig.canvas.draw()
    buf = np.asarray(fig.canvas.buffer_rgba())
    return buf[..., :3].astype(np.float32) / 255.0


NODE_ID = "FluxNumbaTimingReport"


def _int_input(name, value, lo, hi):
    """A whole-number widget value in [lo, hi]; ValueError naming the node and the input otherwise."""
    try:
        v = int(value)
        ok = v == value if isinstance(value, float) else not isinstance(value, bool)
    except (TypeError, ValueError):
        ok = False
    if not ok or not lo <= v <= hi:
        raise ValueError(f"{NODE_ID}: {name} must be a whole number of pixels in {lo}..{hi}, got {value!r}")
    return v


class FluxNumbaTimingReport:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "samples": ("LATENT", {"tooltip": "The sampler's output. Only orders this node after sampling; "
                                                  "passed through unchanged."}),
                "selection": ("STRING", {"default": "last", "multiline": False,
                                         "tooltip": "Which runs: 'last' = newest run of every label; a label "
                                                    "(e.g. 'patched'); several comma-separated ('stock,patched'); "
                                                    "'all'; 'run:<id>'; 'node:<timer node id>'."}),
            },
            "optional": {
                "samples_2": ("LATENT", {"tooltip": "Optional: a second sampler's output (e.g. the stock branch), "
                                                    "only so this node runs after BOTH samplers. Not passed on."}),
                "width": ("INT", {"default": 1024, "min": 256, "max": 4096, "step": 8,
                                  "tooltip": "Chart image width in pixels."}),
                "height": ("INT", {"default": 512, "min": 128, "max": 4096, "step": 8,
                                   "tooltip": "Chart image height in pixels."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    RETURN_TYPES = ("IMAGE", "STRING", "LATENT")
    RETURN_NAMES = ("chart", "table", "samples")
    OUTPUT_TOOLTIPS = ("Bar chart of the step times (one bar per step, colour per label).",
                       "Text table: mean/min/max/total ms, it/s, backends per run.",
                       "The input latent, unchanged.")
    FUNCTION = "report"
    CATEGORY = "FluxNumba"
    OUTPUT_NODE = True
    DESCRIPTION = "Chart + table of FluxNumbaStepTimer runs; connect after the sampler(s)."

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # reads the timer's run store: always re-run

    def report(self, samples, selection="last", samples_2=None, width=1024, height=512, unique_id=None):
        import torch
        width = _int_input("width", width, 256, 4096)
        height = _int_input("height", height, 128, 4096)
        try:
            runs = timer.select_runs(selection)
        except timer.SelectionError as e:
            raise ValueError(f"{NODE_ID}: selection {e} (use {timer.SELECTION_HELP})") from None
        text = table_text(runs)
        img = torch.from_numpy(chart_array(runs, width, height)).unsqueeze(0)
        return {"ui": {"text": [text]}, "result": (img, text, samples)}


NODE_CLASS_MAPPINGS = {"FluxNumbaTimingReport": FluxNumbaTimingReport}
NODE_DISPLAY_NAME_MAPPINGS = {"FluxNumbaTimingReport": "FluxNumba Timing Report"}
