"""Where does the wgmma attention kernel's time go?  Ablations of ``_make_kernel_wgpp`` on the H200.

    FLUX_NUMBA_REAL_GPU=1 python bench/gpu_attn_ablate.py
    FLUX_ABL_CONFIGS=64x1s3,64x2s5,64x2s5f FLUX_ABL_FLAGS=0,1,2,3,4,7,15 python bench/gpu_attn_ablate.py
    FLUX_ABL_CONFIGS= FLUX_ABL_8BIT=mma,wgb python bench/gpu_attn_ablate.py    # the 8-bit op per kernel

A config "BNxNWGsS[f]" is the kernel's key-tile width, warpgroups per block (64 query rows each),
ring stages and (f) unchecked full-tile loads (FL) or (b) K / V re-laid out by tile_kv (timed on its
own row) and moved by bulk copies (BULK), or (w) the same fed by a producer warp (WS), or (e) with
stage releases on mbarriers instead of a block barrier (REL).
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
        m = re.fullmatch(r"(\d+)x(\d)s(\d)([fbwe]?)", cfg)
        bn, nwg, stages = int(m.group(1)), int(m.group(2)), int(m.group(3))
        fl, bulk, ws, rel = m.group(4) == "f", m.group(4) in ("b", "w", "e"), m.group(4) == "w", m.group(4) == "e"
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
                kern = A._make_kernel_wgpp(D, False, None, nwg, bn, flag, stages, fl, bulk, ws, rel)
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
