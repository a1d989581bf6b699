"""gpu_vae.py's kernel tables: 1. groupnorm_silu at the decoder's shapes (error, NaN check, device /
host time vs stock, the stats / normalize split, Python cost per call); 4. the NHWC decoder's kernels
(groupnorm_silu_nhwc, the nearest-2x upsample, bias + residual)."""
import time

import torch
import torch.nn.functional as F

from _vae_common import (CEIL, DEV, brn, device_ms, gn, gnh, median_ms, note, ours, poisoned, registry, rel,
                         rows, stock, up2)


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
