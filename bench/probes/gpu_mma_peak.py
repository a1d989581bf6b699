"""Sustained tensor-core throughput the pack reaches from Numba (what bounds an mma.sync conv), H200.

    python bench/probes/gpu_mma_peak.py                 # GPU, < 1 min; table last, JSON to $OUT/gpu_mma_peak.json
    python bench/probes/gpu_mma_peak.py --mma 2x8/256 --wgmma n256g4/128 --iters 4096
    NUMBA_ENABLE_CUDASIM=1 python bench/probes/gpu_mma_peak.py --sim    # CPU simulator, tiny: the kernels run
    python bench/probes/gpu_mma_peak.py --ptx           # no GPU: PTX for sm_90a + ptxas -v (registers, spills)

Kernels (the pack's helpers, cuda_kernels/mma.py; bf16 operands, fp32 accumulators):
  mma.sync  m16n8k16 with every operand in registers: each warp holds an MT x NT grid of
            independent m16n8 accumulator tiles (MT A fragments x NT B fragments, as one k-step of
            a (16 MT) x (8 NT) warp tile of a GEMM), MT NT mma per k-step, ``iters`` k-steps.
            Variant "MTxNT/threads", e.g. 2x8/256 (16 tiles: 64 accumulator registers).
  wgmma     m64nNk16 (sm_90 only), A from registers, B from shared memory through a no-swizzle
            K-major descriptor (KT = 4 B images of 16 x N, set up once), G wgmma per
            commit_group + wait_group 0, ``iters`` groups; one warpgroup = 128 threads, "/256"
            puts two warpgroups in a block.  Variant "nNgG/threads", e.g. n256g4/128.
  cuBLAS    torch bf16 matmul 8192 x 8192 x 8192 (the reference ceiling), timed first and last.
Grid: SMs x (resident blocks per SM from the occupancy API) x 2 waves (8 blocks per SM where the
API does not answer), every block the same work; ``iters`` sized for ~2 TFLOP per launch
(~3-5 ms).  Time: CUDA events around one launch, 3 warm-ups, median of 5.  Each kernel writes a
per-thread checksum (the sum of its accumulators: nothing can be optimised away) and warp 0 /
warpgroup 0 of block 0 its accumulator tiles, which are checked against iters x (A @ B) from the
same bf16 operands (fp64 on the host, relative error < 1%): "check" shows the fragments / the
descriptor are right and the loop did about the MMAs it is credited with.
Table: kernel, TFLOP/s, % of the cuBLAS number, % of 765 TFLOP/s (the pack's recorded bf16
GEMM ceiling on the H200), registers / thread, blocks per SM.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

SIM = "--sim" in sys.argv or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
PTX = "--ptx" in sys.argv
if SIM:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
elif PTX:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
else:
    os.environ.setdefault("FLUX_NUMBA_REAL_GPU", "1")
BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: timing.py
ROOT = os.path.dirname(BENCH)  # the repo root
sys.path[:0] = [ROOT, BENCH]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import _pack  # noqa: E402

_pack.load()   # numpy 2.5 compat (numpy.row_stack = numpy.vstack) before numba-cuda is imported
if PTX:        # compile for sm_90 without a GPU (as bench/probes/ptx_hash_attention.py does)
    import types as _types
    import numba.cuda.dispatcher as _disp
    _disp.get_current_device = lambda: _types.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, float32, int32, int64  # noqa: E402  (module global `cuda`: the simulator swaps it)
from flux_numba_pack.cuda_kernels import launching, mma as _mma, runtime  # noqa: E402
from flux_numba_pack.flux_core import harness  # noqa: E402
import timing  # noqa: E402  (bench/timing.py)

# plain cuda.jit (no on-disk cache: a few small kernels); fastmath as the pack's kernels
_jit = cuda.jit if SIM else (lambda f: cuda.jit(f, fastmath=True))

PEAK = 765e12          # the pack's recorded bf16 dense GEMM ceiling (H200, cuBLAS)
KT = 4                 # B images (k-steps) of the wgmma kernel
TOL = 1e-2             # check: fp32 sums of ~1e4 equal steps (tensor-core accumulation) vs fp64
T0 = time.time()
DEV = "cpu" if SIM else "cuda"
results = {"kernels": {}, "notes": []}
DEFAULT_MMA = "1x4/256,2x4/256,2x8/256,4x8/128"
DEFAULT_WGMMA = "n128g4/128,n256g4/128,n256g8/128,n256g4/256"


def note(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------ kernels
def make_mma(MT, NT):
    """mma.sync peak kernel: k(aw, bw, iters, out, tiles).  aw [MT, 16, 8] / bw [NT, 8, 8] int32:
    the bf16 A tiles (16 x 16, row) and B^T tiles (8 x 16) as words; every warp loads its lane's
    fragments once, then runs ``iters`` k-steps of MT x NT independent mma (acc += A_i B_j)."""
    NACC = MT * NT * 4
    NAF, NBF = MT * 4, NT * 2
    SCRW = _mma.SCR_WORDS
    mma_bf16 = _mma.mma_bf16

    @_jit
    def k(aw, bw, iters, out, tiles):
        scr = cuda.shared.array(SCRW, int32)
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        a = cuda.local.array(NAF, int32)
        b = cuda.local.array(NBF, int32)
        acc = cuda.local.array(NACC, float32)
        for i in range(MT):
            a[4 * i] = aw[i, g, t]
            a[4 * i + 1] = aw[i, g + 8, t]
            a[4 * i + 2] = aw[i, g, t + 4]
            a[4 * i + 3] = aw[i, g + 8, t + 4]
        for j in range(NT):
            b[2 * j] = bw[j, g, t]
            b[2 * j + 1] = bw[j, g, t + 4]
        for q in range(NACC):
            acc[q] = float32(0)
        for it in range(iters):
            for i in range(MT):
                for j in range(NT):
                    q = 4 * (i * NT + j)
                    d0, d1, d2, d3 = mma_bf16(a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3],
                                              b[2 * j], b[2 * j + 1], acc[q], acc[q + 1], acc[q + 2],
                                              acc[q + 3], scr)
                    acc[q] = d0
                    acc[q + 1] = d1
                    acc[q + 2] = d2
                    acc[q + 3] = d3
        s = float32(0)
        for q in range(NACC):
            s += acc[q]
        out[cuda.blockIdx.x * cuda.blockDim.x + tid] = s
        if cuda.blockIdx.x == 0 and tid < 32:
            for q in range(NACC):
                tiles[q, lane] = acc[q]
    return k


def make_wgmma(N, G, NWG):
    """wgmma peak kernel: k(aw, bimg, iters, out, tiles).  aw [64, 8] int32: the A tile (64 x 16,
    row) as words (each warp of a warpgroup its 16 rows); bimg: KT no-swizzle K-major images of
    16 x N bf16 (LBO 128, SBO 256 bytes), copied into shared memory once; ``iters`` groups of G
    wgmma (acc += A B_(r % KT)), each group committed and waited for."""
    NA = N // 2
    IMGW = 16 * N * 2 // 4          # words per B image
    WORDS = KT * IMGW
    NTH = 128 * NWG
    STEP = (16 * N * 2) >> 4        # descriptor step between images (16-byte units)
    HI = ((128 >> 4) << 16) | ((256 >> 4) << 32)
    AL = None if runtime.SIMULATOR else 128
    SCRW = _mma.SCR_WORDS
    wg = _mma.wgmma_op(N, 0)
    wg_fence, wg_commit, wg_wait0, fence_async = _mma.wg_fence, _mma.wg_commit, _mma.wg_wait0, _mma.fence_proxy_async

    @_jit
    def k(aw, bimg, iters, out, tiles):
        sm = cuda.shared.array(WORDS, int32, alignment=AL)
        scr = cuda.shared.array(SCRW, int32)
        tid = cuda.threadIdx.x
        for i in range(tid, WORDS, NTH):
            sm[i] = bimg[i]
        fence_async()                   # generic-proxy writes -> visible to wgmma (async proxy)
        cuda.syncthreads()
        wt = tid % 128
        w = wt // 32
        lane = wt % 32
        g = lane // 4
        t = lane % 4
        r = 16 * w + g
        a0 = aw[r, t]
        a1 = aw[r + 8, t]
        a2 = aw[r, t + 4]
        a3 = aw[r + 8, t + 4]
        acc = cuda.local.array(NA, float32)
        for i in range(NA):
            acc[i] = float32(0)
        desc = HI | (int64(_mma.smem_base(sm)) >> 4)
        for it in range(iters):
            wg_fence()                  # (ptxas injects it at the loop head otherwise: C7519)
            for rr in range(G):
                wg(acc, a0, a1, a2, a3, desc + (rr % KT) * STEP, 1, sm, scr)
            wg_commit()
            wg_wait0()
        s = float32(0)
        for i in range(NA):
            s += acc[i]
        out[cuda.blockIdx.x * NTH + tid] = s
        if cuda.blockIdx.x == 0 and tid < 128:
            for i in range(NA):
                tiles[i, tid] = acc[i]
    return k


# ------------------------------------------------------------------------------------ operands
def words(t):
    """bf16 [..., 2m] -> int32 [..., m] (lower index in the low half, as the fragments want)."""
    return t.contiguous().view(torch.int32)


def mma_operands(MT, NT, gen):
    A = torch.randn(MT, 16, 16, generator=gen).to(torch.bfloat16)
    B = torch.randn(NT, 16, 8, generator=gen).to(torch.bfloat16)
    return A, B, words(A), words(B.transpose(1, 2))          # [MT, 16, 8], [NT, 8, 8]


def mma_reference(A, B, tiles, steps):
    """|tiles - steps A_i B_j| / |steps A_i B_j| (Frobenius); tiles [MT NT 4, 32] (warp 0)."""
    MT, NT = A.shape[0], B.shape[0]
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    err = ref = 0.0
    for i in range(MT):
        for j in range(NT):
            R = steps * (A[i].double() @ B[j].double()).numpy()
            q = 4 * (i * NT + j)
            D = np.zeros((16, 8))
            D[g, 2 * t], D[g, 2 * t + 1] = tiles[q], tiles[q + 1]
            D[g + 8, 2 * t], D[g + 8, 2 * t + 1] = tiles[q + 2], tiles[q + 3]
            err += ((D - R) ** 2).sum()
            ref += (R ** 2).sum()
    return float(np.sqrt(err / ref))


def wgmma_operands(N, gen):
    A = torch.randn(64, 16, generator=gen).to(torch.bfloat16)
    Bs = torch.randn(KT, 16, N, generator=gen).to(torch.bfloat16)
    img = np.zeros((KT, 16 * N * 2), dtype=np.uint8)
    raw = Bs.view(torch.int16).numpy().view(np.uint8).reshape(KT, 16, N, 2)
    k, n = np.meshgrid(np.arange(16), np.arange(N), indexing="ij")
    addr = (n // 8) * 256 + (k // 8) * 128 + (n % 8) * 16 + (k % 8) * 2    # K-major, LBO 128, SBO 256
    for kk in range(KT):
        img[kk, addr] = raw[kk, :, :, 0]
        img[kk, addr + 1] = raw[kk, :, :, 1]
    return A, Bs, words(A), torch.from_numpy(img.reshape(-1).view(np.int32).copy())


def wgmma_reference(A, Bs, tiles, groups, G):
    """tiles [N/2, 128] (warpgroup 0) vs groups x sum_r A B_(r % KT)."""
    N = Bs.shape[2]
    Bsum = sum(Bs[r % KT].double() for r in range(G))
    R = groups * (A.double() @ Bsum).numpy()
    wt = np.arange(128)
    w, lane = wt // 32, wt % 32
    g, t = lane // 4, lane % 4
    D = np.zeros((64, N))
    for j in range(N // 8):
        D[16 * w + g, 8 * j + 2 * t] = tiles[4 * j]
        D[16 * w + g, 8 * j + 2 * t + 1] = tiles[4 * j + 1]
        D[16 * w + g + 8, 8 * j + 2 * t] = tiles[4 * j + 2]
        D[16 * w + g + 8, 8 * j + 2 * t + 1] = tiles[4 * j + 3]
    return float(np.linalg.norm(D - R) / np.linalg.norm(R))


# ------------------------------------------------------------------------------------ timing
def events_ms(fn, warm=3, reps=5):
    """Median ms of one call between two CUDA events, synchronized around each (``timing.median_ms``;
    simulator: one call's wall time, ``flux_core.harness``)."""
    return harness.median_ms(fn, DEV, 0, 1) if SIM else timing.median_ms(fn, reps=reps, warm=warm, sync_each=True)


def regs_of(la):
    try:
        r = la.kernel.get_regs_per_thread()
        return int(next(iter(r.values())) if isinstance(r, dict) else r)
    except Exception:
        return None


def grid_of(la, nth, args):
    occ = la.occupancy(nth, *args)
    if SIM:
        return 2, occ
    return runtime.sm_count() * (2 * occ if occ else 8), occ


def parse_mma(s):
    m = re.fullmatch(r"(\d+)x(\d+)/(\d+)", s.strip())
    if not m:
        raise ValueError(f"bad mma variant {s!r} (want MTxNT/threads, e.g. 2x8/256)")
    return tuple(int(v) for v in m.groups())


def parse_wgmma(s):
    m = re.fullmatch(r"n(\d+)g(\d+)/(128|256)", s.strip())
    if not m:
        raise ValueError(f"bad wgmma variant {s!r} (want nNgG/128|256, e.g. n256g4/128)")
    N, G, nth = (int(v) for v in m.groups())
    if N % 8 or not 8 <= N <= 256:
        raise ValueError("wgmma N: a multiple of 8 in 8..256")
    return N, G, nth


def run_mma(spec, args, gen):
    MT, NT, nth = parse_mma(spec)
    if SIM:
        nth = 32 * max(1, min(nth // 32, 2))
    A, B, aw, bw = mma_operands(MT, NT, gen)
    aw, bw = aw.to(DEV), bw.to(DEV)
    tiles = torch.zeros(MT * NT * 4, 32, device=DEV)
    la = launching.Launcher(lambda: make_mma(MT, NT))
    probe = (aw, bw, 1, torch.zeros(nth, device=DEV), tiles)
    grid, occ = grid_of(la, nth, probe)
    warps = grid * nth // 32
    per_iter = warps * MT * NT * 2 * 16 * 8 * 16
    iters = args.iters or (2 if SIM else max(16, int(args.flop / per_iter)))
    out = torch.zeros(grid * nth, device=DEV)
    fn = lambda: la(grid, nth, aw, bw, iters, out, tiles)  # noqa: E731
    ms = events_ms(fn)
    if not SIM:
        torch.cuda.synchronize()
    err = mma_reference(A, B, tiles.cpu().numpy(), iters)
    return dict(kind="mma.sync m16n8k16", variant=spec, tiles_per_warp=MT * NT, threads=nth, grid=grid,
                blocks_per_sm=occ, regs=regs_of(la), iters=iters, flop=per_iter * iters, ms=ms,
                TFLOPs=per_iter * iters / ms / 1e9, checksum=float(out.double().sum()), rel_err=err,
                ok=bool(err < TOL and np.isfinite(err)))


def run_wgmma(spec, args, gen):
    N, G, nth = parse_wgmma(spec)
    NWG = nth // 128
    A, Bs, aw, img = wgmma_operands(N, gen)
    aw, img = aw.to(DEV), img.to(DEV)
    tiles = torch.zeros(N // 2, 128, device=DEV)
    la = launching.Launcher(lambda: make_wgmma(N, G, NWG))
    probe = (aw, img, 1, torch.zeros(nth, device=DEV), tiles)
    grid, occ = grid_of(la, nth, probe)
    if SIM:
        grid = 1
    per_iter = grid * NWG * G * 2 * 64 * N * 16
    iters = args.iters_wg or (1 if SIM else max(16, int(args.flop / per_iter)))
    out = torch.zeros(grid * nth, device=DEV)
    fn = lambda: la(grid, nth, aw, img, iters, out, tiles)  # noqa: E731
    ms = events_ms(fn)
    if not SIM:
        torch.cuda.synchronize()
    err = wgmma_reference(A, Bs, tiles.cpu().numpy(), iters, G)
    return dict(kind=f"wgmma m64n{N}k16", variant=spec, ops_per_commit=G, threads=nth, grid=grid,
                blocks_per_sm=occ, regs=regs_of(la), iters=iters, flop=per_iter * iters, ms=ms,
                TFLOPs=per_iter * iters / ms / 1e9, checksum=float(out.double().sum()), rel_err=err,
                ok=bool(err < TOL and np.isfinite(err)))


def run_cublas(n):
    g = torch.Generator(device=DEV).manual_seed(1)
    a = torch.randn(n, n, device=DEV, generator=g).to(torch.bfloat16)
    b = torch.randn(n, n, device=DEV, generator=g).to(torch.bfloat16)
    c = torch.empty(n, n, device=DEV, dtype=torch.bfloat16)
    ms = events_ms(lambda: torch.matmul(a, b, out=c), warm=10)
    return dict(kind="cuBLAS bf16 matmul", variant=f"{n}^3", ms=ms, flop=2 * n ** 3, TFLOPs=2 * n ** 3 / ms / 1e9,
                checksum=float(c.float().sum()), ok=True)


# ------------------------------------------------------------------------------------ --ptx
def ptx_report(args):
    """PTX of each kernel for sm_90a (numba-cuda's NVVM; no GPU) and ptxas -v where ptxas is on PATH."""
    from numba import types as nt
    A = lambda t, d: nt.Array(t, d, "A")  # noqa: E731
    sig = (A(nt.int32, 3), A(nt.int32, 3), nt.int64, A(nt.float32, 1), A(nt.float32, 2))
    sig_wg = (A(nt.int32, 2), A(nt.int32, 1), nt.int64, A(nt.float32, 1), A(nt.float32, 2))
    jobs = [(f"mma {s}", make_mma(*parse_mma(s)[:2]), sig) for s in args.mma.split(",") if s]
    jobs += [(f"wgmma {s}", make_wgmma(*parse_wgmma(s)[:2], parse_wgmma(s)[2] // 128), sig_wg)
             for s in args.wgmma.split(",") if s]
    for name, k, sg in jobs:
        t = time.time()
        ptx, _ = cuda.compile_ptx(k.py_func, sg, cc=(9, 0), fastmath=True)
        ptx = re.sub(r"^\.target sm_90$", ".target sm_90a", ptx, count=1, flags=re.M)
        nmma = len(re.findall(r"\bmma\.sync", ptx))
        nwg = len(re.findall(r"wgmma\.mma_async", ptx))
        line = f"{name}: PTX {len(ptx)} chars, {nmma} mma.sync / {nwg} wgmma in the text, {time.time() - t:.1f} s"
        d = tempfile.mkdtemp()
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(re.sub(r"^\.version \d+\.\d+", ".version 8.0", ptx, count=1, flags=re.M))
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, name.replace(" ", "_").replace("/", "t") + ".ptx"), "w") as f:
                f.write(ptx)
        try:
            r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", "k.ptx", "-o", "k.cubin"], cwd=d,
                               capture_output=True, text=True)
            regs = re.search(r"Used (\d+) registers", r.stderr)
            sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
            warn = [ln for ln in r.stderr.splitlines() if "warning" in ln.lower() or "(C75" in ln]
            line += (f" | ptxas: {regs.group(1)} regs, spills {sp.group(1)}/{sp.group(2)} B" if regs and sp
                     else f" | ptxas failed: {r.stderr.strip()[-200:]}")
            for w_ in warn:
                line += "\n    " + w_.strip()
        except FileNotFoundError:
            line += " | ptxas not on PATH"
        print(line, flush=True)


# ------------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mma", default=None, help=f"mma.sync variants MTxNT/threads (default {DEFAULT_MMA})")
    ap.add_argument("--wgmma", default=None, help=f"wgmma variants nNgG/threads (default {DEFAULT_WGMMA}; '' = none)")
    ap.add_argument("--iters", type=int, default=0, help="mma.sync k-steps per warp (default: ~--flop per launch)")
    ap.add_argument("--iters-wg", type=int, default=0, help="wgmma groups per warpgroup (default: ~--flop per launch)")
    ap.add_argument("--flop", type=float, default=2e12, help="FLOP per timed launch (sizes iters)")
    ap.add_argument("--gemm", type=int, default=8192, help="cuBLAS reference size (0 = skip)")
    ap.add_argument("--sim", action="store_true", help="CPU simulator: the mma.sync (and a tiny wgmma) kernel runs")
    ap.add_argument("--ptx", action="store_true", help="no GPU: PTX + ptxas report of the kernels")
    ap.add_argument("--dump", default="", help="with --ptx: folder for the PTX files")
    args = ap.parse_args()
    if args.mma is None:
        args.mma = "1x2/32,2x2/64" if SIM else DEFAULT_MMA
    if args.wgmma is None:
        args.wgmma = "n16g2/128" if SIM else DEFAULT_WGMMA
    if PTX:
        return ptx_report(args)
    gen = torch.Generator().manual_seed(0)
    if not SIM:
        torch.backends.cuda.matmul.allow_tf32 = False
        cc = torch.cuda.get_device_capability()
        print(torch.__version__, torch.cuda.get_device_name(), f"sm_{cc[0]}{cc[1]}", runtime.sm_count(), "SMs",
              flush=True)
    else:
        cc = (9, 0)
    rows = []
    if args.gemm and not SIM:
        rows.append(("cublas_start", run_cublas(args.gemm)))
    for s in [s for s in args.mma.split(",") if s]:
        rows.append((f"mma {s}", _safe(run_mma, s, args, gen)))
    for s in [s for s in args.wgmma.split(",") if s]:
        if cc[0] != 9:
            rows.append((f"wgmma {s}", {"kind": "wgmma", "variant": s, "error": f"needs sm_90 (sm_{cc[0]}{cc[1]})"}))
            continue
        rows.append((f"wgmma {s}", _safe(run_wgmma, s, args, gen)))
    if args.gemm and not SIM:
        rows.append(("cublas_end", run_cublas(args.gemm)))
    report(rows)


def _safe(fn, s, args, gen):
    t = time.time()
    try:
        r = fn(s, args, gen)
        note(f"{r['kind']} {s}: {r['TFLOPs']:.1f} TFLOP/s ({r['ms']:.3f} ms, grid {r['grid']}, {r['blocks_per_sm']} "
             f"blocks/SM, {r['regs']} regs) check rel err {r['rel_err']:.1e} {'OK' if r['ok'] else 'FAIL'} "
             f"[{time.time() - t:.1f} s incl. compile]")
        return r
    except Exception as e:
        import traceback
        traceback.print_exc()
        note(f"{s}: ERROR {type(e).__name__}: {str(e)[:300]}")
        return {"variant": s, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def report(rows):
    cub = [r["TFLOPs"] for k, r in rows if k.startswith("cublas") and "TFLOPs" in r]
    ref = max(cub) if cub else None
    results["kernels"] = {k: r for k, r in rows}
    results["cublas_TFLOPs"] = ref
    results["peak_TFLOPs_recorded"] = PEAK / 1e12
    best = {}
    for k, r in rows:
        if "TFLOPs" in r and r.get("ok") and not k.startswith("cublas"):
            fam = r["kind"].split()[0]
            if r["TFLOPs"] > best.get(fam, (0, ""))[0]:
                best[fam] = (r["TFLOPs"], r["variant"])
    results["best"] = {f: {"TFLOPs": v[0], "variant": v[1], "pct_cublas": 100 * v[0] / ref if ref else None,
                           "pct_765": 100 * v[0] / (PEAK / 1e12)} for f, v in best.items()}
    out = os.environ.get("OUT")
    if out:
        try:
            with open(os.path.join(out, "gpu_mma_peak.json"), "w") as f:
                json.dump(results, f, indent=1, default=str)
        except Exception as e:
            print("JSON write failed:", e)
    hdr = ("kernel", "variant", "TFLOP/s", "% cuBLAS", "% of 765", "ms", "regs", "blk/SM", "grid", "check")
    tab = []
    for k, r in rows:
        if "error" in r:
            tab.append((r.get("kind", k), r.get("variant", ""), "ERROR", r["error"][:60], "", "", "", "", "", ""))
            continue
        tf = r["TFLOPs"]
        tab.append((r["kind"] + (" (last)" if k == "cublas_end" else ""), r["variant"], f"{tf:.1f}",
                    f"{100 * tf / ref:.0f}%" if ref else "-", f"{100 * tf / (PEAK / 1e12):.0f}%", f"{r['ms']:.3f}",
                    str(r.get("regs", "") or ""), str(r.get("blocks_per_sm", "") or ""), str(r.get("grid", "")),
                    "" if k.startswith("cublas") else (f"OK {r['rel_err']:.0e}" if r["ok"] else f"FAIL {r['rel_err']:.0e}")))
    w = [max(len(str(x[i])) for x in tab + [hdr]) for i in range(len(hdr))]
    print(f"\n=== tensor-core throughput from Numba ({'SIMULATOR: timings meaningless' if SIM else torch.cuda.get_device_name()}), "
          f"{time.time() - T0:.0f}s ===")
    print("bf16 x bf16 -> fp32; CUDA events around one launch, median of 5; % cuBLAS = of the better cuBLAS row; "
          "check = warp 0's accumulators vs iters x A B (fp64)")
    for x in [hdr] + tab:
        print("  ".join(str(v).ljust(w[i]) for i, v in enumerate(x)))
    for f, v in results["best"].items():
        print(f"best {f}: {v['variant']} {v['TFLOPs']:.1f} TFLOP/s = "
              + (f"{v['pct_cublas']:.0f}% of cuBLAS, " if v["pct_cublas"] else "") + f"{v['pct_765']:.0f}% of 765")


if __name__ == "__main__":
    main()
