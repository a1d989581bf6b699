"""Where does the wgmma attention kernel's time go?  Ablations of ``_make_kernel_wgpp`` on the H200.

    FLUX_NUMBA_REAL_GPU=1 python bench/gpu_attn_ablate.py
    FLUX_ABL_CONFIGS=64x1s3,64x2s5,64x2s5f FLUX_ABL_FLAGS=0,1,2,3,4,7,15 python bench/gpu_attn_ablate.py
    FLUX_ABL_CONFIGS= FLUX_ABL_8BIT=mma,wgb python bench/gpu_attn_ablate.py    # the 8-bit op per kernel
    FLUX_ABL_CONFIGS= FLUX_ABL_8K=00,11 FLUX_ABL_8FLAGS=0,1,2 python bench/gpu_attn_ablate.py   # wgb kernel alone

FLUX_ABL_8PT=auto,mma: the 8-bit op fed by a qk_norm_rope-style Quant8 pack (per-token scales, the
FLUX blocks' path: no pre-pass; wgb family = PTOK), per kernel variant.
FLUX_ABL_8K: the 8-bit wgb kernel alone (inputs quantized and re-laid out once, outside the
timing), per "PF[S]" = ping-pong warpgroups (P=1: _make_kernel8_wgb PP), the int32-direct
softmax (F=1: FS) and optionally the ring's stages S (3); FLUX_ABL_8FLAGS: its ABL bits
(1 = no K/V copies, 2 = no softmax).

A config "BNxNWGsS[f]" is the kernel's key-tile width, warpgroups per block (64 query rows each),
ring stages and (f) unchecked full-tile loads (FL) or (b) K / V re-laid out by tile_kv (timed on its
own row) and moved by bulk copies (BULK), or (w) the same fed by a producer warp (WS), or (e) with
stage releases on mbarriers instead of a block barrier (REL), or (p) REL with ping-pong warpgroups (PP).
Flags (the kernel's ABL bits; anything but 0 computes a wrong result on purpose, only its time
counts): 1 = no K/V loads in the loop, 2 = no softmax (P = S), 4 = no P V wgmma, 8 = no barrier in
the loop, 16 = no proxy fence in the loop (a race).  Each kernel is timed at the FLUX shape [1, 24, 4608, 128] as device time (10 launches in
one CUDA graph, median replay / 10), cuDNN SDPA timed the same way in the same process; flag 0 is
also checked against an fp32 reference.  Prints a table last; JSON to $OUT if set.
"""
import json
import os
import re
import sys
import traceback

os.environ.setdefault("FLUX_NUMBA_REAL_GPU", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402

import _pack  # noqa: E402

_pack.load()
from flux_numba_pack.cuda_kernels import attention as A  # noqa: E402
import _attn_common as AC  # noqa: E402

AC.init(False)
B, H, L, D = 1, 24, 4608, 128
FLOP = 4 * B * H * L * L * D
NAMES = {1: "noload", 2: "nosoftmax", 4: "noPV", 8: "nobarrier", 16: "nofence"}


def main():
    configs = [c for c in os.environ.get("FLUX_ABL_CONFIGS", "32x1s3,64x1s3,64x2s3,128x2s3").split(",") if c]
    flags = [int(f) for f in os.environ.get("FLUX_ABL_FLAGS", "0,1,2,3,4,6,7,15").split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = [torch.randn(B, H, L, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
    ref = AC.ref32(q, k, v)
    sd = A.reference(q, k, v)
    t_sdpa = AC.graph_ms(lambda: A.reference(q, k, v))
    rows = [("cuDNN SDPA", "-", t_sdpa, AC.rel(sd, ref))]
    marr = A._f32_1d(torch.zeros(1, dtype=torch.float32, device="cuda"))
    dst = torch.empty(B, L, H * D, dtype=torch.bfloat16, device="cuda")
    for cfg in configs:
        m = re.fullmatch(r"(\d+)x(\d)s(\d)([fbwep]?)", cfg)
        bn, nwg, stages = int(m.group(1)), int(m.group(2)), int(m.group(3))
        fl, bulk, ws, rel = m.group(4) == "f", m.group(4) in ("b", "w", "e", "p"), m.group(4) == "w", m.group(4) == "e"
        pp = m.group(4) == "p"
        kk, vv = k, v
        if bulk:
            kk, vv = A.tile_kv(k, v, bn)
            assert torch.equal(kk, A.tile_kv_reference(k, bn)) and torch.equal(vv, A.tile_kv_reference(v, bn))
            t = AC.graph_ms(lambda: A.tile_kv(k, v, bn))
            t2 = AC.graph_ms(lambda: (A.tile_kv_reference(k, bn), A.tile_kv_reference(v, bn)))
            rows.append((f"tile_kv BN={bn}", "(relayout K+V, per call)", t, float("nan")))
            rows.append((f"tile_kv_reference BN={bn}", "(torch relayout)", t2, float("nan")))
            AC.note(f"tile_kv{bn}", ms=round(t, 4), torch_ms=round(t2, 4))
        for flag in flags:
            name = "+".join(NAMES[b] for b in NAMES if flag & b) or "full"
            try:
                kern = A._make_kernel_wgpp(D, False, None, nwg, bn, flag, stages, fl, bulk, ws, rel, pp)
                run = lambda: A._launch(kern, q, kk, vv, dst, marr, [0, 0, 0], 64 * nwg, kern.nth)  # noqa: E731
                dst.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                err = AC.rel(dst, ref) if flag in (0, 16) else float("nan")
                try:
                    regs = list(kern.get_regs_per_thread().values())
                except Exception as e:
                    regs = repr(e)
                print(f"{cfg}/{flag}: registers {regs}, threads {kern.nth}", flush=True)
                t = AC.graph_ms(run)
                rows.append((f"wgpp {cfg}", name, t, err))
                AC.note(f"{cfg}/{name}", ms=round(t, 4), tflops=round(FLOP / t / 1e9, 1), err=err)
            except Exception:
                traceback.print_exc()
                rows.append((f"wgpp {cfg}", name + " FAILED", float("nan"), float("nan")))
    k8cfg = [x for x in os.environ.get("FLUX_ABL_8K", "").split(",") if x]
    if k8cfg:
        q8, k8, qs, ks, Lp = [x.clone() if torch.is_tensor(x) else x for x in A.quantize_8bit_numba(q, k)]
        k8t = A.tile_kv(k8.view(torch.int16), None, 128)[0].clone()
        vt = A.tile_kv(v, None, 128)[0].clone()
        args = (A._arr(q8), A._words(k8t), A._words(vt), A._c_arr(qs), A._c_arr(ks), A._words(dst), marr,
                vt.stride(0) // 2, vt.stride(1) // 2, vt.stride(2) // 2, dst.stride(0) // 2, dst.stride(1) // 2,
                0, 0, 0, L, Lp, H, A._LOG2E / D ** 0.5)
        for cfg in k8cfg:
            for flag in [int(f) for f in os.environ.get("FLUX_ABL_8FLAGS", "0").split(",")]:
                name = "+".join(NAMES[b] for b in NAMES if flag & b) or "full"
                nst = int(cfg[2]) if len(cfg) > 2 else 3
                label = f"wgb8 PP={cfg[0]} FS={cfg[1]} S={nst}"
                try:
                    kern = A._make_kernel8_wgb(D, False, STAGES=nst, PP=cfg[0] == "1", FS=cfg[1] == "1", ABL=flag)
                    run = lambda: A._go(kern, ((L + kern.rows - 1) // kern.rows, B * H), kern.nth, args, q.device)  # noqa: E731
                    dst.fill_(float("nan"))
                    run()
                    torch.cuda.synchronize()
                    err = AC.rel(dst, ref) if flag == 0 else float("nan")
                    t = AC.graph_ms(run)
                    rows.append((label, name + " (kernel)", t, err))
                    AC.note(f"wgb8/{cfg}/{name}", ms=round(t, 4), err=err)
                except Exception:
                    traceback.print_exc()
                    rows.append((label, name + " FAILED", float("nan"), float("nan")))
    pts = [x for x in os.environ.get("FLUX_ABL_8PT", "").split(",") if x]
    if pts:
        from flux_numba_pack.cuda_kernels import qk_norm_rope as QK
        q8, k8, qs, ks, Lp, km = QK.quant8_reference(q, k)
        pk = QK.Quant8(q, k, q8, k8, qs.contiguous(), ks.contiguous(), km, Lp, {})
        for var in pts:
            A.set_variant8(var)
            try:
                def op():
                    with A.prequantized(pk):
                        return A.numba_attention_8bit(q, k, v)
                out = op()
                t = AC.graph_ms(op)
                rows.append((f"numba-8bit {var} fused", "(op: per-token pack)", t, AC.rel(out, ref)))
                AC.note(f"8pt/{var}", ms=round(t, 4), err=AC.rel(out, ref))
            except Exception:
                traceback.print_exc()
                rows.append((f"numba-8bit {var} fused", "FAILED", float("nan"), float("nan")))
            finally:
                A.set_variant8("auto")
    for var in [x for x in os.environ.get("FLUX_ABL_8BIT", "").split(",") if x]:
        # the numba-8bit op as a whole (pre-pass, relayouts, kernel), per 8-bit kernel variant
        A.set_variant8(var)
        try:
            out = A.numba_attention_8bit(q, k, v)
            t = AC.graph_ms(lambda: A.numba_attention_8bit(q, k, v))
            rows.append((f"numba-8bit {var}", "(op: pre-pass + kernel)", t, AC.rel(out, ref)))
        except Exception:
            traceback.print_exc()
            rows.append((f"numba-8bit {var}", "FAILED", float("nan"), float("nan")))
        finally:
            A.set_variant8("auto")
    print(f"\n{torch.cuda.get_device_name()}, [1,24,4608,128] bf16, device time (graph of 10, median of 20)")
    print(f"{'kernel':22s} {'ablation':30s} {'ms':>8s} {'TFLOP/s':>8s} {'rel err':>9s}")
    for r in rows:
        print(f"{r[0]:22s} {r[1]:30s} {r[2]:8.4f} {FLOP / r[2] / 1e9:8.1f} {r[3]:9.5f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_attn_ablate.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "notes": AC.results}, f, indent=1)


if __name__ == "__main__":
    main()
