"""GPU check + timing of the fused memory-bound ops' numba backends (run on the H200 from the repo root).

    FLUX_NUMBA_REAL_GPU=1 python bench/ops/gpu_fused.py
    python bench/ops/gpu_fused.py --ptx-only        # no GPU needed: compile each kernel for cc 9.0, read the PTX

Ops: ln_modulate, gated_residual, gated_residual_ln_modulate, qk_norm_rope, gelu_tanh at FLUX.1
1024^2 shapes (C=3072, 24 heads x 128, img L=4096, txt L=512, single-block L=4608 with qkv / mlp
as row-strided views of a [1, 4608, 21504] linear1 output, GELU written into a [1, 4608, 15360]
linear2-input buffer, pe random fp32 [1, 1, 4608, 64, 2, 2]).
  1. checks vs the torch reference on fresh random inputs (NaN-poisoned allocations: torch.empty
     returns NaN-filled tensors during the numba call; NaN count; relative L2 and max abs error;
     gated_residual must be bit-exact), the first (cold: JIT or disk-cache load) call timed;
  2. CUDA-graph capture + replay of two ops (launches go on torch's current stream);
  3. times torch reference vs numba: CUDA events around one call with the GPU kept busy by a
     sleep kernel so host overhead is hidden (device time), median of 25 after warm-up; host time
     per call (Python + launch) over 50 calls; GB/s vs the 3.7 TB/s copy ceiling;
  4. host-time breakdown (registry.call / backend fn / check / raw launcher call) and host time
     with numba's ordinary launcher (fast launch path off) for comparison;
  5. PTX of every kernel variant for cc 9.0: counts of 8-byte loads/stores, shuffles, local memory;
  6. prints the table LAST.  Never stops at the first failure.  JSON to $OUT/gpu_fused.json if set.
"""
import json
import os
import re
import sys
import time
import traceback

PTX_ONLY = "--ptx-only" in sys.argv
if not PTX_ONLY:
    os.environ["FLUX_NUMBA_REAL_GPU"] = "1"
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: timing.py
ROOT = os.path.dirname(BENCH)  # the repo root
sys.path[:0] = [ROOT, BENCH]

import torch  # noqa: E402

import _pack  # noqa: E402

_pack.load()
import _rows_common as RC  # noqa: E402  (bench/ops/, beside this script)
import timing  # noqa: E402  (bench/timing.py)
from flux_numba_pack.cuda_kernels import registry  # noqa: E402
from flux_numba_pack.cuda_kernels import launching  # noqa: E402
from flux_numba_pack.cuda_kernels import ln_modulate as LM, gated_residual as GR  # noqa: E402
from flux_numba_pack.cuda_kernels import gelu_tanh as GT, qk_norm_rope as QK  # noqa: E402
from flux_numba_pack.cuda_kernels.config import GELU, RowsConfig  # noqa: E402

T0 = time.time()
CEIL = 3.7e12
C, H, D, M = 3072, 24, 128, 12288
LI, LT, LS = 4096, 512, 4608
EPS = 1e-6
rows, results = [], {}


def note(name, **kw):
    results.setdefault(name, {}).update(kw)
    print(f"[{time.time() - T0:6.1f}s] {name}: " + ", ".join(f"{k}={v}" for k, v in kw.items()), flush=True)


# ------------------------------------------------------------------------------------ PTX check
def ptxas_regs(ptx):
    """Registers per thread from ptxas -v (None when ptxas is not on PATH)."""
    import shutil
    import subprocess
    import tempfile
    exe = shutil.which("ptxas")
    if not exe:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(re.sub(r"^\.version \d+\.\d+", ".version 8.0", ptx, count=1, flags=re.M))
    try:
        r = subprocess.run([exe, "-arch=sm_90", "-v", f.name, "-o", os.devnull], capture_output=True, text=True, timeout=60)
        m = re.findall(r"Used (\d+) registers", r.stderr)
        return int(m[0]) if m else None
    except Exception:
        return None
    finally:
        os.unlink(f.name)


def ptx_report():
    """Compile every kernel variant for cc (9, 0) and count the instructions that matter."""
    from numba import cuda, types as nt
    if PTX_ONLY:  # no GPU: device-function compilation asks for the current device's cc
        import types as _t
        import numba.cuda.dispatcher as _d
        _d.get_current_device = lambda: _t.SimpleNamespace(compute_capability=(9, 0))
    A = lambda dt, nd: nt.Array(dt, nd, "A")  # noqa: E731
    i64, i16 = nt.int64, nt.int16
    cases = {}
    for mod in (LM, GR, QK):
        for k, mk in mod.PTX_CASES.items():
            cases[k] = mk()
    for key, nw in GELU.nw_for().items():
        dt = i64 if key[0] == 4 else i16
        cases["gelu v%dw%d" % key] = (GT.make_gelu_kernel(key[0], nw, key[1]), (A(dt, 3),) * 2 + (i64,))
    pats = [("ld8B", r"\bld\.(global\.)?(u|b|s)64\b"), ("ld.v", r"\bld\.(global\.)?v[24]"),
            ("ld2B", r"\bld\.(global\.)?(u|b|s)16\b"), ("st8B", r"\bst\.(global\.)?(u|b|s)64\b"),
            ("shfl", r"\bshfl\."), ("local", r"\b(ld|st)\.local"), ("f64", r"\.f64\b"), ("ex2", r"ex2\.approx")]
    out = {}
    for name, (disp, sig) in cases.items():
        try:
            ptx, _ = cuda.compile_ptx(disp.py_func, sig, cc=(9, 0), fastmath=True,
                                      launch_bounds=disp.targetoptions.get("launch_bounds"))
            body = [ln for ln in ptx.splitlines() if not ln.strip().startswith("//")]
            cnt = {k: sum(1 for ln in body if re.search(p, ln)) for k, p in pats}
            cnt["regs"] = ptxas_regs(ptx)
            out[name] = cnt
            print(f"PTX {name:15s} " + ", ".join(f"{k} {v}" for k, v in cnt.items()), flush=True)
        except Exception as e:
            out[name] = f"FAILED {type(e).__name__}: {e}"
            print(f"PTX {name}: FAILED {type(e).__name__}: {str(e)[:800]}", flush=True)
    results["ptx"] = out
    return out


if PTX_ONLY:
    ptx_report()
    sys.exit(0)

DEV = "cuda"


# ------------------------------------------------------------------------------------- helpers
Poison, run = RC.Poison, RC.run
rnd = RC.make_rnd(DEV)


def flat(o):
    return list(o) if isinstance(o, (tuple, list)) else [o]


def compare(out, ref):
    errs, nans, mx = [], 0, 0.0
    for a, b in zip(flat(out), flat(ref)):
        nans += int(torch.isnan(a).sum())
        d = (a.float() - b.float())
        errs.append((d.norm() / b.float().norm().clamp_min(1e-30)).item())
        mx = max(mx, d.abs().nan_to_num(float("inf")).max().item())
    return max(errs), mx, nans


_copy_cache = {}


def copy_us(nbytes):
    """Device time of a torch copy moving the same bytes (read nbytes/2, write nbytes/2): the
    ceiling a kernel of this size can actually reach (launch ramp and tail included)."""
    if nbytes not in _copy_cache:
        n = nbytes // 4  # bf16 elements per side
        src = torch.randn(n, device=DEV).to(torch.bfloat16)
        dst = torch.empty_like(src)
        _copy_cache[nbytes] = device_time_us(lambda: dst.copy_(src))
        del src, dst
    return _copy_cache[nbytes]


def device_time_us(fn, reps=25, warm=3):
    """Median device time (us) of one call, ~1 ms of GPU work queued before each: host overhead is hidden."""
    return timing.median_ms(fn, reps, warm, sleep_cycles=2_000_000) * 1e3


def host_time_us(fn, n=50):
    return timing.host_us(fn, n)


# --------------------------------------------------------------------------------------- cases
def make_cases():
    mod = rnd(1, 1, 6 * C)
    sh, sc, g = mod[..., 0:C], mod[..., C:2 * C], mod[..., 2 * C:3 * C]
    sh2, sc2 = mod[..., 3 * C:4 * C], mod[..., 4 * C:5 * C]
    cases = []
    for tag, L in (("img", LI), ("txt", LT), ("single", LS)):
        cases.append(dict(name=f"ln_modulate {tag}", op="ln_modulate", bytes=4 * L * C,
                          make=lambda L=L: ((rnd(1, L, C, scale=2, offset=0.3), sh, sc, EPS), {})))
    for tag, L in (("img", LI), ("txt", LT), ("single", LS)):
        cases.append(dict(name=f"gated_residual {tag}", op="gated_residual", bytes=6 * L * C, inplace=True, exact=True,
                          make=lambda L=L: ((rnd(1, L, C, scale=4), g, rnd(1, L, C)), {})))
    for tag, L in (("img", LI), ("txt", LT)):
        cases.append(dict(name=f"gated_res_ln_mod {tag}", op="gated_residual_ln_modulate", bytes=8 * L * C,
                          inplace=True, make=lambda L=L: ((rnd(1, L, C, scale=4), g, rnd(1, L, C), sh2, sc2, EPS), {})))
    qs = [rnd(D, scale=0.2, offset=1.0) for _ in range(4)]
    pe = torch.randn(1, 1, LS, D // 2, 2, 2, device=DEV)
    pe_bytes = pe.numel() * 4

    def qk_double():
        parts = [(rnd(1, LT, 3 * C, scale=2), qs[0], qs[1]), (rnd(1, LI, 3 * C, scale=2), qs[2], qs[3])]
        return (parts, pe, H, EPS), {}

    def qk_single():
        lin1 = rnd(1, LS, 3 * C + M, scale=2)
        return ([(lin1[..., :3 * C], qs[0], qs[1])], pe, H, EPS), {}
    cases.append(dict(name="qk_norm_rope double", op="qk_norm_rope", bytes=4 * LS * 3 * C + pe_bytes, make=qk_double))
    cases.append(dict(name="qk_norm_rope single", op="qk_norm_rope", bytes=4 * LS * 3 * C + pe_bytes, make=qk_single))

    def gelu_single():
        lin1 = rnd(1, LS, 3 * C + M, scale=2)
        buf = torch.full((1, LS, C + M), float("nan"), dtype=torch.bfloat16, device=DEV)
        return (lin1[..., 3 * C:],), {"out": buf[..., C:]}

    def gelu_img():
        return (rnd(1, LI, M, scale=2),), {}
    cases.append(dict(name="gelu_tanh single->buf", op="gelu_tanh", bytes=4 * LS * M, make=gelu_single))
    cases.append(dict(name="gelu_tanh img", op="gelu_tanh", bytes=4 * LI * M, make=gelu_img))
    return cases


def clone_args(args, kwargs, inplace):
    if not inplace:
        return args, kwargs
    return (args[0].clone(),) + tuple(args[1:]), kwargs


def do_case(cs):
    name, op = cs["name"], cs["op"]
    args, kwargs = cs["make"]()
    inplace = cs.get("inplace", False)
    # check (+ the first call: JIT or on-disk cache load)
    a_r, k_r = clone_args(args, kwargs, inplace)
    ref = run(op, "torch", *a_r, **k_r)
    ref = [t.clone() for t in flat(ref)] + ([a_r[0].clone()] if inplace else [])
    a_n, k_n = clone_args(args, kwargs, inplace)
    if "out" in k_n:
        k_n["out"].fill_(float("nan"))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with Poison():
        out = run(op, "numba", *a_n, **k_n)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    out = flat(out) + ([a_n[0]] if inplace else [])
    err, mx, nans = compare(out, ref)
    ok = nans == 0 and err < 1e-2
    exact = None
    if cs.get("exact"):
        exact = int((out[-1] != ref[-1]).sum())
        ok = ok and exact == 0
    # timing (in-place ops keep updating the same x: fine for timing)
    t_ref = device_time_us(lambda: run(op, "torch", *args, **kwargs))
    t_nb = device_time_us(lambda: run(op, "numba", *args, **kwargs))
    h_nb = host_time_us(lambda: run(op, "numba", *args, **kwargs))
    h_ref = host_time_us(lambda: run(op, "torch", *args, **kwargs))
    floor = cs["bytes"] / CEIL * 1e6
    t_cp = copy_us(cs["bytes"])
    gbs = cs["bytes"] / (t_nb * 1e-6) / 1e9
    note(name, ok=ok, rel_err=f"{err:.2e}", max_abs=f"{mx:.3g}", nans=nans, mismatches=exact, first_call_ms=round(first_ms, 1),
         torch_us=round(t_ref, 1), numba_us=round(t_nb, 1), floor_us=round(floor, 1), GBps=round(gbs),
         pct_ceiling=round(100 * gbs * 1e9 / CEIL, 1), speedup=round(t_ref / t_nb, 2),
         host_us_numba=round(h_nb, 1), host_us_torch=round(h_ref, 1), MB=round(cs["bytes"] / 1e6, 1),
         copy_same_bytes_us=round(t_cp, 1), pct_of_copy=round(100 * t_cp / t_nb, 1))
    rows.append((name, "OK" if ok else "FAIL", f"{err:.1e}", f"{first_ms:.0f}", f"{t_ref:.1f}", f"{t_nb:.1f}",
                 f"{floor:.1f}", f"{gbs:.0f}", f"{100 * gbs * 1e9 / CEIL:.0f}%", f"{t_ref / t_nb:.2f}x",
                 f"{h_nb:.0f}/{h_ref:.0f}", f"{t_cp:.1f} ({100 * t_cp / t_nb:.0f}%)"))


class Variant:
    """A kernel configuration other than the default: ``config`` (here a RowsConfig) is passed to the
    numba calls of ``cases`` (``config=``; its launchers are cached beside the default's)."""

    def __init__(self, name, cases, config):
        self.name, self.cases, self.config = name, cases, config


MAIN = ["ln_modulate img", "gated_residual img", "gated_res_ln_mod img", "qk_norm_rope double",
        "gelu_tanh single->buf", "gelu_tanh img"]
ROWK = ["ln_modulate img", "ln_modulate single", "ln_modulate txt", "gated_res_ln_mod img", "gated_res_ln_mod txt"]
VARIANTS = [
    Variant("row kernels: one row per block, vectors with x (run 7)", ROWK,
            RowsConfig(pipe_blocks=0, pipe_blocks_gated=0, late=False, late_gated=False)),
    Variant("row kernels: one row per block, vectors late", ROWK,
            RowsConfig(pipe_blocks=0, pipe_blocks_gated=0, late=True, late_gated=True)),
    Variant("row kernels: pipelined, 8 blocks/SM", ROWK, RowsConfig(pipe_blocks=8, pipe_blocks_gated=8)),
]


def variants():
    """Time the other configurations of each kernel (same process, same cases): picks defaults."""
    allc = {cs["name"]: cs for cs in make_cases()}
    for v in VARIANTS:
        if time.time() - T0 > 120:
            note("variants", skipped_from=v.name, reason="time budget")
            break
        try:
            for name in v.cases:
                cs = allc[name]
                args, kwargs = cs["make"]()
                inplace = cs.get("inplace", False)
                a_r, k_r = clone_args(args, kwargs, inplace)
                ref = flat(run(cs["op"], "torch", *a_r, **k_r)) + ([a_r[0]] if inplace else [])
                a_n, k_n = clone_args(args, kwargs, inplace)
                with Poison():
                    out = flat(run(cs["op"], "numba", *a_n, config=v.config, **k_n)) + ([a_n[0]] if inplace else [])
                err, _, nans = compare(out, ref)
                ok = nans == 0 and err < 1e-2
                t_nb = device_time_us(lambda: run(cs["op"], "numba", *args, config=v.config, **kwargs))
                gbs = cs["bytes"] / (t_nb * 1e-6) / 1e9
                t_cp = copy_us(cs["bytes"])
                note(f"{name} [{v.name}]", ok=ok, rel_err=f"{err:.2e}", numba_us=round(t_nb, 1), GBps=round(gbs),
                     pct_ceiling=round(100 * gbs * 1e9 / CEIL, 1), pct_of_copy=round(100 * t_cp / t_nb, 1))
                rows.append((f"{name} [{v.name}]", "OK" if ok else "FAIL", f"{err:.1e}", "", "", f"{t_nb:.1f}",
                             f"{cs['bytes'] / CEIL * 1e6:.1f}", f"{gbs:.0f}", f"{100 * gbs * 1e9 / CEIL:.0f}%", "", "",
                             f"{t_cp:.1f} ({100 * t_cp / t_nb:.0f}%)"))
        except Exception as e:
            traceback.print_exc()
            note(f"variant {v.name}", ok=False, error=f"{type(e).__name__}: {e}")
            rows.append((f"[{v.name}]", "ERROR", type(e).__name__, "", "", "", "", "", "", "", "", ""))


def graph_check():
    """Capture numba launches in a CUDA graph and replay (they must go on torch's stream)."""
    mod = rnd(1, 1, 2 * C)
    x = rnd(1, LT, C)
    qkv = rnd(1, LT, 3 * C)
    qs = rnd(D, offset=1.0)
    pe = torch.randn(1, 1, LT, D // 2, 2, 2, device=DEV)

    def step():
        y = run("ln_modulate", "numba", x, mod[..., :C], mod[..., C:], EPS)
        q, k, v = run("qk_norm_rope", "numba", [(qkv, qs, qs)], pe, H, EPS)
        return y, q, k, v
    eager = [t.clone() for t in step()]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    for t in outs:
        t.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(outs, eager))
    note("cuda_graph", ok=same)
    rows.append(("cuda graph capture+replay", "OK" if same else "FAIL", "", "", "", "", "", "", "", "", ""))


def host_breakdown():
    """Where the host time of one numba call goes: registry.call, backend fn, check, raw launch."""
    for cs in make_cases():
        if cs["name"] not in ("ln_modulate img", "qk_norm_rope double", "gated_residual img"):
            continue
        args, kwargs = cs["make"]()
        b = registry.ops[cs["op"]].backends["numba"]
        t_call = host_time_us(lambda: run(cs["op"], "numba", *args, **kwargs))
        t_fn = host_time_us(lambda: b.fn(*args, **kwargs))
        t0 = time.perf_counter()
        for _ in range(200):
            b.check(*args, **kwargs)
        t_check = (time.perf_counter() - t0) / 200 * 1e6
        captured = []
        orig = launching.Launcher.__call__

        def cap(self, *a):
            captured.append((self, a))
            return orig(self, *a)
        launching.Launcher.__call__ = cap
        try:
            b.fn(*args, **kwargs)
        finally:
            launching.Launcher.__call__ = orig
        la, a = captured[0]
        t_launch = host_time_us(lambda: la(*a))
        note(cs["name"] + " host breakdown", call_us=round(t_call, 1), fn_us=round(t_fn, 1), check_us=round(t_check, 1),
             launcher_us=round(t_launch, 1), n_args=len(a))
        rows.append((cs["name"] + " host: call/fn/check/launch", "", "", "", "", "", "", "", "", "",
                     f"{t_call:.0f}/{t_fn:.0f}/{t_check:.0f}/{t_launch:.0f}"))


def slow_launcher_host():
    """Host cost per call with numba's ordinary launcher (fast path off) + re-check."""
    launchers = [la for m in (LM, GR, GT, QK) for la in m._launchers.values()]
    for la in launchers:
        la._fast = None
    for cs in make_cases():
        if cs["name"] not in ("ln_modulate img", "qk_norm_rope double", "gelu_tanh single->buf"):
            continue
        args, kwargs = cs["make"]()
        ref = run(cs["op"], "torch", *args, **kwargs)
        with Poison():
            out = run(cs["op"], "numba", *args, **kwargs)
        err, _, nans = compare(flat(out), flat(ref))
        h = host_time_us(lambda: run(cs["op"], "numba", *args, **kwargs))
        note(cs["name"] + " [numba launcher]", ok=nans == 0 and err < 1e-2, rel_err=f"{err:.2e}", host_us=round(h, 1))
        rows.append((cs["name"] + " (slow launch)", "OK" if nans == 0 and err < 1e-2 else "FAIL", f"{err:.1e}",
                     "", "", "", "", "", "", "", f"{h:.0f}/-"))


def main():
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, fast launch {launching._FAST_OK}", flush=True)
    torch.manual_seed(0)
    for cs in make_cases():
        try:
            do_case(cs)
        except Exception as e:
            traceback.print_exc()
            note(cs["name"], ok=False, error=f"{type(e).__name__}: {e}")
            rows.append((cs["name"], "ERROR", type(e).__name__, "", "", "", "", "", "", "", ""))
    for fn in (graph_check, variants, host_breakdown, slow_launcher_host):
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            note(fn.__name__, ok=False, error=f"{type(e).__name__}: {e}")
            rows.append((fn.__name__, "ERROR", type(e).__name__, "", "", "", "", "", "", "", "", ""))
    try:
        ptx_report()
    except Exception as e:
        traceback.print_exc()
        note("ptx", ok=False, error=f"{type(e).__name__}: {e}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_fused.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    hdr = ("case", "check", "rel err", "1st ms", "torch us", "numba us", "floor us", "GB/s", "of 3.7T", "speedup",
           "host us nb/torch", "copy same bytes us (nb % of it)")
    rows[:] = [tuple(r) + ("",) * (len(hdr) - len(r)) for r in rows]
    w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
    print(f"\n=== fused memory-bound ops, H200, device time (median of 25), total {time.time() - T0:.0f}s ===")
    for r in [hdr] + rows:
        print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))


if __name__ == "__main__":
    main()
