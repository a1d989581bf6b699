"""GPU check + timing of the NHWC conv kernels (conv3x3.py / conv1x1.py) at every FLUX-decoder conv shape.

    python bench/gpu_conv.py [--configs A,B,..] [--shapes REGEX] [--budget SECONDS]
    python bench/gpu_conv.py --sim          # CPU dry run: Numba's simulator, tiny shapes

Per shape of ``conv3x3.DECODER_SHAPES`` (batch 1, 1024^2 image; the variant the NHWC decoder runs:
GroupNorm+SiLU prologue, residual epilogue, nearest 2x) and per kernel config (``--configs``, names
as ``conv3x3.Config``; a config that fails to build or run is printed and skipped):
  check   ours vs an fp32 reference (rel. Frobenius error, next to stock bf16's own error; NaN-
          poisoned output): ok when rel(ours) <= 1.25 rel(stock bf16) + 2e-3;
  times   (device ms: ``reps`` calls queued behind a GPU sleep between CUDA events / reps, median of
          ``trials``) -- ours fused (the op as the decoder calls it), ours plain (same conv without
          prologue / residual: the GEMM alone), cuDNN conv alone NCHW and channels_last (NHWC),
          each with cudnn.benchmark off (ComfyUI's default) and on, the stock NCHW chain the fused
          op replaces (group_norm + silu (+ interpolate) + conv (+ residual add)), and the torch
          reference on NHWC memory (what the registry falls back to); the GroupNorm statistics
          kernel (groupnorm_stats_nhwc) separately;
  rates   TFLOP/s and % of 765 (H200 bf16 dense as cuBLAS measures it) for ours and cuDNN; the
          bytes floor at 3.7 TB/s.
Ends with a table per shape (best config), the decoder total (each shape x its count): ours
(fused + stats) vs the stock NCHW chain vs cuDNN NHWC, and a CONFIGS dict of the best config per
shape for conv3x3.CONFIGS.  JSON to $OUT/gpu_conv.json when OUT is set.
"""
import argparse
import json
import math
import os
import re
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = "--sim" in sys.argv
if SIM:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
else:
    os.environ.setdefault("FLUX_NUMBA_REAL_GPU", "1")
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _pack  # noqa: E402

_pack.load()   # numpy compat shim before numba-cuda is imported
from flux_numba_pack.cuda_kernels import conv3x3 as C3, conv1x1 as C1, groupnorm_stats_nhwc as GS  # noqa: E402

PEAK = 765e12
BW = 3.7e12
T0 = time.time()
DEV = "cpu" if SIM else "cuda"
BF = torch.bfloat16
DEFAULT_CONFIGS = "8x16-128-32-w2x4-s3-lb2,8x16-128-32-w2x4-s3,8x16-128-32-w2x2-s3"
results = {"shapes": {}, "notes": []}


def note(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def sync():
    if not SIM:
        torch.cuda.synchronize()


def device_ms(fn, reps=5, trials=3):
    """Device ms per call: ``reps`` calls queued behind a GPU sleep covering their host time,
    between CUDA events; median of ``trials`` (simulator: wall time of one call)."""
    if SIM:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    cycles = int(max(2_000_000, 3.0 * host * 2.0e9))
    out = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) / reps)
    return sorted(out)[len(out) // 2]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def poisoned(fn):
    real = torch.empty

    def nan_empty(*a, **k):
        t = real(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    torch.empty = nan_empty
    try:
        return fn()
    finally:
        torch.empty = real


def shapes(args):
    out = []
    for s in C3.DECODER_SHAPES:
        if args.shapes and not re.search(args.shapes, s[0]):
            continue
        if SIM:  # tiny stand-ins with the same variant (channel counts the simulator affords)
            name, Cin, Cout, H, k, up, nm, res, cnt = s
            s = (name, 16 if Cin <= 128 else 32, 3 if Cout == 3 else 16, 3 if up else 5, k, up, nm, res, cnt)
        out.append(s)
    if SIM and not args.shapes:
        keep = ("conv_in", "r512@128.conv2", "attn.qkv", "up3.conv", "conv_out")
        out = [s for s in out if s[0] in keep]
    return out


def inputs(Cin, Cout, Hi, ksz, up, nm, res, G=32, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(1, Hi, Hi, Cin, device=DEV, generator=g) * 2 + 0.5).to(BF)
    w = (torch.randn(Cout, Cin, ksz, ksz, device=DEV, generator=g) / math.sqrt(ksz * ksz * Cin)).to(BF)
    b = (0.3 * torch.randn(Cout, device=DEV, generator=g)).to(BF)
    H = 2 * Hi if up else Hi
    r = torch.randn(1, H, H, Cout, device=DEV, generator=g).to(BF) if res else None
    norm = None
    if nm is not None:
        G = G if Cin % G == 0 and Cin // G >= 1 else 8
        gam = (1 + 0.3 * torch.randn(Cin, device=DEV, generator=g)).to(BF)
        bet = (0.3 * torch.randn(Cin, device=DEV, generator=g)).to(BF)
        norm = (GS.groupnorm_stats_nhwc_numba(x, G), gam, bet, bool(nm))
    return x, w, b, r, norm, G


def run_shape(s, configs, args):
    name, Cin, Cout, Hi, ksz, up, nm, res, cnt = s
    H = 2 * Hi if up else Hi
    fl = C3.flops(Cin, Cout, H, H, ksz)
    x, w, b, r, norm, G = inputs(Cin, Cout, Hi, ksz, up, nm, res, seed=Cin + Cout + Hi)
    wp = C3.pack_weight(w)
    nbytes = (x.numel() + H * H * Cout * (2 if res else 1) + w.numel()) * 2
    rec = {"Cin": Cin, "Cout": Cout, "H_in": Hi, "H_out": H, "ksz": ksz, "upsample2x": bool(up),
           "norm": nm, "residual": bool(res), "count": cnt, "GFLOP": fl / 1e9, "MB": nbytes / 1e6,
           "floor_flop_ms": fl / PEAK * 1e3, "floor_byte_ms": nbytes / BW * 1e3, "configs": {}}
    f = lambda t: None if t is None else t.float()  # noqa: E731
    nmf = None if norm is None else (norm[0], norm[1].float(), norm[2].float(), norm[3])
    ref32 = C3.reference(f(x), f(wp), f(b), f(r), nmf, bool(up))
    ref16 = C3.reference(x, wp, b, r, norm, bool(up))
    e16 = rel(ref16, ref32)
    rec["stock_bf16_rel_err"] = e16
    del ref16
    call = (lambda c, nrm, rr: C3.conv_nhwc_numba(x, wp, b, rr, nrm, bool(up), cfg=c)) if ksz == 3 else \
           (lambda c, nrm, rr: C1.conv1x1_nhwc_numba(x, wp, b, rr, nrm, cfg=c))
    for cs in configs:
        t = time.time()
        try:
            cfg = C3.Config.parse(cs)
            why = cfg.why_invalid()
            if why:
                raise ValueError(why)
            y = poisoned(lambda: call(cfg, norm, r))
            sync()
            nan = bool(torch.isnan(y).any())
            err = rel(y, ref32)
            del y
            ok = (not nan) and err <= 1.25 * e16 + 2e-3
            reps = 3 if SIM else max(3, min(20, int(20 / max(fl / 300e12 * 1e3, 0.05))))
            tf = device_ms(lambda: call(cfg, norm, r), reps=1 if SIM else reps)
            tp = tf if (norm is None and r is None) else device_ms(lambda: call(cfg, None, None),
                                                                    reps=1 if SIM else reps)
            rec["configs"][cs] = {"ok": ok, "nan": nan, "rel_err": err, "fused_ms": tf, "plain_ms": tp,
                                  "fused_TFLOPs": fl / tf / 1e9, "plain_TFLOPs": fl / tp / 1e9,
                                  "pct_peak_fused": 100 * fl / tf / 1e9 / (PEAK / 1e12),
                                  "pct_peak_plain": 100 * fl / tp / 1e9 / (PEAK / 1e12)}
            note(f"{name} {cs}: {'OK' if ok else 'FAIL'} err {err:.2e} (stock {e16:.2e}) fused {tf:.3f} ms "
                 f"({fl / tf / 1e9:.0f} TFLOP/s) plain {tp:.3f} ms ({fl / tp / 1e9:.0f}) [{time.time() - t:.0f}s]")
        except Exception as e:
            traceback.print_exc()
            rec["configs"][cs] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            note(f"{name} {cs}: ERROR {type(e).__name__}: {str(e)[:200]}")
    # ---- torch / cuDNN
    xn = x.permute(0, 3, 1, 2).contiguous()                  # NCHW
    xc = x.permute(0, 3, 1, 2)                               # channels_last view
    wn = w.contiguous()
    wc = w.contiguous(memory_format=torch.channels_last)
    rn = None if r is None else r.permute(0, 3, 1, 2).contiguous()
    pad = ksz // 2
    if up:
        xun = F.interpolate(xn, scale_factor=2.0, mode="nearest")
        xuc = F.interpolate(xc, scale_factor=2.0, mode="nearest").contiguous(memory_format=torch.channels_last)
    else:
        xun, xuc = xn, xc
    tt = {}
    for bm in (False, True):
        if SIM and bm:
            continue
        torch.backends.cudnn.benchmark = bm
        tag = "_bench" if bm else ""
        tt["cudnn_nchw" + tag] = device_ms(lambda: F.conv2d(xun, wn, b, padding=pad))
        tt["cudnn_nhwc" + tag] = device_ms(lambda: F.conv2d(xuc, wc, b, padding=pad))
    torch.backends.cudnn.benchmark = False

    def stock_chain():   # what stock ComfyUI runs for this op, NCHW, bf16
        h = xn
        if norm is not None:
            h = F.group_norm(h, G, norm[1], norm[2], 1e-6)
            if norm[3]:
                h = F.silu(h)
        if up:
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        y = F.conv2d(h, wn, b, padding=pad)
        return y + rn if rn is not None else y
    tt["stock_chain_nchw"] = device_ms(stock_chain)
    tt["torch_ref_nhwc"] = device_ms(lambda: C3.reference(x, wp, b, r, norm, bool(up)))
    if norm is not None:
        tt["gn_stats_nhwc"] = device_ms(lambda: GS.groupnorm_stats_nhwc_numba(x, G))
    rec["torch"] = tt
    for k in ("cudnn_nchw", "cudnn_nhwc", "cudnn_nhwc_bench"):
        if k in tt:
            rec[k + "_TFLOPs"] = fl / tt[k] / 1e9
    note(f"{name}: cuDNN NCHW {tt['cudnn_nchw']:.3f} / NHWC {tt['cudnn_nhwc']:.3f} ms"
         + (f" (benchmark {tt['cudnn_nchw_bench']:.3f} / {tt['cudnn_nhwc_bench']:.3f})" if not SIM else "")
         + f"; stock chain {tt['stock_chain_nchw']:.3f}; torch ref NHWC {tt['torch_ref_nhwc']:.3f}"
         + (f"; stats {tt['gn_stats_nhwc']:.3f}" if "gn_stats_nhwc" in tt else ""))
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=None, help=f"comma-separated (default GPU: {DEFAULT_CONFIGS})")
    ap.add_argument("--shapes", default="", help="regex of shape names (conv3x3.DECODER_SHAPES)")
    ap.add_argument("--budget", type=float, default=540, help="seconds; later shapes are skipped past it")
    ap.add_argument("--sim", action="store_true", help="CPU dry run in Numba's CUDA simulator, tiny shapes")
    args = ap.parse_args()
    configs = (args.configs or (C3.SIM_DEFAULT if SIM else DEFAULT_CONFIGS)).split(",")
    if not SIM:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(torch.__version__, torch.cuda.get_device_name(), "cuDNN", torch.backends.cudnn.version(), flush=True)
    results["configs"] = configs
    for s in shapes(args):
        if time.time() - T0 > args.budget:
            results["notes"].append(f"{s[0]}: skipped (budget {args.budget:.0f} s)")
            note(f"{s[0]}: skipped (time budget)")
            continue
        try:
            cfgs = configs
            if s[2] <= 16 and not SIM and args.configs is None:
                cfgs = [C3.GPU_NARROW, "8x16-16-32-w4x1-s3", "8x32-16-32-w8x1-s3"]
            results["shapes"][s[0]] = run_shape(s, cfgs, args)
        except Exception as e:
            traceback.print_exc()
            results["shapes"][s[0]] = {"error": f"{type(e).__name__}: {e}"}
            note(f"{s[0]}: ERROR {type(e).__name__}: {e}")
        if not SIM:
            torch.cuda.empty_cache()
    report()


def report():
    rows, best = [], {}
    tot = {"ours": 0.0, "stock": 0.0, "nhwc": 0.0, "nchw": 0.0, "floor": 0.0}
    for name, rec in results["shapes"].items():
        if "error" in rec or "torch" not in rec:
            rows.append((name, "ERROR", rec.get("error", "")[:40]) + ("",) * 9)
            continue
        okc = {c: v for c, v in rec["configs"].items() if v.get("ok")}
        tt = rec["torch"]
        if okc:
            c = min(okc, key=lambda k: okc[k]["fused_ms"])
            v = okc[c]
            best[(rec["Cin"], rec["Cout"], rec["H_out"], rec["H_out"], rec["ksz"], int(rec["upsample2x"]))] = c
            ours = v["fused_ms"] + tt.get("gn_stats_nhwc", 0.0)
            check, tf, tpl, pct = "OK", f"{v['fused_ms']:.3f}", f"{v['plain_ms']:.3f}", f"{v['pct_peak_plain']:.0f}%"
        else:
            c, ours, check, tf, tpl, pct = "-", float("nan"), "FAIL", "", "", ""
        nhwc = min(tt["cudnn_nhwc"], tt.get("cudnn_nhwc_bench", tt["cudnn_nhwc"]))
        nchw = min(tt["cudnn_nchw"], tt.get("cudnn_nchw_bench", tt["cudnn_nchw"]))
        n = rec["count"]
        tot["ours"] += n * ours
        tot["stock"] += n * tt["stock_chain_nchw"]
        tot["nhwc"] += n * nhwc
        tot["nchw"] += n * nchw
        tot["floor"] += n * max(rec["floor_flop_ms"], rec["floor_byte_ms"])
        rows.append((name, check, f"{rec['GFLOP']:.0f}", f"{max(rec['floor_flop_ms'], rec['floor_byte_ms']):.3f}",
                     tf, tpl, pct, f"{tt.get('gn_stats_nhwc', 0):.3f}", f"{nchw:.3f}", f"{nhwc:.3f}",
                     f"{tt['stock_chain_nchw']:.3f}", c))
    results["best_configs"] = {repr(k): v for k, v in best.items()}
    results["decoder_total_ms"] = tot
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_conv.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    hdr = ("shape", "check", "GFLOP", "floor ms", "ours fused", "ours plain", "plain %765", "stats ms",
           "cuDNN NCHW", "cuDNN NHWC", "stock chain", "best config")
    w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
    print(f"\n=== NHWC conv vs cuDNN ({'SIMULATOR: timings meaningless' if SIM else torch.cuda.get_device_name()}), "
          f"{time.time() - T0:.0f}s ===")
    print("ms = device time per call; ours fused = the op as the NHWC decoder calls it (prologue / residual /"
          " upsample), plain = the same conv alone; cuDNN = best of benchmark off/on; stock chain = NCHW "
          "group_norm+silu(+interp)+conv(+add); floor = max(FLOPs at 765 TFLOP/s, bytes at 3.7 TB/s)")
    for r in [hdr] + rows:
        print("  ".join(str(v).ljust(w[i]) for i, v in enumerate(r)))
    print(f"decoder convs x counts: ours (fused + stats) {tot['ours']:.2f} ms | stock NCHW chain {tot['stock']:.2f} | "
          f"cuDNN alone NHWC {tot['nhwc']:.2f} / NCHW {tot['nchw']:.2f} | floor {tot['floor']:.2f}")
    print("conv3x3.CONFIGS = {" + ", ".join(f"{k}: {v!r}" for k, v in best.items()) + "}")


if __name__ == "__main__":
    main()
