"""bench.py's diagnostics of one forward: allocations live at its peak (--memory), host time by function
(--host-profile), GPU kernel time by category and the idle gaps on the timeline (--profile), and the
SM clock / power nvidia-smi samples while the timed steps run (ClockLog)."""
import json
import os
import time


def memory_at_peak(fn, label, top=14):
    """Replay torch's allocator trace of one forward: the step's peak above what was allocated
    before it, and the allocations live at that peak (size, where they were made)."""
    import torch
    fn()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=200000)
    try:
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    del out
    live, cur, peak, at_peak = {}, 0, 0, {}
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]

    def where(ev):
        fr = [f for f in ev.get("frames", []) if f["filename"].endswith(".py") and "torch/" not in f["filename"]]
        return " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in fr[:3])
    rows = sorted(at_peak.values(), key=lambda e: -e["size"])[:top]
    print(f"\nmemory {label}: base {base / 1e9:.3f} GB, step peak +{peak / 1e9:.3f} GB, "
          f"{len(at_peak)} allocations live at the peak")
    for e in rows:
        print(f"  {e['size'] / 1e6:9.1f} MB  {where(e)[:150]}")
    return {"base_gb": base / 1e9, "peak_above_base_gb": peak / 1e9,
            "top": [(e["size"], where(e)[:200]) for e in rows]}

def host_profile(fn, label, dev, top=30):
    """One forward under cProfile after a warm-up: the top functions by own time (printed, returned)."""
    import cProfile
    import io
    import pstats
    import torch
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    fn()
    pr.disable()
    wall = (time.perf_counter() - t0) * 1e3
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    text = f"host profile {label}: {wall:.1f} ms under cProfile\n" + buf.getvalue()
    print(text)
    return text


class ClockLog:
    """SM clock / power / throttle reasons sampled by nvidia-smi every 100 ms while the body runs
    (the H200 runs FLUX at its power cap: clocks drop from 1980 MHz when GEMMs draw ~700 W)."""

    def __init__(self, dev):
        import shutil
        self.exe = shutil.which("nvidia-smi") if dev.type == "cuda" else None
        self.idx = dev.index if dev.index is not None else 0
        self.proc = None

    def __enter__(self):
        import subprocess
        import tempfile
        if self.exe:
            self.f = tempfile.TemporaryFile("w+")
            self.proc = subprocess.Popen([self.exe, "-i", str(self.idx), "-lms", "100", "--format=csv,noheader,nounits",
                                          "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active"],
                                         stdout=self.f, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if self.proc:
            self.proc.terminate()
            self.proc.wait()

    def summary(self):
        if not self.proc:
            return None
        import statistics
        self.f.seek(0)
        rows = []
        for ln in self.f.read().splitlines():
            try:
                c, p, r = [x.strip() for x in ln.split(",")]
                rows.append((float(c), float(p), int(r, 16)))
            except ValueError:
                continue
        if not rows:
            return None
        return {"samples": len(rows), "sm_mhz_median": statistics.median(r[0] for r in rows),
                "sm_mhz_min": min(r[0] for r in rows), "power_w_median": statistics.median(r[1] for r in rows),
                "power_capped_share": round(sum(1 for r in rows if r[2] & 0x4) / len(rows), 2)}


def category(name):
    """The kernel's category in the profile tables (``flux_core.harness.kernel_category``; the pack's
    kernels are listed as "numba")."""
    from flux_numba_pack.flux_core.harness import kernel_category
    c = kernel_category(name)
    return "numba" if c == "fused" else c


def profile_forward(fn, label, top=22):
    """GPU time per kernel for one forward (torch.profiler), grouped; printed and returned."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(); torch.cuda.synchronize()
    gaps = None
    try:
        gaps = kernel_gaps(prof)
    except Exception as e:  # the timeline is a diagnosis: never fail the benchmark on it
        print(f"gap analysis failed: {type(e).__name__}: {e}")
    rows = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        r = rows.setdefault(e.name, [0.0, 0])
        r[0] += e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
        r[1] += 1
    cats = {}
    for n, (ms, c) in rows.items():
        cats[category(n)] = cats.get(category(n), 0.0) + ms
    total = sum(cats.values())
    print(f"\nprofile {label}: GPU kernel time {total:.2f} ms = " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cats.items(), key=lambda kv: -kv[1])))
    for n, (ms, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {ms:8.3f} ms {c:5d}x  [{category(n)}] {n[:110]}")
    return {"total_ms": total, "categories": cats, "gaps": gaps,
            "top": [(n[:160], ms, c) for n, (ms, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]]}


def kernel_gaps(prof, top=12):
    """Where the GPU idles during one profiled forward: span from the first kernel's start to the
    last one's end, busy time (union of kernel intervals), idle gaps between consecutive kernels
    (histogram and the largest, with the kernels on either side)."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            tr = json.load(f)
    finally:
        os.unlink(path)
    ev = sorted((float(e["ts"]), float(e.get("dur", 0)), e.get("name", "?")) for e in tr.get("traceEvents", [])
                if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    if not ev:
        return None
    span = ev[-1][0] + ev[-1][1] - ev[0][0]
    busy, end, gl = 0.0, ev[0][0], []
    for i, (ts, dur, name) in enumerate(ev):
        if ts > end:
            gl.append((ts - end, ev[i - 1][2] if i else "", name))
        busy += max(0.0, ts + dur - max(ts, end))
        end = max(end, ts + dur)
    bins = [(0, 2), (2, 5), (5, 10), (10, 50), (50, 1e12)]
    hist = {f"{lo}-{hi if hi < 1e12 else 'inf'} us": [sum(1 for g in gl if lo <= g[0] < hi),
                                                       round(sum(g[0] for g in gl if lo <= g[0] < hi) / 1e3, 3)]
            for lo, hi in bins}
    out = {"kernels": len(ev), "span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
           "idle_ms": round((span - busy) / 1e3, 3), "gaps_count_ms": hist,
           "largest": [(round(g, 1), a[:70], b[:70]) for g, a, b in sorted(gl, reverse=True)[:top]]}
    print(f"timeline: {out['kernels']} kernels, span {out['span_ms']} ms, busy {out['busy_ms']} ms, idle {out['idle_ms']} ms")
    print("  gaps (count, ms): " + ", ".join(f"{k}: {v[0]} / {v[1]}" for k, v in hist.items()))
    for g, a, b in out["largest"]:
        print(f"  {g:8.1f} us after {a[:60]} -> {b[:60]}")
    return out
