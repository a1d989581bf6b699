"""The timing report's text table and chart (FluxNumbaTimingReport), from ``timing``'s run store.

The chart is drawn with matplotlib's Agg canvas directly (``Figure`` + ``FigureCanvasAgg``; pyplot
and the global backend are never touched, so no display is needed).
"""
from __future__ import annotations

from typing import Dict, List

from . import timing

# label -> colour; the web extension (web/flux_numba.js) uses the same rule
FIXED_COLOURS = {"stock": "#8a8f98", "torch": "#8a8f98", "patched": "#e8743b", "numba": "#e8743b"}
PALETTE = ["#4c8bf5", "#19a979", "#ed4a7b", "#945ecf", "#13a4b4", "#f4c20d", "#6f7dd6", "#bf399e"]
# the profiled step's categories; "other" is not the stock series' grey (#8a8f98): a split bar must not
# read as a stock run
CAT_COLOURS = {"attention": "#4c8bf5", "gemm": "#19a979", "fused": "#e8743b", "other": "#a173d1"}


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


def _model_state(r):
    return r.get("model") or timing.model_state(r.get("patch"), r.get("backends"))


def shows_graphs(r) -> bool:
    """CUDA-graph replays are a fact only of a patched run on CUDA (web/flux_numba.js showsGraphs)."""
    return (str(r.get("device") or "").lower().startswith("cuda")
            and _model_state(r)["state"] in ("patched", "partly patched"))


def graphs_text(r) -> str:
    """'all 2/3, some 1': steps that replayed CUDA graphs for every / some / no block; '-' where the
    pack ran no patched step on CUDA."""
    g = r.get("graphs") or {}
    n = len(r.get("steps") or [])
    if not n or not shows_graphs(r) or not any(g.get(k) for k in ("all", "some", "none")):
        return "-"
    return f"all {g.get('all', 0)}/{n}" + (f", some {g['some']}" if g.get("some") else "") + \
        (f", none {g['none']}" if g.get("none") else "")


def state_words(r) -> str:
    """The run's truth in words: PATCHED / PARTLY PATCHED: why / NOT PATCHED: why / stock (+ FAILED)."""
    ms = _model_state(r)
    st = ms["state"]
    words = "stock (no FluxNumbaPatch)" if st == "stock" else st.upper()
    if st not in ("stock", "patched") and ms.get("why"):
        words += f" ({ms['why']})"
    if r.get("error"):
        words += f"; FAILED after {len(r.get('steps') or [])} steps: {r['error']}"
    return words


def table_text(runs: List[dict]) -> str:
    """A plain-text table: one row per run, then backends, patch, graph and profile lines.  A speed-up
    against the 'stock' run is printed only for runs the pack actually ran ("patched")."""
    if not runs:
        return "FluxNumba timing: no timer runs recorded yet (is a FluxNumbaStepTimer before the sampler?)"
    hdr = (f"{'run':>4} {'label':<12} {'steps':>5} {'mean ms':>9} {'min ms':>9} {'max ms':>9} {'total ms':>10} "
           f"{'it/s':>7} {'model':<15} {'graphs':<14} {'host-bound':>10}")
    lines = [hdr, "-" * len(hdr)]
    for r in runs:
        s = r["summary"]
        hb = (r.get("graphs") or {}).get("host_bound", 0)
        lines.append(f"{r['run']:>4} {str(r['label'])[:12]:<12} {s['steps']:>5} {_fmt(s['mean_ms']):>9} "
                     f"{_fmt(s['min_ms']):>9} {_fmt(s['max_ms']):>9} {_fmt(s['total_ms'] if s['steps'] else None, 1):>10} "
                     f"{_fmt(s['its'], 3):>7} {_model_state(r)['state']:<15} {graphs_text(r):<14} {hb:>10}")
    lines.append("")
    for r in runs:
        tag = f"run {r['run']} [{r['label']}]"
        if r.get("error"):
            lines.append(f"{tag} FAILED after {len(r.get('steps') or [])} steps: {r['error']}")
        ms = _model_state(r)
        if ms["state"] != "patched" and ms.get("why"):
            lines.append(f"{tag} {ms['state']}: {ms['why']}")
        lines.append(f"{tag} device {r.get('device')}; backends: {backends_text(r.get('backends'))}")
        if r.get("patch") is not None:
            lines.append(f"{tag} patch: {r['patch']}")
        whys = {}
        for st in r.get("steps") or []:
            g = st.get("graphs") or {}
            if g.get("why") and g.get("state") != "all":
                whys[g["why"]] = whys.get(g["why"], 0) + 1
        for why, n in sorted(whys.items(), key=lambda kv: -kv[1])[:3]:
            lines.append(f"{tag} {n} steps not (fully) replayed as CUDA graphs: {why}")
        prof = r.get("profile")
        if prof and "ms" in prof:
            split = ", ".join(f"{k} {v:.2f} ms" for k, v in prof["ms"].items())
            if prof.get("numba_ms"):
                split += f" (all Numba kernels: {prof['numba_ms']:.2f} ms)"
            if prof.get("gpu_busy_pct") is not None:
                split += f"; GPU busy {prof['gpu_busy_pct']:.0f}% of the step's wall time"
            lines.append(f"{tag} profiled step {prof.get('step')} ({prof.get('source')}): {split}")
        if any(st.get("profiled") for st in r.get("steps", [])) and r["summary"]["steps"] < len(r["steps"]):
            lines.append(f"{tag} (the profiled step is left out of mean/it/s)")
    base = next((r for r in runs if str(r["label"]).lower() == "stock" and r["summary"]["mean_ms"]
                 and not r.get("error")), None)
    if base is not None:
        for r in runs:
            if r is base or not r["summary"]["mean_ms"]:
                continue
            st = _model_state(r)["state"]
            if st == "patched" and not r.get("error"):
                lines.append(f"speed-up {r['label']} vs stock: {base['summary']['mean_ms'] / r['summary']['mean_ms']:.3f}x "
                             f"(mean step time)")
            else:
                lines.append(f"no speed-up for {r['label']} (run {r['run']}): "
                             f"{'it failed' if r.get('error') else 'it was ' + st}")
    return "\n".join(lines)


def chart_figure(runs: List[dict], width: int = 1024, height: int = 512):
    """The report chart as a matplotlib Figure (Agg canvas attached, drawn): one bar per step per run
    (colour by label, hatched grey where the pack did not run), each run's state in words in the
    legend below the plot; with a profiled step, its split beside it (legend above its bars)."""
    import textwrap
    from matplotlib.colors import to_rgba
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.ticker import MaxNLocator

    dpi = 100
    # constrained layout keeps the legends, titles and tick labels off each other and on the image
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    prof_runs = [r for r in runs if r.get("profile") and "ms" in r["profile"]]
    if prof_runs:
        gs = fig.add_gridspec(1, 2, width_ratios=[3, 1])
        ax = fig.add_subplot(gs[0, 0])
        axp = fig.add_subplot(gs[0, 1])
    else:
        ax = fig.add_subplot(1, 1, 1)
        axp = None
    wrap = max(40, int(width / 6.2))
    if not runs:
        ax.text(0.5, 0.5, "no FluxNumba timer runs yet", ha="center", va="center", fontsize=16)
        ax.set_axis_off()
    else:
        n = len(runs)
        w = 0.8 / n
        slots = max([int(r.get("total_steps") or 0) for r in runs] + [len(r["steps"]) for r in runs] + [1])
        for i, r in enumerate(runs):
            ms = [st["ms"] for st in r["steps"]]
            xs = [k + (i - (n - 1) / 2) * w for k in range(len(ms))]
            s = r["summary"]
            state = _model_state(r)["state"]
            if s["steps"]:
                lab = (f"{r['label']} (run {r['run']}): mean {_fmt(s['mean_ms'])} ms, "
                       f"{_fmt(s['its'], 3)} it/s, total {_fmt(s['total_ms'], 1)} ms")
                if s["steps"] < len(r["steps"]):
                    lab += f" ({len(r['steps']) - s['steps']} profiled step, faded, left out)"
            else:
                lab = f"{r['label']} (run {r['run']}): no step finished"
            lab += " -- " + state_words(r)
            if shows_graphs(r) and graphs_text(r) != "-":
                lab += f" -- CUDA graphs replayed: {graphs_text(r)} steps"
            prof = r.get("profile") or {}
            if prof.get("gpu_busy_pct") is not None:
                lab += f" -- GPU busy {prof['gpu_busy_pct']:.0f}% (profiled step)"
            lab = "\n".join(textwrap.wrap(lab, wrap, subsequent_indent="    ")) or lab
            # a run the pack did not (fully) run is drawn grey and hatched whatever its label says
            col = label_colour(r["label"]) if state in ("patched", "stock") else "#b0b0b0"
            hatch = None if state in ("patched", "stock") else "//"
            # the profiled step (slow, left out of the mean) is drawn faded
            cols = [to_rgba(col, 0.35 if st.get("profiled") else 1.0) for st in r["steps"]]
            if ms:
                ax.bar(xs, ms, width=w, color=cols, label=lab, edgecolor="#606060" if hatch else "none",
                       hatch=hatch, linewidth=0.5 if hatch else 0)
            else:  # a legend entry all the same (the run failed before its first step)
                ax.bar([0], [0], width=0, color=col, label=lab, hatch=hatch)
            if s["mean_ms"]:
                ax.axhline(s["mean_ms"], color=col, linestyle="--", linewidth=1)
        failed = [r for r in runs if r.get("error") and not r["steps"]]
        if failed and not any(r["steps"] for r in runs):
            ax.text(0.5, 0.5, "\n".join(textwrap.wrap("; ".join(f"{r['label']} FAILED: {r['error']}" for r in failed),
                                                     wrap)), transform=ax.transAxes, ha="center", va="center",
                    fontsize=10, color="#c0392b")
        ax.set_xlim(-0.6, slots - 0.4)  # fixed step slots: the run's step count
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers (no 0.5 ticks)
        ax.set_xlabel("sampling step (diffusion-model call)")
        ax.set_ylabel("ms")
        ax.set_title("FluxNumba step times")
        # the legend goes below the plots (the whole image's width): inside it would cover the bars
        try:
            fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", fontsize=8, ncol=1,
                       frameon=False)
        except (ValueError, TypeError):  # matplotlib < 3.7: no "outside" placement
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8, ncol=1, frameon=False)
        ax.grid(axis="y", alpha=0.3)
    if axp is not None:
        for j, r in enumerate(prof_runs):
            bottom = 0.0
            for cat in timing.CATEGORIES:
                v = float(r["profile"]["ms"].get(cat, 0.0))
                axp.bar([j], [v], bottom=bottom, color=CAT_COLOURS[cat], label=cat if j == 0 else None)
                bottom += v
        axp.set_xticks(range(len(prof_runs)))
        names = []
        for r in prof_runs:
            busy = r["profile"].get("gpu_busy_pct")
            names.append(str(r["label"])[:10] + (f"\nGPU busy {busy:.0f}%" if busy is not None else ""))
        axp.set_xticklabels(names, fontsize=8)
        axp.set_xlim(-0.6, len(prof_runs) - 0.4)
        # the legend sits between the title and the bars, never over them; it is wider than this
        # panel, so it reaches over the y tick labels' column: its gap above the plot (borderaxespad,
        # in legend font sizes) clears the upper half of a tick label sitting on the plot's top edge
        # (a tick at the autoscaled y limit, which happens for some profiled totals)
        axp.set_title("profiled step split (ms)" if width >= 900 else "profiled step\nsplit (ms)", fontsize=9, pad=38)
        axp.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=7, frameon=False,
                   borderaxespad=1.3, handlelength=1.2, columnspacing=0.8)
    fig.canvas.draw()
    return fig


# below this size the legends, titles and tick labels do not fit beside the plots (constrained layout
# gives up and they land on the bars): smaller images are drawn at least this large, then scaled down
MIN_DRAW = (512, 256)


def draw_size(width: int, height: int):
    """The size ``chart_array`` draws at for an image of width x height: the same aspect ratio, at
    least MIN_DRAW in both directions."""
    s = max(1.0, MIN_DRAW[0] / width, MIN_DRAW[1] / height)
    return int(round(width * s)), int(round(height * s))


def chart_array(runs: List[dict], width: int = 1024, height: int = 512):
    """RGB float32 array [H, W, 3] in 0..1 of ``chart_figure`` (drawn at ``draw_size``, scaled to
    width x height)."""
    import numpy as np
    dw, dh = draw_size(width, height)
    fig = chart_figure(runs, dw, dh)
    buf = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    if buf.shape[:2] != (height, width):
        from PIL import Image
        buf = np.asarray(Image.fromarray(np.ascontiguousarray(buf)).resize((width, height), Image.LANCZOS))
    return buf.astype(np.float32) / 255.0
