"""GPU check + timing of groupnorm_silu and of ComfyUI's FLUX VAE decoder, stock vs patched.

    FLUX_NUMBA_REAL_GPU=1 COMFYUI_PATH=.carry/ComfyUI python bench/gpu_vae.py [--decoder-only]

1. groupnorm_silu at the decoder's shapes (bf16, plus fp32 / silu off / large-mean cases):
   error vs an fp32 reference (relative Frobenius + max abs, next to stock bf16's own error),
   NaN check with NaN-poisoned output/partials; timing of ours vs stock ``F.group_norm`` +
   ``F.silu``: DEVICE time = 10 back-to-back calls queued behind ``torch.cuda._sleep`` (long
   enough to cover their host launch time) between CUDA events / 10, median of 3; HOST us/call
   = wall time of issuing those calls; plus the run-5 metric (events around ONE call, median
   of 25: host latency + device); GB/s for 3*numel*itemsize bytes (read x twice, write y)
   from device time, against a same-size device copy timed the same way and the 3.7 TB/s
   ceiling; per-kernel device split (stats / normalize) on 128x1024^2; Python cost per call.
2. If ComfyUI imports (COMFYUI_PATH, default .carry/ComfyUI): its FLUX VAE Decoder (ch 128,
   ch_mult [1,2,4,4], 2 res blocks, z 16, random weights, bf16), decode of a [1,16,128,128]
   latent (1024^2 image) stock vs patched (median of 5 after 2 warm-ups), PSNR patched vs
   stock and both vs an fp32 decoder with the same weights; GroupNorm-kernel time from the
   profiler for both.
3. The node itself on a real ``comfy.sd.VAE`` (FLUX keys, random weights): ComfyUI's decode
   stock vs patched (backend auto: the registry's autotune may keep torch on shapes where it
   measured faster; every call of >= 32M elements must run numba; PSNR > 40 dB), and the stock
   VAE restored afterwards.
4. The NHWC decoder's kernels (layout "nhwc"): groupnorm_silu_nhwc at the decoder's shapes vs torch's
   GroupNorm+SiLU on the same channels_last tensor and vs our NCHW kernel on the NCHW copy; the
   nearest-2x upsample ours vs torch NHWC / NCHW (device time as in 1); the decoder in both layouts
   (2.) with a kernel breakdown of each (cuDNN convs, cuDNN layout conversions, ours, attention,
   copies, other).
Never stops at the first failure; table last; JSON to $OUT/gpu_vae.json if OUT is set.
"""
import json
import math
import os
import sys
import time
import traceback

os.environ.setdefault("FLUX_NUMBA_REAL_GPU", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _pack  # noqa: E402

_pack.load()
from flux_numba_pack.cuda_kernels import registry  # noqa: E402


def _plan_of(decoder):
    from flux_numba_pack.nodes.host.vae import plan_of
    return plan_of(decoder)
from flux_numba_pack.cuda_kernels import groupnorm_silu as gn  # noqa: E402
from flux_numba_pack.cuda_kernels import groupnorm_silu_nhwc as gnh  # noqa: E402
from flux_numba_pack.cuda_kernels import upsample_nearest2x as up2  # noqa: E402
from flux_numba_pack.cuda_kernels import bias_residual_nhwc as brn  # noqa: E402
from flux_numba_pack.flux_core import harness  # noqa: E402

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
    """One call between CUDA events, median (flux_core.harness)."""
    return harness.median_ms(fn, DEV, warm, rep)


def device_ms(fn, reps=10, trials=3):
    """(device ms per call, host us per call, queued ok): ``reps`` back-to-back calls queued behind
    a GPU sleep long enough to cover their host launch time, so the events bracket device work
    only; median over ``trials``.  Host us/call = wall time of issuing the calls (no sync)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    cycles = int(max(4_000_000, 3.0 * host * 2.0e9))  # ~2 GHz: 3x the host time of the loop
    devs, hosts = [], []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        s.record()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        hosts.append(time.perf_counter() - t)
        e.record()
        e.synchronize()
        devs.append(s.elapsed_time(e) / reps)
    dev = sorted(devs)[len(devs) // 2]
    h = sorted(hosts)[len(hosts) // 2]
    return dev, h / reps * 1e6, h * 1e3 < 0.8 * cycles / 2.0e6


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


# ----------------------------------------------------------------------------- kernel
CASES = [
    # name, shape, dtype, silu, mean
    ("512x128^2", (1, 512, 128, 128), torch.bfloat16, True, 0.0),
    ("512x256^2", (1, 512, 256, 256), torch.bfloat16, True, 0.0),
    ("512x512^2", (1, 512, 512, 512), torch.bfloat16, True, 0.0),
    ("256x1024^2", (1, 256, 1024, 1024), torch.bfloat16, True, 0.0),
    ("128x1024^2", (1, 128, 1024, 1024), torch.bfloat16, True, 0.0),
    ("512x128^2 nosilu", (1, 512, 128, 128), torch.bfloat16, False, 0.0),
    ("256x512^2 fp32", (1, 256, 512, 512), torch.float32, True, 0.0),
    ("256x512^2 fp32 mean100", (1, 256, 512, 512), torch.float32, False, 100.0),
    ("2x128x97x131 odd", (2, 128, 97, 131), torch.bfloat16, True, 0.0),
]


def run_case(name, shape, dt, silu, mean):
    g = torch.Generator(device=DEV).manual_seed(hash(name) % 2**31)
    x = (torch.randn(shape, device=DEV, generator=g) * 2 + mean).to(dt)
    C = shape[1]
    w = (1 + 0.3 * torch.randn(C, device=DEV, generator=g)).to(dt)
    b = (0.3 * torch.randn(C, device=DEV, generator=g)).to(dt)
    eps = 1e-6
    ref = F.group_norm(x.double() if mean else x.float(), 32, w.double() if mean else w.float(),
                       b.double() if mean else b.float(), eps)
    if silu:
        ref = F.silu(ref)
    y = poisoned(lambda: ours(x, 32, w, b, eps, silu))
    torch.cuda.synchronize()
    nan = bool(torch.isnan(y).any())
    err = rel(y, ref)
    maxabs = (y.double() - ref.double()).abs().max().item()
    serr = rel(stock(x, 32, w, b, eps, silu), ref)
    del ref
    # device time (calls queued behind a GPU sleep) and host launch cost, separately
    t_ours, h_ours, q_ours = device_ms(lambda: ours(x, 32, w, b, eps, silu))
    t_stock, h_stock, q_stock = device_ms(lambda: stock(x, 32, w, b, eps, silu))
    buf = torch.empty_like(x)
    t_copy, _, _ = device_ms(lambda: buf.copy_(x))
    w_ours = median_ms(lambda: ours(x, 32, w, b, eps, silu))  # one call between events (run-5 metric)
    w_stock = median_ms(lambda: stock(x, 32, w, b, eps, silu))
    nbytes = 3 * x.numel() * x.element_size()
    gbs = nbytes / (t_ours * 1e-3) / 1e9
    copy_gbs = 2 * x.numel() * x.element_size() / (t_copy * 1e-3) / 1e9
    ok = (not nan) and err <= max(2 * serr, 1e-5) + (4e-3 if dt == torch.bfloat16 else 1e-5)
    note(name, ok=ok, nan=nan, rel_err=f"{err:.2e}", stock_rel_err=f"{serr:.2e}", max_abs=f"{maxabs:.2e}",
         ours_dev_ms=round(t_ours, 4), stock_dev_ms=round(t_stock, 4), speedup=round(t_stock / t_ours, 2),
         ours_host_us=round(h_ours, 1), stock_host_us=round(h_stock, 1), queued_ok=q_ours and q_stock,
         ours_call_ms=round(w_ours, 4), stock_call_ms=round(w_stock, 4), copy_dev_ms=round(t_copy, 4),
         GBps=round(gbs), copy_GBps=round(copy_gbs), pct_copy=round(100 * gbs / copy_gbs, 1),
         pct_3p7=round(100 * gbs * 1e9 / CEIL, 1), MB=round(nbytes / 1e6, 1))
    rows.append((name, "OK" if ok else "FAIL", f"{err:.1e}/{serr:.1e}", f"{t_stock:.3f}", f"{t_ours:.3f}",
                 f"{t_stock / t_ours:.1f}x", f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%",
                 f"{h_ours:.0f}/{h_stock:.0f}" + ("" if q_ours and q_stock else "!"), f"{w_ours:.3f}"))
    return x, w, b


def split_and_overhead(x, w, b):
    y, k_stats, k_norm = gn.plan(x, 32, w, b, 1e-6, True)
    t1, h1, _ = device_ms(k_stats)
    k_stats()
    t2, h2, _ = device_ms(k_norm)
    n = x.numel() * x.element_size()
    note("split 128x1024^2 (device)", stats_ms=round(t1, 4), stats_GBps=round(n / t1 / 1e6),
         norm_ms=round(t2, 4), norm_GBps=round(2 * n / t2 / 1e6), stats_host_us=round(h1, 1),
         norm_host_us=round(h2, 1))
    rows.append(("split stats/norm", "", "", "", f"{t1:.3f}/{t2:.3f}", "",
                 f"{n / t1 / 1e6:.0f}/{2 * n / t2 / 1e6:.0f}", "", f"{h1:.0f}/{h2:.0f}", ""))
    xs = torch.randn(1, 512, 16, 16, device=DEV, dtype=torch.bfloat16)
    ws, bs = w.new_ones(512), w.new_zeros(512)
    with registry.force("numba", ops=[gn.OP]):
        for _ in range(20):
            registry.call(gn.OP, xs, 32, ws, bs, 1e-6, silu=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(300):
            registry.call(gn.OP, xs, 32, ws, bs, 1e-6, silu=True)
        cpu_us = (time.perf_counter() - t) / 300 * 1e6
        torch.cuda.synchronize()
    note("python cost per call", us=round(cpu_us, 1))
    rows.append(("python/call 512x16^2", "", "", "", "", "", "", "", f"{cpu_us:.0f}", ""))


# ----------------------------------------------------------------------------- NHWC kernels
NHWC_SHAPES = [(512, 128), (512, 256), (512, 512), (256, 512), (256, 1024), (128, 1024)]
UP_SHAPES = [(512, 128), (512, 256), (256, 512)]
BR_SHAPES = [(512, 128), (512, 256), (256, 512), (128, 1024)]
CL = torch.channels_last


def forced(op, *a, **k):
    registry.strict = True
    try:
        with registry.force("numba", ops=[op]):
            return registry.call(op, *a, **k)
    finally:
        registry.strict = False


def _row(name, ok, check, t_torch, t_ours, gbs, host_us, queued, extra):
    """A table row of the NHWC kernel section (the torch column is the same op on channels_last x)."""
    rows.append((name, "OK" if ok else "FAIL", check, f"{t_torch:.3f}", f"{t_ours:.3f}", f"{t_torch / t_ours:.1f}x",
                 f"{gbs:.0f}", f"{100 * gbs * 1e9 / CEIL:.0f}%/3.7", f"{host_us:.0f}" + ("" if queued else "!"), extra))


def run_nhwc_kernels():
    for C, H in NHWC_SHAPES:
        name = f"nhwc {C}x{H}^2"
        g = torch.Generator(device=DEV).manual_seed(C * H)
        x = (torch.randn((1, C, H, H), device=DEV, generator=g) * 2).to(torch.bfloat16).contiguous(memory_format=CL)
        w = (1 + 0.3 * torch.randn(C, device=DEV, generator=g)).to(torch.bfloat16)
        b = (0.3 * torch.randn(C, device=DEV, generator=g)).to(torch.bfloat16)
        ref = F.silu(F.group_norm(x.float(), 32, w.float(), b.float(), 1e-6))
        y = poisoned(lambda: forced(gnh.OP, x, 32, w, b, 1e-6, silu=True))
        nan = bool(torch.isnan(y).any())
        err, serr = rel(y, ref), rel(stock(x, 32, w, b, 1e-6, True), ref)
        del ref, y
        xn = x.contiguous()
        t_ours, h_ours, q1 = device_ms(lambda: forced(gnh.OP, x, 32, w, b, 1e-6, silu=True))
        t_tcl, _, _ = device_ms(lambda: stock(x, 32, w, b, 1e-6, True))
        t_nchw, _, _ = device_ms(lambda: ours(xn, 32, w, b, 1e-6, True))
        t_tn, _, _ = device_ms(lambda: stock(xn, 32, w, b, 1e-6, True))
        nbytes = 3 * x.numel() * 2
        gbs = nbytes / (t_ours * 1e-3) / 1e9
        ok = not nan and err <= max(2 * serr, 1e-5) + 4e-3
        note(name, ok=ok, nan=nan, rel_err=f"{err:.2e}", stock_rel_err=f"{serr:.2e}", ours_nhwc_ms=round(t_ours, 4),
             torch_nhwc_ms=round(t_tcl, 4), ours_nchw_ms=round(t_nchw, 4), torch_nchw_ms=round(t_tn, 4),
             GBps=round(gbs), pct_3p7=round(100 * gbs * 1e9 / CEIL, 1), host_us=round(h_ours, 1), queued_ok=q1)
        _row(name, ok, f"{err:.1e}/{serr:.1e}", t_tcl, t_ours, gbs, h_ours, q1, f"nchw {t_nchw:.3f}/{t_tn:.3f}")
        del x, xn
        torch.cuda.empty_cache()
    for C, H in UP_SHAPES:
        name = f"up2x {C}x{H}^2"
        x = torch.randn((1, C, H, H), device=DEV).to(torch.bfloat16).contiguous(memory_format=CL)
        y = forced(up2.OP, x)
        ok = bool(torch.equal(y, F.interpolate(x, scale_factor=2.0, mode="nearest")))
        del y
        xn = x.contiguous()
        t_ours, h_ours, q1 = device_ms(lambda: forced(up2.OP, x))
        t_tcl, _, _ = device_ms(lambda: F.interpolate(x, scale_factor=2.0, mode="nearest"))
        t_tn, _, _ = device_ms(lambda: F.interpolate(xn, scale_factor=2.0, mode="nearest"))
        gbs = 5 * x.numel() * 2 / (t_ours * 1e-3) / 1e9
        note(name, ok=ok, ours_ms=round(t_ours, 4), torch_nhwc_ms=round(t_tcl, 4), torch_nchw_ms=round(t_tn, 4),
             GBps=round(gbs), host_us=round(h_ours, 1))
        _row(name, ok, "bit-exact" if ok else "MISMATCH", t_tcl, t_ours, gbs, h_ours, q1, f"nchw torch {t_tn:.3f}")
        del x, xn
        torch.cuda.empty_cache()
    for C, H in BR_SHAPES:
        name = f"bias+res {C}x{H}^2"
        y0 = torch.randn((1, C, H, H), device=DEV).to(torch.bfloat16).contiguous(memory_format=CL)
        r = torch.randn_like(y0)
        bias = torch.randn(C, device=DEV).to(torch.bfloat16)
        y = forced(brn.OP, y0.clone(), bias, r)
        exact = y0.float() + bias.float().view(1, -1, 1, 1) + r.float()
        ok = (y.float() - exact).abs().max().item() <= 2 ** -7 * exact.abs().max().item()
        del y, exact
        yy = y0.clone()
        t_ours, h_ours, q1 = device_ms(lambda: forced(brn.OP, yy, bias, r))
        t_t, _, _ = device_ms(lambda: yy.add_(bias.view(1, -1, 1, 1)).add_(r))   # torch: cuDNN's bias add, x + h
        t_b, _, _ = device_ms(lambda: yy.add_(bias.view(1, -1, 1, 1)))
        gbs = 3 * y0.numel() * 2 / (t_ours * 1e-3) / 1e9
        note(name, ok=ok, ours_ms=round(t_ours, 4), torch_bias_then_add_ms=round(t_t, 4), torch_bias_ms=round(t_b, 4),
             GBps=round(gbs), host_us=round(h_ours, 1))
        _row(name, ok, "1 rounding", t_t, t_ours, gbs, h_ours, q1, f"torch bias alone {t_b:.3f}")
        del y0, r, yy
        torch.cuda.empty_cache()


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


# ----------------------------------------------------------------------------- decoder
def comfy_decoder():
    p = os.environ.get("COMFYUI_PATH", os.path.join(ROOT, ".carry", "ComfyUI"))
    if not os.path.isdir(os.path.join(p, "comfy")):
        return None, f"no ComfyUI tree at {p}"
    sys.path.insert(0, os.path.abspath(p))
    try:
        import comfy.ldm.modules.diffusionmodules.model as M
    except Exception as e:
        return None, f"ComfyUI not importable: {type(e).__name__}: {e}"
    return M, None


def init_(dec, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for n, p in dec.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, device=DEV, generator=g))
            elif p.ndim == 1:
                p.copy_(0.05 * torch.randn(p.shape, device=DEV, generator=g))
            else:
                p.copy_(torch.randn(p.shape, device=DEV, generator=g) / math.sqrt(p[0].numel()))


def psnr(a, b):
    a, b = a.float(), b.float()
    rng = (b.max() - b.min()).item()
    mse = ((a - b) ** 2).mean().item()
    return float("inf") if mse == 0 else 10 * math.log10(rng * rng / mse)


def run_decoder():
    M, why = comfy_decoder()
    if M is None:
        note("decoder", skipped=why)
        rows.append(("decoder", "SKIP", why[:40], "", "", "", "", "", "", ""))
        return
    from flux_numba_pack.nodes.host import vae as VP
    cfg = dict(ch=128, out_ch=3, ch_mult=[1, 2, 4, 4], num_res_blocks=2, attn_resolutions=[], in_channels=3,
               resolution=256, z_channels=16)
    with torch.device(DEV):
        dec = M.Decoder(**cfg)
    init_(dec)
    dec = dec.eval().to(DEV, torch.bfloat16)
    pat, counts = VP.patched_decoder(dec, backend="numba", layout="nchw")
    pat_h, _ = VP.patched_decoder(dec, backend="auto", layout="nhwc")   # (numba forced would refuse conv_out's 3-channel bias)
    pat_e, _ = VP.patched_decoder(dec, backend="auto", layout="nhwc", cuda_graph="off")   # eager NHWC
    z = torch.randn(1, 16, 128, 128, device=DEV, dtype=torch.bfloat16)
    registry.strict = True
    with torch.no_grad():
        out_s = dec(z)
        registry.take_usage()
        out_p = pat(z)
        used = registry.take_usage().get(gn.OP, {})
        out_h = pat_e(z)
        used_h = registry.take_usage()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        res0 = torch.cuda.memory_reserved()
        gr = _plan_of(pat_h).graph
        out_g = [pat_h(z) for _ in range(3)][-1]      # 2 eager warm-ups, then capture + replay
        modes_g = gr.last_mode
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        pool_mb = (torch.cuda.memory_reserved() - res0) / 2 ** 20   # what the graph keeps between decodes
        t_s = median_ms(lambda: dec(z), warm=2, rep=5)
        t_p = median_ms(lambda: pat(z), warm=2, rep=5)
        t_h = median_ms(lambda: pat_e(z), warm=2, rep=5)
        t_g = median_ms(lambda: pat_h(z), warm=2, rep=5)
        print(f"  low-res graph: mode {modes_g}, captures {gr.gf.captures if gr.gf else None}, "
              f"reserved +{pool_mb:.0f} MB with the graph")
        profs = {k: profiled(f) for k, f in (("stock", lambda: dec(z)), ("nchw", lambda: pat(z)),
                                            ("nhwc", lambda: pat_e(z)), ("nhwc+graph", lambda: pat_h(z)))}
        brk = {k: kernel_breakdown(p) for k, p in profs.items()}
        (ts, _, _, gs), (tp, _, _, gp) = brk["stock"], brk["nchw"]
        host_h = host_ms_of(lambda: pat_e(z))
        host_g = host_ms_of(lambda: pat_h(z))
        span_h, idle_h = gpu_gaps(profs.pop("nhwc"))
        span_g, idle_g = gpu_gaps(profs.pop("nhwc+graph"))
        del profs
        with torch.device(DEV):
            d32 = M.Decoder(**cfg)
        d32.load_state_dict({k: v.float() for k, v in dec.state_dict().items()})
        d32 = d32.eval().to(DEV, torch.float32)
        out_f = d32(z.float())
        del d32
    registry.strict = False
    nan = bool(torch.isnan(out_p).any())
    p_ps, p_sf, p_pf = psnr(out_p, out_s), psnr(out_s, out_f), psnr(out_p, out_f)
    ok = (not nan) and used == {"numba": 30} and p_pf >= p_sf - 3
    nan_h = bool(torch.isnan(out_h).any())
    h_ps, h_pf = psnr(out_h, out_s), psnr(out_h, out_f)
    g_pe, g_pf = psnr(out_g, out_h), psnr(out_g, out_f)
    # (inside a capture vae_attention takes smaller chunks: other GEMM kernels, so not bit-equal to eager)
    ok_g = (modes_g == "graph" and not bool(torch.isnan(out_g).any()) and g_pf >= h_pf - 0.3)
    note("decoder 1024^2 bf16 nhwc + low-res graph", ok=ok_g, mode=modes_g, ms=round(t_g, 2),
         eager_ms=round(t_h, 2), host_ms=round(host_g, 2), gpu_span_ms=span_g, gpu_idle_ms=idle_g,
         graph_pool_mb=round(pool_mb, 1), psnr_vs_eager=round(g_pe, 1), psnr_vs_fp32=round(g_pf, 1),
         bar_30ms=t_g <= 30.0)
    rows.append(("decoder nhwc+graph", "OK" if ok_g else "FAIL", f"vs eager {g_pe:.0f}dB/fp32 {g_pf:.1f}",
                 f"{t_s:.2f}", f"{t_g:.2f}", f"{t_s / t_g:.2f}x", f"eager {t_h:.2f}", f"idle {idle_g:.2f}/{idle_h:.2f}",
                 f"pool {pool_mb:.0f}MB", f"host {host_g:.1f}/{host_h:.1f}ms"))
    ok_h = (not nan_h and used_h.get(gnh.OP) == {"numba": 30} and used_h.get(up2.OP) == {"numba": 3}
            and gn.OP not in used_h and out_h.is_contiguous() and h_pf >= p_sf - 0.5)
    note("decoder 1024^2 bf16 nhwc", ok=ok_h, usage=used_h, ms=round(t_h, 2), host_ms=round(host_h, 2),
         gpu_span_ms=span_h, gpu_idle_ms=idle_h,
         stock_ms=round(t_s, 2),
         nchw_ms=round(t_p, 2), speedup=round(t_s / t_h, 3), psnr_vs_stock=round(h_ps, 1),
         psnr_vs_fp32=round(h_pf, 1), psnr_stock_vs_fp32=round(p_sf, 1), bar_30ms=t_h <= 30.0, breakdown=brk)
    for k, (tot, cats, topk, _) in brk.items():
        print(f"  kernels {k}: total {tot:.2f} ms, " + ", ".join(f"{c} {v:.2f}" for c, v in sorted(cats.items())))
        for t_, n_, k_ in topk:
            print(f"      {t_:8.3f} ms {n_:4d}x  {k_}")
    rows.append(("decoder 1024^2 nhwc", "OK" if ok_h else "FAIL", f"psnr {h_ps:.0f}dB/fp32 {h_pf:.1f}",
                 f"{t_s:.2f}", f"{t_h:.2f}", f"{t_s / t_h:.2f}x", f"nchw {t_p:.2f}", f"fp32: stock {p_sf:.1f}",
                 "", "bar <= 30: " + ("met" if t_h <= 30.0 else "NOT met")))
    note("decoder 1024^2 bf16", ok=ok, counts=counts, gn_calls=used, stock_ms=round(t_s, 2),
         patched_ms=round(t_p, 2), speedup=round(t_s / t_p, 3), psnr_patched_vs_stock=round(p_ps, 1),
         psnr_stock_vs_fp32=round(p_sf, 1), psnr_patched_vs_fp32=round(p_pf, 1),
         prof_gn_ms_stock=round(gs, 2), prof_total_ms_stock=round(ts, 2),
         prof_gn_ms_patched=round(gp, 2), prof_total_ms_patched=round(tp, 2))
    rows.append(("decoder 1024^2", "OK" if ok else "FAIL", f"psnr {p_ps:.0f}dB", f"{t_s:.2f}", f"{t_p:.2f}",
                 f"{t_s / t_p:.2f}x", f"GN {gs:.1f}->{gp:.1f}ms", "", "", ""))


def run_node_path():
    """The real node on a real ``comfy.sd.VAE`` (FLUX keys, random weights): ComfyUI's own
    decode (load_models_gpu -> object patch) stock vs patched, and the stock VAE afterwards."""
    M, why = comfy_decoder()
    if M is None:
        note("node path", skipped=why)
        return
    try:
        import comfy.sd
        from flux_numba_pack.nodes.host.vae import random_vae_state_dict
        g = torch.Generator().manual_seed(1)
        sd = random_vae_state_dict(generator=g)  # z below continues the same stream
    except Exception as e:
        note("node path", skipped=f"comfy.sd not importable: {type(e).__name__}: {e}")
        rows.append(("node VAE.decode", "SKIP", str(e)[:40], "", "", "", "", "", "", ""))
        return
    from flux_numba_pack.nodes import vae_patch as VP
    vae = comfy.sd.VAE(sd=sd)
    out = VP.apply(vae)[0]                    # default: layout nhwc
    out_n = VP.apply(vae, layout="nchw")[0]
    out_e = VP.apply(vae, cuda_graph="off")[0]
    z = torch.randn(1, 16, 128, 128, generator=g)
    registry.take_usage()
    calls = []  # (x shape, backend) of every groupnorm_silu call of the patched decode
    real_call = registry.call

    def spy(op, *a, **k):
        r = real_call(op, *a, **k)
        if op in (gn.OP, gnh.OP):
            calls.append((tuple(a[0].shape), registry.last[op]))
        return r
    with torch.inference_mode():  # as ComfyUI's executor runs nodes
        a = vae.decode(z)
        registry.call = spy  # instance attribute shadows the method (vae_patch calls registry.call)
        try:
            b = out.decode(z)  # backend "auto": the registry's autotune may pick torch where it is faster
        finally:
            del registry.call
        usage = registry.take_usage()
        used = usage.get(gnh.OP, {})
        c = vae.decode(z)  # stock again: the object patch must be gone
        restored = type(vae.first_stage_model.decoder).__name__ == "Decoder"
        t_s = median_ms(lambda: vae.decode(z), warm=1, rep=5)
        t_p = median_ms(lambda: out.decode(z), warm=3, rep=9)      # from the 3rd decode on: the graph replays
        gmode = _plan_of(out.patcher.object_patches["decoder"]).graph.last_mode
        t_e = median_ms(lambda: out_e.decode(z), warm=1, rep=9)
        t_n = median_ms(lambda: out_n.decode(z), warm=1, rep=3)
        # ComfyUI's share: the same decode with the decoder's own time taken out (events around it)
        inner = []
        dec_p = out.patcher.object_patches["decoder"]
        real_fwd = type(dec_p).forward

        def timed_fwd(self_, *a_, **k_):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            r_ = real_fwd(self_, *a_, **k_)
            e1.record()
            e1.synchronize()
            inner.append(e0.elapsed_time(e1))
            return r_
        type(dec_p).forward = timed_fwd
        try:
            t_pi = median_ms(lambda: out.decode(z), warm=3, rep=5)   # (loading out_e / out_n detached out: graph dropped)
        finally:
            type(dec_p).forward = real_fwd
        t_inner = sorted(inner[-5:])[2]
        print("  node path, eager NHWC decode:")
        host_ms_of(lambda: out_e.decode(z), top=22)
        print("  node path, NHWC decode with the low-res graph:")
        host_ms_of(lambda: out.decode(z), top=22)
        p_n = psnr(out_n.decode(z), a)
        try:  # ComfyUI's tiled decode (the OOM fallback) through the patched decoder
            tl_s = vae.decode_tiled(z)
            tl_p = out.decode_tiled(z)
            p_tiled = psnr(tl_p, tl_s)
            t_tl_s = median_ms(lambda: vae.decode_tiled(z), warm=0, rep=1)
            t_tl_p = median_ms(lambda: out.decode_tiled(z), warm=0, rep=1)
        except Exception as e:
            p_tiled, t_tl_s, t_tl_p = f"{type(e).__name__}: {e}", None, None
    p = psnr(b, a)
    by_shape = {}
    for shp, be in calls:
        d = by_shape.setdefault("x".join(map(str, shp)), {})
        d[be] = d.get(be, 0) + 1
    # auto may keep torch on small shapes where it measured faster; the big ones (>= 32M elements:
    # 512x256^2 and up) must run numba
    big_not_numba = sorted({k for k, d in by_shape.items() if math.prod(map(int, k.split("x"))) >= 2 ** 25
                            and set(d) != {"numba"}})
    ok = (out is not vae and len(calls) == 30 and sum(used.values()) == 30 and not big_not_numba and restored
          and bool((a == c).all()) and p > 40)
    note("node path VAE.decode 1024^2", ok=ok, gn_calls=used, usage=usage, by_shape=by_shape,
         big_not_numba=big_not_numba, stock_restored=restored, stock_ms=round(t_s, 2), patched_ms=round(t_p, 2),
         nchw_ms=round(t_n, 2), eager_ms=round(t_e, 2), graph_mode=gmode, decoder_inside_ms=round(t_inner, 2),
         decode_with_events_ms=round(t_pi, 2), comfy_share_ms=round(t_pi - t_inner, 2),
         bar_30ms=t_p <= 30.0, psnr_nchw_vs_stock=round(p_n, 1), psnr_patched_vs_stock=round(p, 1),
         vae_dtype=str(vae.vae_dtype), tiled_psnr=p_tiled, tiled_stock_ms=t_tl_s, tiled_patched_ms=t_tl_p)
    rows.append(("node VAE.decode", "OK" if ok else "FAIL", f"psnr {p:.0f}dB", f"{t_s:.2f}", f"{t_p:.2f}",
                 f"{t_s / t_p:.2f}x", f"numba {used.get('numba', 0)}/30", f"eager {t_e:.2f} ({gmode})",
                 f"decoder {t_inner:.1f} of {t_pi:.1f}", f"nchw {t_n:.2f}"))


def section(name, row, fn):
    """Run one part of the bench: a failure is noted (and a table row) and the rest still runs."""
    try:
        fn()
    except Exception as e:
        traceback.print_exc()
        note(name, ok=False, error=f"{type(e).__name__}: {e}")
        rows.append((row, "ERROR", str(e)[:40], "", "", "", "", "", "", ""))
    torch.cuda.empty_cache()


def main():
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    keep = None
    only_dec = "--decoder-only" in sys.argv    # skip 1. and 4.'s kernel tables (e.g. a second ComfyUI tree)
    for c in ([] if only_dec else CASES):
        try:
            r = run_case(*c)
            if c[0] == "128x1024^2":
                keep = r
            del r
        except Exception as e:
            traceback.print_exc()
            note(c[0], ok=False, error=f"{type(e).__name__}: {e}")
            rows.append((c[0], "ERROR", str(e)[:40], "", "", "", "", "", "", ""))
        torch.cuda.empty_cache()
    try:
        if keep is not None:
            split_and_overhead(*keep)
    except Exception as e:
        traceback.print_exc()
        note("split", error=f"{type(e).__name__}: {e}")
    keep = None
    torch.cuda.empty_cache()
    if not only_dec:
        section("nhwc kernels", "nhwc kernels", run_nhwc_kernels)
    section("decoder", "decoder", run_decoder)
    if time.time() - T0 < 240:
        section("node path", "node VAE.decode", run_node_path)
    else:
        note("node path", skipped="time budget")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_vae.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    hdr = ("case", "check", "err ours/stock", "stock dev ms", "ours dev ms", "speedup", "GB/s", "% copy",
           "host us ours/stock", "ours 1-call ms")
    w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
    print(f"\n=== groupnorm_silu / FLUX VAE decoder (H200; bytes = 3*numel*itemsize; ceiling 3.7 TB/s), "
          f"{time.time() - T0:.0f}s ===")
    print("dev ms: 10 calls queued behind a GPU sleep / 10 (device only); host us: Python+launch per call "
          "(! = host outran the sleep); 1-call ms: events around one call (host+device, run-5 metric); "
          "% copy: vs a same-size device copy timed the same way")
    for r in [hdr] + rows:
        print("  ".join(str(v).ljust(w[i]) for i, v in enumerate(r)))


if __name__ == "__main__":
    main()
