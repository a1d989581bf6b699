"""GPU check + timing of the fast profile's fp8 pieces (issue #13), run from the repo root:

    python bench/ops/gpu_fp8.py             # H200 (sm_89+), ~2 min; JSON to $OUT/gpu_fp8.json if OUT is set
    python bench/ops/gpu_fp8.py --sim       # CPU dry run of the whole flow: Numba simulator, tiny shapes,
                                        # wall-clock timings (meaningless), GEMMs on CPU where torch can
    python bench/ops/gpu_fp8.py --ptx-only  # no GPU: compile every fp8 kernel variant for sm_90 and report
                                        # ptxas registers / spill bytes (needs NVVM + ptxas on the machine)

1. conversion: the device helpers (``cvt.rn.satfinite.e4m3x2.f32``) vs torch's cast on every e4m3
   value, every tie, +-1 fp32 ulp around both, > 448, random magnitudes;
2. quantising kernels at FLUX.1 1024^2 shapes (C 3072, MLP 12288, img 4096, txt 512, single 4608
   tokens; single-block inputs as row-strided views of a [1, 4608, 21504] linear1 output):
   correctness vs the torch reference (fp8 codes: max step difference and count of one-step
   differences; scales: max relative error; NaN = unwritten bytes, outputs poisoned), then device
   time (CUDA events around one call with the GPU kept busy by a sleep kernel, median of 25 after
   warm-up) of the fp8 kernel, its bf16-only sibling (the op the exact profile runs there), and
   the unfused alternative "bf16 sibling + torch amax / divide / cast"; bytes moved, floor and %
   of 3.7 TB/s; variants (launch bounds, pipelining) after the defaults;
3. GEMMs: ``torch._scaled_mm`` row-wise (A fp8 [M, K] + scale_a fp32 [M, 1], B = W^T fp8 with
   per-output-channel scale_b fp32 [1, N], bias bf16, out bf16; use_fast_accum off / on) vs
   F.linear bf16 (and, for mlp-up, the cuBLASLt GELU epilogue the exact profile may use), each
   FLUX GEMM shape, relative error vs fp32; summed per sampling step (19 double blocks: img + txt
   qkv / proj / mlp-up / mlp-down; 38 single blocks: linear1 / linear2);
4. per-step totals: GEMMs + quantising kernels, fp8 path vs bf16 path.
Per-case errors are caught and reported; the table is printed last.
"""
import json
import os
import sys
import time
import traceback

SIM = "--sim" in sys.argv
PTX_ONLY = "--ptx-only" in sys.argv
if SIM:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
elif not PTX_ONLY:
    os.environ["FLUX_NUMBA_REAL_GPU"] = "1"
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: timing.py
ROOT = os.path.dirname(BENCH)  # the repo root
sys.path[:0] = [ROOT, BENCH]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _pack  # noqa: E402

_pack.load()
import _rows_common as RC  # noqa: E402  (bench/ops/, beside this script)
import timing  # noqa: E402  (bench/timing.py)
from flux_numba_pack.cuda_kernels import registry  # noqa: E402
from flux_numba_pack.cuda_kernels import fp8_format as F8, fp8_rows as FR  # noqa: E402
from flux_numba_pack.cuda_kernels import ln_modulate as LM, gated_residual as GR  # noqa: E402
from flux_numba_pack.cuda_kernels.config import Fp8RowsConfig, RowsConfig  # noqa: E402

T0 = time.time()
CEIL = 3.7e12
DEV = "cpu" if SIM else "cuda"
BF = torch.bfloat16
if SIM:  # tiny shapes with the same structure (K multiples of 16, odd L)
    C, M, LI, LT, LS, REPS = 64, 256, 37, 5, 42, 1
else:
    C, M, LI, LT, LS, REPS = 3072, 12288, 4096, 512, 4608, 25
N_DOUBLE, N_SINGLE = 19, 38
EPS = 1e-6
results, rows, gemm_rows = {}, [], []


def note(name, **kw):
    results.setdefault(name, {}).update(kw)
    print(f"[{time.time() - T0:6.1f}s] {name}: " + ", ".join(f"{k}={v}" for k, v in kw.items()), flush=True)


if PTX_ONLY:
    from _fp8_ptx import ptx_report  # noqa: E402  (bench/ops/, beside this script)
    n_failed = ptx_report(note)
    if n_failed:
        print(f"gpu_fp8.py: error: {n_failed} of the kernels did not compile (see above)", file=sys.stderr)
    sys.exit(1 if n_failed else 0)

if SIM:  # wall-clock stand-ins for the CUDA timing calls
    from _attn_common import _Ev  # noqa: E402
    torch.cuda.Event = _Ev
    torch.cuda.synchronize = lambda *a: None
    torch.cuda._sleep = lambda n: None
    torch.cuda.get_device_name = lambda *a: "CPU (Numba simulator, dry run)"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


# ------------------------------------------------------------------------------------- helpers
Poison, run = RC.Poison, RC.run
rnd = RC.make_rnd(DEV)


def device_time_us(fn, reps=REPS, warm=3):
    """Median device time (us) of one call: events around it with ~1 ms of GPU sleep queued before,
    so the host's launch cost is hidden."""
    return timing.median_ms(fn, reps, warm if not SIM else 0, sleep_cycles=2_000_000) * 1e3


def ordinal(q):
    b = q.view(torch.uint8).int()
    return (b & 0x7F) * (1 - 2 * (b >> 7))


def compare_fp8(got, ref):
    """(max code step difference, codes one step off, max scale rel. error, NaN count)."""
    q, s = got
    qr, sr = ref
    nans = int(torch.isnan(q.float()).sum()) + int(torch.isnan(s).sum())
    d = (ordinal(q) - ordinal(qr)).abs()
    srel = ((s - sr).abs() / sr).max().item()
    return int(d.max()), int((d > 0).sum()), srel, nans


def torch_quant(y):
    """The unfused torch alternative: row amax, divide, cast (from the bf16 output)."""
    yf = y.reshape(-1, y.shape[-1]).float()
    s = yf.abs().amax(-1, keepdim=True).clamp_min(F8.AMAX_FLOOR) / F8.E4M3_MAX
    return (yf / s).clamp_(-F8.E4M3_MAX, F8.E4M3_MAX).to(F8.FP8), s


# ------------------------------------------------------------------------------ 1. conversion
def conversion_check():
    v = torch.arange(0, 256, dtype=torch.uint8).view(F8.FP8).float()
    v = torch.sort(v[~torch.isnan(v)].unique()).values
    mid = (v[1:] + v[:-1]) / 2
    up = lambda t, d: torch.nextafter(t, torch.full_like(t, d))  # noqa: E731
    rnd_ = torch.randn(200000 if not SIM else 300) * torch.exp2(torch.randint(-16, 9, (200000 if not SIM else 300,)).float())
    xs = torch.cat([v, mid, up(mid, 1e9), up(mid, -1e9), up(v, 1e9), up(v, -1e9),
                    torch.tensor([449., 464., 465., 479., 480., 1e6, 3e38, float("inf"), 1e-40, 2. ** -10, 3 * 2. ** -10]), rnd_])
    xs = torch.cat([xs, -xs])
    ref = xs.clamp(-448, 448).to(F8.FP8).view(torch.uint8)
    bad = {}
    for name, got in zip(("e4m3x8", "e4m3x4", "e4m3_1"), F8.convert_bytes(xs.to(DEV))):
        bad[name] = int((got.cpu() != ref).sum())
    ok = all(n == 0 for n in bad.values())
    note("conversion vs torch", ok=ok, values=xs.numel(), **{f"mismatch_{k}": n for k, n in bad.items()})
    rows.append(("e4m3 conversion vs torch (x8/x4/x1 helpers)", "OK" if ok else "FAIL",
                 "/".join(str(n) for n in bad.values()) + f" of {xs.numel()}"))


# ------------------------------------------------------------------------ 2. quantising kernels
def make_cases():
    mod = rnd(1, 1, 6 * C)
    sh, sc, g = mod[..., 0:C], mod[..., C:2 * C], mod[..., 2 * C:3 * C]
    cases = []

    for tag, L, n in (("img", LI, N_DOUBLE), ("txt", LT, N_DOUBLE), ("single", LS, N_SINGLE)):
        def mk(L=L):
            return (rnd(1, L, C, scale=2, offset=0.3), sh, sc, EPS), {}
        cases.append(dict(name=f"ln_modulate_fp8 {tag}", op="ln_modulate_fp8", make=mk, sib="ln_modulate",
                          sib_make=mk, bytes=3 * L * C + 4 * L, sib_bytes=4 * L * C, per_step=n,
                          chain=lambda a, k: torch_quant(run("ln_modulate", "numba", *a, **k))))
    for tag, L in (("img", LI), ("txt", LT)):
        def mk(L=L):
            return (rnd(1, L, C, scale=4), g, rnd(1, L, C), sh, sc, EPS), {}
        cases.append(dict(name=f"gated_res_ln_mod_fp8 {tag}", op="gated_residual_ln_modulate_fp8", make=mk, inplace=True,
                          sib="gated_residual_ln_modulate", sib_make=mk, bytes=7 * L * C + 4 * L, sib_bytes=8 * L * C,
                          per_step=N_DOUBLE,
                          chain=lambda a, k: torch_quant(run("gated_residual_ln_modulate", "numba", *a, **k))))
    for tag, L in (("img", LI), ("txt", LT)):
        def mk(L=L):
            return (rnd(1, L, M, scale=2),), {}
        cases.append(dict(name=f"gelu_tanh_fp8 {tag}", op="gelu_tanh_fp8", make=mk, sib="gelu_tanh", sib_make=mk,
                          bytes=3 * L * M + 4 * L, sib_bytes=4 * L * M, per_step=N_DOUBLE,
                          chain=lambda a, k: torch_quant(run("gelu_tanh", "numba", *a, **k))))

    def mk_single():
        lin1 = rnd(1, LS, 3 * C + M, scale=2)
        return (lin1[..., 2 * C:3 * C], lin1[..., 3 * C:]), {}

    def sib_single():  # the exact profile: GELU in place over linear1's mlp columns
        lin1 = rnd(1, LS, 3 * C + M, scale=2)
        return (lin1[..., 3 * C:],), {"out": lin1[..., 3 * C:]}

    def chain_single(a, k):
        run("gelu_tanh", "numba", a[1], out=a[1])
        return torch_quant(torch.cat((a[0], a[1]), -1))
    cases.append(dict(name="attn_gelu_fp8 single", op="attn_gelu_fp8", make=mk_single, sib="gelu_tanh", sib_make=sib_single,
                      bytes=3 * LS * (C + M) + 4 * LS, sib_bytes=4 * LS * M, per_step=N_SINGLE, chain=chain_single))
    for tag, L in (("img", LI), ("txt", LT)):
        def mk(L=L):
            attn = rnd(1, LT + LI, C)  # the attention output; img / txt rows are views of it
            return ((attn[:, LT:] if L == LI else attn[:, :LT]),), {}
        cases.append(dict(name=f"quantize_fp8 {tag}", op="quantize_fp8", make=mk, sib=None, bytes=3 * L * C + 4 * L,
                          sib_bytes=0, per_step=N_DOUBLE, chain=lambda a, k: torch_quant(a[0])))
    return cases


kernel_us = {}  # case name -> (fp8 us, sibling us, per_step)


def do_case(cs):
    name, op = cs["name"], cs["op"]
    args, kwargs = cs["make"]()
    inplace = cs.get("inplace", False)
    a_r = (args[0].clone(),) + tuple(args[1:]) if inplace else args
    ref = run(op, "torch", *a_r, **kwargs)
    a_n = (args[0].clone(),) + tuple(args[1:]) if inplace else args
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with Poison():
        got = run(op, "numba", *a_n, **kwargs)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    dmax, n1, srel, nans = compare_fp8(got, ref)
    res_exact = None
    if inplace:
        res_exact = int((a_n[0] != a_r[0]).sum())
    ok = nans == 0 and dmax <= 1 and srel <= 1e-6 and n1 <= max(2, 1e-3 * got[0].numel()) and not res_exact
    t_fp8 = device_time_us(lambda: run(op, "numba", *args, **kwargs))
    t_sib = t_chain = None
    if cs.get("sib"):
        sa, sk = cs["sib_make"]()
        t_sib = device_time_us(lambda: run(cs["sib"], "numba", *sa, **sk))
    try:
        t_chain = device_time_us(lambda: cs["chain"](args, kwargs))
    except Exception as e:
        note(name + " torch chain", error=f"{type(e).__name__}: {e}")
    floor = cs["bytes"] / CEIL * 1e6
    pct = 100 * floor / t_fp8
    kernel_us[name] = (t_fp8, t_sib or 0.0, cs["per_step"])
    note(name, ok=ok, max_code_step=dmax, codes_one_step_off=n1, of=got[0].numel(), scale_rel=f"{srel:.1e}", nans=nans,
         residual_mismatches=res_exact, first_call_ms=round(first_ms, 1), fp8_us=round(t_fp8, 1),
         floor_us=round(floor, 1), pct_of_3p7=round(pct, 1), MB=round(cs["bytes"] / 1e6, 1),
         bf16_sibling=cs.get("sib"), bf16_sibling_us=None if t_sib is None else round(t_sib, 1),
         bf16_sibling_MB=round(cs["sib_bytes"] / 1e6, 1),
         sibling_plus_torch_quant_us=None if t_chain is None else round(t_chain, 1), per_step=cs["per_step"])
    rows.append((name, "OK" if ok else "FAIL", f"{dmax}/{n1}", f"{srel:.0e}", f"{cs['bytes'] / 1e6:.1f}", f"{t_fp8:.1f}",
                 f"{floor:.1f}", f"{pct:.0f}%", "-" if t_sib is None else f"{t_sib:.1f}",
                 "-" if t_chain is None else f"{t_chain:.1f}", f"x{cs['per_step']}"))


class Variant:
    """A configuration other than the default: ``config`` (an Fp8RowsConfig or a RowsConfig, for
    the ops of ``cases``) is passed to their numba calls (``config=``; its launchers and occupancy
    answers are cached beside the default's)."""

    def __init__(self, name, cases, config):
        self.name, self.cases, self.config = name, cases, config


VARIANTS = [
    Variant("rows kernel launch_bounds (512, 1): no spill, 1 block/SM at 480 threads",
            ["gelu_tanh_fp8 img", "attn_gelu_fp8 single"], Fp8RowsConfig(lb16=(512, 1))),
    Variant("ln fp8: one row per block (no pipeline), vectors late", ["ln_modulate_fp8 img", "ln_modulate_fp8 single"],
            RowsConfig(pipe_blocks=0, pipe_blocks_gated=0)),
    Variant("ln fp8: one row per block, vectors with x", ["ln_modulate_fp8 img", "gated_res_ln_mod_fp8 img"],
            RowsConfig(pipe_blocks=0, pipe_blocks_gated=0, late=False, late_gated=False)),
    Variant("gated fp8: pipelined (occupancy-sized grid)", ["gated_res_ln_mod_fp8 img"],
            RowsConfig(pipe_blocks_gated=8)),
]


def variants():
    allc = {cs["name"]: cs for cs in make_cases()}
    for v in VARIANTS:
        for name in v.cases:
            try:
                cs = allc[name]
                args, kwargs = cs["make"]()
                inplace = cs.get("inplace", False)
                a_r = (args[0].clone(),) + tuple(args[1:]) if inplace else args
                ref = run(cs["op"], "torch", *a_r, **kwargs)
                a_n = (args[0].clone(),) + tuple(args[1:]) if inplace else args
                with Poison():
                    got = run(cs["op"], "numba", *a_n, config=v.config, **kwargs)
                dmax, n1, srel, nans = compare_fp8(got, ref)
                ok = nans == 0 and dmax <= 1 and srel <= 1e-6
                t = device_time_us(lambda: run(cs["op"], "numba", *args, config=v.config, **kwargs))
                floor = cs["bytes"] / CEIL * 1e6
                note(f"{name} [{v.name}]", ok=ok, fp8_us=round(t, 1), pct_of_3p7=round(100 * floor / t, 1))
                rows.append((f"  {name} [{v.name}]", "OK" if ok else "FAIL", f"{dmax}/{n1}", f"{srel:.0e}", "",
                             f"{t:.1f}", f"{floor:.1f}", f"{100 * floor / t:.0f}%", "", "", ""))
            except Exception as e:
                traceback.print_exc()
                note(f"{name} [{v.name}]", ok=False, error=f"{type(e).__name__}: {e}")
                rows.append((f"  {name} [{v.name}]", "ERROR", type(e).__name__, "", "", "", "", "", "", "", ""))


# ------------------------------------------------------------------------------------ 3. GEMMs
def gemm_shapes():
    d = [("qkv", C, 3 * C), ("proj", C, C), ("mlp up", C, M), ("mlp down", M, C)]
    out = []
    for stream, L in (("img", LI), ("txt", LT)):
        for n, K, N in d:
            out.append((f"double {stream} {n}", L, K, N, N_DOUBLE))
    out.append(("single linear1", LS, C, 3 * C + M, N_SINGLE))
    out.append(("single linear2", LS, C + M, C, N_SINGLE))
    return out


gemm_us = {}  # name -> dict(bf16=, fp8=, fp8_fast=, gelu_epi=, n=)


def do_gemm(name, Mr, K, N, n):
    x = rnd(Mr, K)
    w = rnd(N, K, scale=K ** -0.5)
    b = rnd(N, scale=0.1)
    ref = F.linear(x.float(), w.float(), b.float())
    qa, sa = run("quantize_fp8", "numba", x.view(1, Mr, K))
    qw, sw = F8.quantize_rows_reference(w.float())  # per output channel (the lead's weights cache)
    qwt, swt = qw.t(), sw.t().contiguous()          # B column-major [K, N], scale_b [1, N]
    ent = dict(n=n, M=Mr, K=K, N=N)
    t_bf = device_time_us(lambda: F.linear(x, w, b))
    e_bf = ((F.linear(x, w, b).float() - ref).norm() / ref.norm()).item()
    ent.update(bf16_us=t_bf, bf16_err=e_bf)
    for fast in (False, True):
        key = "fp8_fast" if fast else "fp8"
        try:
            def mm(fast=fast):
                return torch._scaled_mm(qa, qwt, scale_a=sa, scale_b=swt, bias=b, out_dtype=BF, use_fast_accum=fast)
            o = mm()
            ent[key + "_err"] = ((o.float() - ref).norm() / ref.norm()).item()
            ent[key + "_us"] = device_time_us(mm)
        except Exception as e:
            ent[key + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if "mlp up" in name:
        try:
            ent["bf16_gelu_epilogue_us"] = device_time_us(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))
        except Exception as e:
            ent["bf16_gelu_epilogue_error"] = f"{type(e).__name__}: {e}"
    gemm_us[name] = ent
    fl = 2 * Mr * K * N
    note("gemm " + name, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in ent.items()},
         bf16_TFLOPs=round(fl / t_bf / 1e6, 0), fp8_TFLOPs=round(fl / ent["fp8_us"] / 1e6, 0) if "fp8_us" in ent else None)
    f = lambda k: f"{ent[k]:.1f}" if k in ent else "ERR"  # noqa: E731
    gemm_rows.append((name, f"{Mr}x{K}->{N}", f"x{n}", f(
        "bf16_us"), f("fp8_us"), f("fp8_fast_us"), f("bf16_gelu_epilogue_us") if "mlp up" in name else "",
        f"{ent['bf16_err']:.1e}", f"{ent['fp8_err']:.1e}" if "fp8_err" in ent else "ERR",
        f"{ent['bf16_us'] / ent['fp8_us']:.2f}x" if "fp8_us" in ent else ""))


def per_step():
    """ms per sampling step: GEMMs bf16 vs fp8, quantising kernels fp8 path vs the bf16 path's ops."""
    def tot(key, fallback=None):
        s = 0.0
        for ent in gemm_us.values():
            v = ent.get(key, ent.get(fallback) if fallback else None)
            if v is None:
                return None
            s += ent["n"] * v
        return s / 1e3
    g_bf, g_fp8, g_fast = tot("bf16_us"), tot("fp8_us"), tot("fp8_fast_us")
    epi = sum(ent["n"] * (ent.get("bf16_gelu_epilogue_us", ent["bf16_us"]) - ent["bf16_us"])
              for ent in gemm_us.values()) / 1e3
    k_fp8 = sum(t * n for t, _, n in kernel_us.values()) / 1e3
    k_bf = sum(s * n for _, s, n in kernel_us.values()) / 1e3
    # with the GELU in the bf16 mlp-up epilogue, the double blocks' bf16 gelu_tanh kernel is gone
    gelu_bf = sum(s * n for name, (_, s, n) in kernel_us.items() if name.startswith("gelu_tanh_fp8")) / 1e3
    out = dict(gemm_bf16_ms=g_bf, gemm_fp8_ms=g_fp8, gemm_fp8_fast_accum_ms=g_fast,
               kernels_fp8_path_ms=k_fp8, kernels_bf16_path_ms=k_bf,
               bf16_with_gelu_epilogue_ms=None if g_bf is None else g_bf + epi + k_bf - gelu_bf)
    if g_bf is not None and g_fp8 is not None:
        out["bf16_path_ms"] = g_bf + k_bf
        out["fp8_path_ms"] = g_fp8 + k_fp8
        out["saved_ms"] = out["bf16_path_ms"] - out["fp8_path_ms"]
    note("per step", **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()})
    return out


# --------------------------------------------------------------------------------------- main
def main():
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, "
          f"{'dry run (simulator, tiny shapes)' if SIM else 'FLUX 1024^2 shapes'}", flush=True)
    if not SIM:
        cc = torch.cuda.get_device_capability()
        if cc < F8.MIN_CC:
            print(f"GPU is sm_{cc[0]}{cc[1]}: the fp8 kernels need sm_89+; nothing to measure")
            return
    torch.manual_seed(0)
    for fn in (conversion_check,):
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            note(fn.__name__, ok=False, error=f"{type(e).__name__}: {e}")
            rows.append((fn.__name__, "ERROR", type(e).__name__))
    for cs in make_cases():
        try:
            do_case(cs)
        except Exception as e:
            traceback.print_exc()
            note(cs["name"], ok=False, error=f"{type(e).__name__}: {e}")
            rows.append((cs["name"], "ERROR", type(e).__name__, str(e)[:60]))
    try:
        variants()
    except Exception as e:
        traceback.print_exc()
        note("variants", ok=False, error=f"{type(e).__name__}: {e}")
    for shp in gemm_shapes():
        try:
            do_gemm(*shp)
        except Exception as e:
            traceback.print_exc()
            note("gemm " + shp[0], ok=False, error=f"{type(e).__name__}: {e}")
            gemm_rows.append((shp[0], "ERROR", type(e).__name__, str(e)[:60]))
    note("ln fp8 pipelined grid", blocks_per_sm_and_occupancy_api={str(k): v for k, v in LM._occupancy.items()})
    step = {}
    try:
        step = per_step()
    except Exception as e:
        traceback.print_exc()
        note("per step", ok=False, error=f"{type(e).__name__}: {e}")
    out = os.environ.get("OUT")
    if out:
        try:
            with open(os.path.join(out, "gpu_fp8.json"), "w") as f:
                json.dump(results, f, indent=1, default=str)
        except Exception as e:
            print("JSON write failed:", e)

    def table(title, hdr, rs):
        print(title)
        rs = [tuple(r) + ("",) * (len(hdr) - len(r)) for r in rs]
        w = [max(len(str(r[i])) for r in rs + [hdr]) for i in range(len(hdr))]
        for r in [hdr] + rs:
            print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
    dev = torch.cuda.get_device_name()
    table(f"\n=== fp8 quantising kernels, {dev}, device us (median of {REPS}), total {time.time() - T0:.0f}s ===",
          ("case", "check", "code diff max/n", "scale rel", "MB", "fp8 us", "floor us", "of 3.7T", "bf16 sibling us",
           "sibling+torch quant us", "per step"), rows)
    table(f"\n=== GEMMs: torch._scaled_mm row-wise fp8 vs F.linear bf16, us ===",
          ("GEMM", "shape", "per step", "bf16", "fp8", "fp8 fast acc", "bf16+GELU epi", "err bf16", "err fp8", "speedup"),
          gemm_rows)
    if step:
        f = lambda k: "-" if step.get(k) is None else f"{step[k]:.2f}"  # noqa: E731
        print(f"\nper step (19 double + 38 single blocks), ms: GEMMs bf16 {f('gemm_bf16_ms')} | fp8 {f('gemm_fp8_ms')} "
              f"(fast accum {f('gemm_fp8_fast_accum_ms')}); quantising kernels fp8 path {f('kernels_fp8_path_ms')} vs "
              f"bf16 path's ops {f('kernels_bf16_path_ms')}; total bf16 {f('bf16_path_ms')} (with the GELU epilogue "
              f"{f('bf16_with_gelu_epilogue_ms')}) -> fp8 {f('fp8_path_ms')}: saved {f('saved_ms')}")


if __name__ == "__main__":
    main()
