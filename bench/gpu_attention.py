"""GPU check + timing of the attention op's numba backends (run on the H200 from the repo root).

    FLUX_NUMBA_REAL_GPU=1 python bench/gpu_attention.py            # all checks + timings
    FLUX_ATTN_8BIT_VARIANTS= python bench/gpu_attention.py          # bf16 kernels only (< 2 min)
    FLUX_ATTN_QUICK=1 ...                                          # only the FLUX shape
    FLUX_ATTN_VARIANTS=4w,8w,wg,wgr,wg2 FLUX_ATTN_8BIT_VARIANTS=mma,wg,wgr ...   # kernels to compare
    FLUX_ATTN_CHECK_ALL=1 ...                                      # check every case with every variant
    FLUX_ATTN_BUDGET=200 ...                                       # seconds before the remaining steps are skipped (100)
    FLUX_ATTN_FULL=w32,w32x8,wgpp,wgpp64 ...     # variants checked on every case (others: FLUX shape only)
Default bf16 variants: auto (the op's default: wgpp128x2s3b on Hopper at head dim 128, else 4w) and 4w
(mma.sync, 16 rows/warp); opt-in: the 32-rows-per-warp family w32 (4 warps, 128-row blocks),
w32x8 (8 warps), w32n16 (16-key tiles, no spills), w32x2 (2 warps), w32e
(w32 rescaling O on every tile), w32n32.  Hopper wgmma variants (FLUX_ATTN_WG_VARIANTS, default
empty; e.g. wgpp,wgpp64,wgppr,wgppx2, wgp, wgpr, wgpx2, wgp2, wg, wgr, wg2) run in a child process after the
FLUX-shape step, so that a faulting kernel cannot poison the CUDA context of the main measurement
(its rows are merged into the table; FLUX_ATTN_WG_VARIANTS= skips it).  The FLUX shape is
also timed as device time (10 launches inside one CUDA graph, replayed: no Python launch cost).
Variants outside FULL are checked and timed at the FLUX shape only (each extra (variant, head dim,
mask) costs a JIT compile of a few seconds).

Checks (fresh random inputs, poisoned outputs, NaN check): relative Frobenius error vs an fp32
SDPA (math backend, TF32 off) next to bf16 SDPA's own error, at [1,24,4608,128] (FLUX 1024^2),
[2,24,1000,128] with bool / additive masks, [1,1,16384,64] and ragged [1,2,16381,64], extreme
logits, an ``out`` view inside a wider buffer (the single block's linear2 input).
Timing: CUDA events, median of 25 after warm-up, SDPA (cuDNN / default choice) vs ours;
TFLOP/s = 4*B*H*L^2*D / t.  Bars: bf16 >= 400 TFLOP/s with err <= 1.1x SDPA's; 8-bit <= 0.33 ms
with err <= 2%.  Never stops at the first failure; prints the table last; JSON to $OUT if set.
"""
import json
import os
import sys
import time
import traceback

DRY = os.environ.get("FLUX_ATTN_DRYRUN") == "1"  # CPU simulator smoke test of this script's flow
if DRY:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
else:
    os.environ.setdefault("FLUX_NUMBA_REAL_GPU", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _pack  # noqa: E402

_pack.load()
from flux_numba_pack.cuda_kernels import registry  # noqa: E402
from flux_numba_pack.cuda_kernels import attention as A  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
import _attn_common as AC  # noqa: E402
from _attn_common import T0, note, rel, results, time_ms, graph_ms  # noqa: E402,F401

AC.init(DRY)
DEV = "cpu" if DRY else "cuda"
rows = []      # table rows


def ref32(q, k, v, mask=None):
    return AC.ref32(q, k, v, A.normalize_mask(mask))


def sdpa16(q, k, v, mask=None):
    return A.reference(q, k, v, mask)


def call(backend, q, k, v, mask=None, out=None):
    registry.strict = True
    try:
        with registry.force(backend, ops=["attention"]):
            return registry.call("attention", q, k, v, mask, out=out)
    finally:
        registry.strict = False


def make(B, H, L, D, qk_scale=1.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = (torch.randn(B, H, L, D, device=DEV, generator=g) * qk_scale).to(torch.bfloat16)
    k = (torch.randn(B, H, L, D, device=DEV, generator=g) * qk_scale).to(torch.bfloat16)
    v = torch.randn(B, H, L, D, device=DEV, generator=g).to(torch.bfloat16)
    return q, k, v


BACKENDS = [b for b in ("numba", "numba-8bit") if b in registry.backends("attention")]
# backend labels; "numba@8w" = the numba backend with the 8-warp (128 x 64) tiling variant.
# FLUX_ATTN_VARIANTS (default "4w,8w"): bf16 tilings to compare ("wg" / "wg2" = Hopper wgmma kernel
# with 1 / 2 warpgroups per block); FLUX_ATTN_8BIT_VARIANTS (default "auto,mma"): 8-bit kernels.
VARS = [x for x in os.environ.get("FLUX_ATTN_VARIANTS", "auto,4w").split(",") if x]
FULL = [x for x in os.environ.get("FLUX_ATTN_FULL", "w32,w32x8,wgpp,wgpp64").split(",") if x]
# Hopper wgmma variants run in a child process (a faulting kernel poisons its CUDA context only),
# after the FLUX-shape check + timing of the variants above; FLUX_ATTN_WG_VARIANTS= skips them.
WGVARS = [x for x in os.environ.get("FLUX_ATTN_WG_VARIANTS", "").split(",") if x]
CHILD = os.environ.get("FLUX_ATTN_CHILD") == "1"
if CHILD:
    VARS, BACKENDS = WGVARS, ["numba"]
VARS8 = [x for x in os.environ.get("FLUX_ATTN_8BIT_VARIANTS", "auto,mma").split(",") if x]
CHECK_ALL = os.environ.get("FLUX_ATTN_CHECK_ALL") == "1"   # check every case with every variant
LABELS = [("numba" if v == "auto" else f"numba@{v}", "numba", v) for v in VARS] if "numba" in BACKENDS else []
LABELS += [("numba-8bit" if v == "auto" else f"numba-8bit@{v}", "numba-8bit", "8:" + v)
           for v in VARS8 if "numba-8bit" in BACKENDS]


def variant(v):
    try:
        if v.startswith("8:"):
            A.set_variant8(v[2:])
        else:
            A.set_variant(v)
            if v in ("4w", "auto") and hasattr(A, "set_variant8"):
                A.set_variant8("auto")
    except Exception as ex:  # older attention.py without variants
        print("set_variant failed:", ex)


def _dry(B, H, L, D, mask=None):
    if not DRY:
        return B, H, L, D, mask
    L2 = min(L, 40)
    if mask is not None:
        mask = mask[..., :L2, :L2].cpu()
        if mask.ndim >= 3:
            mask = mask[:1]
    return 1, 1, L2, 32 if D >= 32 else D, mask


def check_case(name, B, H, L, D, mask=None, qk_scale=1.0, seed=0, out_view=False):
    B, H, L, D, mask = _dry(B, H, L, D, mask)
    q, k, v = make(B, H, L, D, qk_scale, seed)
    r32 = ref32(q, k, v, mask)
    e16 = rel(sdpa16(q, k, v, mask), r32)
    for label, be, var in LABELS:
        if var not in ("auto", "4w", "8:auto", "8:mma") and var not in FULL and not CHECK_ALL and not name.startswith("[1,24,4608"):
            continue
        variant(var)
        try:
            if out_view:
                buf = torch.full((B, L, H * D + 256), float("nan"), dtype=q.dtype, device=DEV)
                o = call(be, q, k, v, mask, out=buf[..., :H * D])
                outside_ok = bool(torch.isnan(buf[..., H * D:]).all())
            else:
                out = torch.full((B, L, H * D), float("nan"), dtype=q.dtype, device=DEV)
                o = call(be, q, k, v, mask, out=out)
                outside_ok = True
            torch.cuda.synchronize()
            nan = bool(torch.isnan(o).any())
            e = rel(o, r32)
            bar = 1.1 * e16 if be == "numba" else 0.02
            ok = (not nan) and outside_ok and e <= bar
            note(f"check {name} {label}", err=f"{e:.4%}", sdpa_bf16_err=f"{e16:.4%}", nan=nan,
                 outside_view_untouched=outside_ok, ok=ok)
            rows.append((f"check {name}", label, f"err {e:.3%} (sdpa {e16:.3%})", "PASS" if ok else "FAIL"))
        except Exception as ex:
            traceback.print_exc()
            note(f"check {name} {label}", error=f"{type(ex).__name__}: {ex}")
            rows.append((f"check {name}", label, f"{type(ex).__name__}", "FAIL"))
        finally:
            variant("auto")
    del q, k, v, r32
    torch.cuda.empty_cache()


def kernel_info(D):
    """Registers / local memory per thread of the current variant's compiled no-mask kernel."""
    try:
        k = A._kernel(D, False, A._warps(D, torch.device(DEV)))
        r, lm = k.get_regs_per_thread(), k.get_local_mem_per_thread()
        one = lambda x: list(x.values())[0] if isinstance(x, dict) and len(x) == 1 else x  # noqa: E731
        return {"regs": str(one(r)), "local_bytes": str(one(lm))}
    except Exception as ex:
        return {"info": type(ex).__name__}


def bench_case(name, B, H, L, D):
    B, H, L, D, _ = _dry(B, H, L, D)
    q, k, v = make(B, H, L, D, seed=1)
    flops = 4.0 * B * H * L * L * D
    GRAPH = not DRY and name.startswith("[1,24,4608")
    try:
        if CHILD:   # the parent process times SDPA
            raise StopIteration
        t = time_ms(lambda: F.scaled_dot_product_attention(q, k, v))
        note(f"time {name} sdpa", ms=round(t, 4), tflops=round(flops / t / 1e9, 1))
        rows.append((f"time {name}", "sdpa (kernel only)", f"{t:.4f} ms", f"{flops / t / 1e9:.0f} TFLOP/s"))
        out = torch.empty(B, L, H * D, dtype=q.dtype, device=DEV)
        t = time_ms(lambda: A.reference(q, k, v, out=out))
        rows.append((f"time {name}", "torch op (sdpa+copy)", f"{t:.4f} ms", f"{flops / t / 1e9:.0f} TFLOP/s"))
        if GRAPH:
            t = graph_ms(lambda: F.scaled_dot_product_attention(q, k, v))
            note(f"time {name} sdpa (CUDA graph)", ms=round(t, 4), tflops=round(flops / t / 1e9, 1))
            rows.append((f"time {name}", "  sdpa device time (graph)", f"{t:.4f} ms", f"{flops / t / 1e9:.0f} TFLOP/s"))
    except StopIteration:
        pass
    except Exception as ex:
        traceback.print_exc()
        rows.append((f"time {name}", "sdpa", type(ex).__name__, "ERR"))
    for label, be, var in LABELS:
        if be == "numba" and var not in ("auto", "4w") and var not in FULL and not CHECK_ALL and not GRAPH:
            continue
        variant(var)
        try:
            out = torch.empty(B, L, H * D, dtype=q.dtype, device=DEV)
            t = time_ms(lambda: call(be, q, k, v, None, out=out))
            tf = flops / t / 1e9
            ok = tf >= 400 if be == "numba" else t <= 0.33
            note(f"time {name} {label}", ms=round(t, 4), tflops=round(tf, 1), meets_bar=ok)
            rows.append((f"time {name}", label, f"{t:.4f} ms", f"{tf:.0f} TFLOP/s" + ("" if ok else " (below bar)")))
            if GRAPH and be == "numba":
                tg = graph_ms(lambda: call(be, q, k, v, None, out=out))
                note(f"time {name} {label} (CUDA graph)", ms=round(tg, 4), tflops=round(flops / tg / 1e9, 1),
                     **kernel_info(D))
                rows.append((f"time {name}", f"  {label} device time (graph)", f"{tg:.4f} ms",
                             f"{flops / tg / 1e9:.0f} TFLOP/s"))
            if be == "numba-8bit" and var == "8:mma":  # split: quantization pre-pass (numba) vs torch
                tq = time_ms(lambda: A.quantize_8bit_numba(q, k, v))
                rows.append((f"time {name}", "  of which numba quant pre-pass", f"{tq:.4f} ms", ""))
                tq = time_ms(lambda: A.quantize_8bit(q, k, v))
                rows.append((f"time {name}", "  (torch quant pre-pass, unused)", f"{tq:.4f} ms", ""))
                if not DRY:  # device time only: replay CUDA graphs (no Python launch overhead)
                    for what, fn in (("pre-pass", lambda: A.quantize_8bit_numba(q, k, v)),
                                     ("8-bit total", lambda: call(be, q, k, v, None, out=out))):
                        try:
                            gr = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(gr):
                                fn()
                            tg = time_ms(gr.replay)
                            note(f"time {name} {what} (CUDA graph)", ms=round(tg, 4))
                            rows.append((f"time {name}", f"  {what} in a CUDA graph", f"{tg:.4f} ms", ""))
                            del gr
                        except Exception as ex:
                            rows.append((f"time {name}", f"  {what} in a CUDA graph", type(ex).__name__, "ERR"))
        except Exception as ex:
            traceback.print_exc()
            rows.append((f"time {name}", label, type(ex).__name__, "ERR"))
        finally:
            variant("auto")
    del q, k, v
    torch.cuda.empty_cache()


def run_child():
    """The wgmma variants in a fresh process; its table rows are merged into ours."""
    import subprocess
    budget = max(25.0, 95.0 - (time.time() - T0))
    env = dict(os.environ, FLUX_ATTN_CHILD="1", FLUX_ATTN_CHILD_BUDGET=str(budget))
    env.pop("OUT", None)
    t = time.time()
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True,
                           text=True, timeout=budget + 10)
        out, rc, err = r.stdout, r.returncode, r.stderr
    except subprocess.TimeoutExpired as ex:
        dec = lambda x: (x or b"").decode(errors="replace") if isinstance(x, bytes) else (x or "")  # noqa: E731
        out, rc, err = dec(ex.stdout), "timeout", dec(ex.stderr)
    print("\n".join(ln for ln in out.splitlines() if not ln.startswith("CHILD_JSON "))[-6000:]
          + err[-3000:], flush=True)
    got = [ln for ln in out.splitlines() if ln.startswith("CHILD_JSON ")]
    if got:
        data = json.loads(got[-1][len("CHILD_JSON "):])
        rows.extend(tuple(r) for r in data["rows"])
        results.update({"wgmma child: " + k: v for k, v in data["results"].items()})
    if rc != 0 or not got:
        rows.append(("wgmma child process", ",".join(WGVARS), f"rc={rc} after {time.time() - t:.0f}s", "ERR"))


def main():
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__, "backends", BACKENDS, flush=True)
    quick = os.environ.get("FLUX_ATTN_QUICK") == "1"
    steps = [lambda: check_case("[1,24,4608,128]", 1, 24, 4608, 128, seed=2),
             lambda: bench_case("[1,24,4608,128]", 1, 24, 4608, 128)]
    if CHILD:
        budget = float(os.environ.get("FLUX_ATTN_CHILD_BUDGET", "60"))
        g = torch.Generator(device=DEV).manual_seed(4)
        bmask = torch.rand(2, 1000, 1000, device=DEV, generator=g) > 0.2
        bmask[..., 0] = True
        steps += [lambda: check_case("[2,24,1000,128] bool mask [B,L,L]", 2, 24, 1000, 128, mask=bmask, seed=3),
                  lambda: check_case("[1,24,333,128] extreme logits (x12)", 1, 24, 333, 128, qk_scale=12.0, seed=9)]
        for st in steps:
            if time.time() - T0 > budget:
                rows.append(("(child skipped)", "", "time budget", ""))
                break
            try:
                st()
            except Exception as ex:
                traceback.print_exc()
                rows.append(("child step", "", f"{type(ex).__name__}: {ex}"[:60], "ERR"))
            # after every step: a parent that times us out still gets the rows so far
            print("CHILD_JSON " + json.dumps({"rows": rows, "results": results}, default=str), flush=True)
        return
    if not quick:
        def bool_mask():
            g = torch.Generator(device=DEV).manual_seed(4)
            m = torch.rand(2, 1000, 1000, device=DEV, generator=g) > 0.2
            m[..., 0] = True
            return m

        def add_mask():
            g = torch.Generator(device=DEV).manual_seed(5)
            m = torch.randn(1000, 1000, device=DEV, generator=g).to(torch.bfloat16)
            m[:, 700:] = -torch.finfo(torch.bfloat16).max
            return m
        steps += [
            lambda: check_case("[2,24,1000,128] bool mask [B,L,L]", 2, 24, 1000, 128, mask=bool_mask(), seed=3)]
    if WGVARS:   # after the FLUX shape and the ragged + masked case of the variants above
        steps.append(run_child)
    if not quick:
        steps += [
            lambda: check_case("[2,24,1000,128] additive mask [L,L]", 2, 24, 1000, 128, mask=add_mask(), seed=6),
            lambda: check_case("[1,1,16384,64]", 1, 1, 16384, 64, seed=7),
            lambda: check_case("[1,2,16381,64] ragged", 1, 2, 16381, 64, seed=8),
            lambda: check_case("[1,24,333,128] extreme logits (x12)", 1, 24, 333, 128, qk_scale=12.0, seed=9),
            lambda: check_case("[1,24,4352,128] out view", 1, 24, 4352, 128, seed=10, out_view=True),
        ]
    if not quick:
        steps += [lambda: bench_case("[1,24,4352,128] (512 txt + 3840)", 1, 24, 4352, 128),
                  lambda: bench_case("[1,1,16384,64]", 1, 1, 16384, 64)]
    for st in steps:
        if time.time() - T0 > float(os.environ.get("FLUX_ATTN_BUDGET", "100")) and not DRY:
            print("time budget reached, skipping the rest", flush=True)
            rows.append(("(skipped)", "", "time budget", ""))
            break
        try:
            st()
        except Exception as ex:
            traceback.print_exc()
            rows.append(("step", "", f"{type(ex).__name__}: {ex}"[:60], "ERR"))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_attention.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n=== attention ({time.time() - T0:.0f}s) ===")
    w = [max(len(str(r[i])) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))


if __name__ == "__main__":
    main()
