"""gpu_vae.py's decoder parts: 2. ComfyUI's FLUX VAE decoder stock vs patched (both layouts, PSNR vs
stock and vs fp32, kernel breakdown); 3. the node path on a real ``comfy.sd.VAE``."""
import math
import os
import sys

import torch

from _vae_common import (DEV, ROOT, _plan_of, gn, gnh, gpu_gaps, host_ms_of, kernel_breakdown, median_ms, note, profiled,
                         registry, rows, up2)


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


def init_(dec, seed=0, device=None):
    """The decoder's random weights (drawn on ``device``, default DEV: decode_ssim.py passes its own)."""
    dev = DEV if device is None else device
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for n, p in dec.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, device=dev, generator=g))
            elif p.ndim == 1:
                p.copy_(0.05 * torch.randn(p.shape, device=dev, generator=g))
            else:
                p.copy_(torch.randn(p.shape, device=dev, generator=g) / math.sqrt(p[0].numel()))


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
