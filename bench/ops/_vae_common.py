"""gpu_vae.py's shared part: the set-up (the pack loaded, its VAE kernels imported), the results every
section records into (``rows`` for the table, ``results`` for the JSON, ``note``), the timing helpers,
ours / stock GroupNorm+SiLU, and the profiler helpers (kernel time by category, timeline gaps, host
time of one call)."""
import os
import sys
import time

os.environ.setdefault("FLUX_NUMBA_REAL_GPU", "1")
BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: timing.py
ROOT = os.path.dirname(BENCH)  # the repo root
sys.path[:0] = [ROOT, BENCH]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _pack  # noqa: E402
import timing  # noqa: E402  (bench/timing.py)

_pack.load()
from flux_numba_pack.cuda_kernels import registry  # noqa: E402


def _plan_of(decoder):
    from flux_numba_pack.nodes.host.vae import plan_of
    return plan_of(decoder)
from flux_numba_pack.cuda_kernels import groupnorm_silu as gn  # noqa: E402
from flux_numba_pack.cuda_kernels import groupnorm_silu_nhwc as gnh  # noqa: E402
from flux_numba_pack.cuda_kernels import upsample_nearest2x as up2  # noqa: E402
from flux_numba_pack.cuda_kernels import bias_residual_nhwc as brn  # noqa: E402

T0 = time.time()
DEV = "cuda"
CEIL = 3.7e12
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
rows = []
results = {}


def note(name, **kw):
    results[name] = kw
    print(f"[{time.time() - T0:6.1f}s] {name}: " + ", ".join(f"{k}={v}" for k, v in kw.items()), flush=True)


def median_ms(fn, warm=3, rep=25):
    """One call between CUDA events, synchronized around each, median (``timing.median_ms``)."""
    return timing.median_ms(fn, reps=rep, warm=warm, sync_each=True)


def device_ms(fn, reps=10, trials=3):
    """(device ms per call, host us per call, queued ok): ``timing.queued_ms``."""
    return timing.queued_ms(fn, reps, trials)


def ours(x, G, w, b, eps, silu):
    registry.strict = True
    try:
        with registry.force("numba", ops=[gn.OP]):
            return registry.call(gn.OP, x, G, w, b, eps, silu=silu)
    finally:
        registry.strict = False


def stock(x, G, w, b, eps, silu):
    y = F.group_norm(x, G, w, b, eps)
    return F.silu(y, inplace=True) if silu else y  # ComfyUI: SiLU(inplace=True)


def poisoned(fn):
    real_like, real_empty = torch.empty_like, torch.empty
    torch.empty_like = lambda t, *a, **k: real_like(t, *a, **k).fill_(float("nan"))
    torch.empty = lambda *a, **k: (lambda o: o.fill_(float("nan")) if o.is_floating_point() else o)(real_empty(*a, **k))
    try:
        return fn()
    finally:
        torch.empty_like, torch.empty = real_like, real_empty


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


KCATS = (("attention", ("fmha", "attention", "flash", "softmax", "nvjet")),   # (first match wins: before
         ("cudnn conv", ("xmma_fprop", "implicit_gemm", "conv2d", "convolve", "cutlass", "sm90_", "dgrad")),
         ("cudnn layout", ("nchwtonhwc", "nhwctonchw")),                        # "cutlass" / "sm90_")
         ("ours", ("flux_numba",)),
         ("copies", ("direct_copy", "copy_kernel")))
GN_KEYS = ("group_norm", "groupnorm", "moments", "stats", "norm_", "cudakernel_norm")


def profiled(fn):
    """The torch profiler (CUDA activity) around one call."""
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def kernel_breakdown(prof, top=12):
    """(total ms, {category: ms}, top kernels [(ms, calls, name)], GroupNorm-kernel ms) of a profile."""
    evs = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0.0)
        if t and ev.key and not ev.key.startswith(("cudaLaunch", "cudaDevice", "cudaStream", "cudaEvent")):
            evs.append((t / 1e3, ev.count, ev.key))
    cats = {}
    gn_ms = 0.0
    for ms, _, k in evs:
        kl = k.lower()
        c = next((c for c, keys in KCATS if any(s in kl for s in keys)), "other")
        cats[c] = round(cats.get(c, 0.0) + ms, 3)
        if any(s in kl for s in GN_KEYS):
            gn_ms += ms
    evs.sort(reverse=True)
    return (round(sum(e[0] for e in evs), 3), cats, [(round(a, 3), n, k[:90]) for a, n, k in evs[:top]],
            round(gn_ms, 3))


def gpu_gaps(prof, top=12):
    """Timeline of a profiled call: (GPU busy span ms, sum of idle gaps between kernels ms); prints
    the largest gaps with the kernels around them -- where the device waits for the host."""
    ks = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start:
            ks.append((e.time_range.start, e.time_range.end, e.name))
    ks.sort()
    gaps, idle, end = [], 0.0, None
    for a0, a1, name in ks:
        if end is not None and a0 > end[0]:
            g = a0 - end[0]
            idle += g
            gaps.append((g, end[1][:60], name[:60]))
        if end is None or a1 > end[0]:
            end = (a1, name)
    gaps.sort(reverse=True)
    span = (ks[-1][1] - ks[0][0]) / 1e3 if ks else 0.0
    print(f"  timeline: {len(ks)} kernels, span {span:.2f} ms, idle {idle / 1e3:.2f} ms; largest gaps (us):")
    for g, a_, b_ in gaps[:top]:
        print(f"      {g:8.1f}  after {a_}  before {b_}")
    small = sum(g for g, _, _ in gaps if g < 20) / 1e3
    print(f"      (gaps < 20 us: {small:.2f} ms in all)")
    return round(span, 3), round(idle / 1e3, 3)


def host_ms_of(fn, top=16):
    """Host ms to issue one call (no sync inside: when it is near the call's wall time the call is
    host-bound), then a cProfile of one more call, top functions by own time (printed)."""
    import cProfile
    import io
    import pstats
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    torch.cuda.synchronize()
    st = io.StringIO()
    pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(top)
    print(f"  host profile (one call issued in {host:.2f} ms):")
    print("\n".join(ln for ln in st.getvalue().splitlines() if ln.strip())[:5000])
    return host
