"""GroupNorm (affine) + optional SiLU of a channels_last (NHWC) activation, for the VAE decoder.

``groupnorm_silu_nhwc(x, num_groups, weight, bias, eps, silu=True, pre_bias=None)``
  x: [N, C, H, W] bf16 in channels_last memory (NHWC: a pixel's C channels are contiguous);
  weight / bias [C] bf16 or fp32; returns a new channels_last bf16 tensor =
  ``silu(group_norm(x))`` (or ``group_norm(x)`` when silu=False), one rounding of the fp32 result.
  ``pre_bias`` [C] (bf16 / fp32) or None: normalise x + pre_bias instead -- the bias of the
  convolution that produced x (a ResnetBlock's conv1, computed without it), so that bias costs no
  pass of its own: the statistics kernel adds it to each loaded value, and since
  (x + p) a + b = x a + (b + p a) the normalise pass only sees a different b.
  It is groupnorm_silu.py's op for the NHWC decoder (FluxNumbaVAEPatch layout "nhwc"): there the
  activations stay channels_last end to end, so cuDNN's convolutions run their NHWC kernels without
  the nchwToNhwc / nhwcToNchw conversions it wraps around every NCHW bf16 convolution.

Layout fact used: in NHWC one (sample, group) is C/G channels out of every pixel's row of C, i.e.
strided; a pixel row of C channels (C/8 16-byte columns) is the contiguous unit.  A thread that
keeps one 16-byte column j for all its work touches a fixed set of 8 channels -- one group when
C/G >= 8, 8/(C/G) groups when C/G divides 8 -- so it needs only those 8 channels' coefficients.

Numba backend, two launches through ``launching.Launcher`` (launch plan cached per shape):
  1. ``gnh_part``: block = (sample n, pixel chunk s of S); thread = (pixel lane r of R, column j),
     R = TPB / (C/8).  Per iteration each thread issues U=4 independent 16-byte loads (pixels
     p, p+R, ...) before any math (+ its 8 pre_bias values, registers), folds the exact two-pass
     mean/M2 of that batch into its running (count, mean, M2) per group with one branch-free Chan
     update; block merge in shared memory, one thread per group.  Partials fp32 SoA [3, N*G*S],
     group-major (as groupnorm_silu's).  The block that finishes a sample's last chunk (an atomic
     ticket per sample, after a threadfence) then merges that sample's G x S partials -- warp w
     takes groups w, w + 8, ... (groupnorm_silu's ``_group_merge``: lanes over the partials,
     shuffles; a shared-memory tree in the simulator) -- and writes the per-channel affine
     a = rstd gamma_c, b = beta_c - mean a, fp32 [2, N, C].  (One block per sample does this, not
     every block of the next kernel: tag ``gn-nhwc-merged-coef-v1`` measured that 2.4-3.6x slower;
     not a third launch either: the decoder's 128^2 stage is host-bound.  S <= 256 keeps that
     merge short: with up to 1024 chunks it cost tens of us per call, BENCHMARKS.md VAE decoder.)
  2. ``gnh_norm``: a grid-stride stream over the 16-byte vectors of x, backwards (the tail of x the
     statistics pass left in L2 is re-read first); the grid stride is a multiple of C/8, so each
     thread's column -- and its 8 (a, b) pairs, registers -- never changes within a sample:
     4 x 16-byte loads, y = x a + b, SiLU as y rcp(1 + ex2(-y log2 e)), RNE to bf16, 16-byte stores.
  Exact statistics (no E[x^2] - E[x]^2 cancellation).  C must be a multiple of 8, C/8 <= 256, and
  C/G a multiple or a divisor of 8; x 16-byte aligned.  Anything else: the torch reference.

Bytes moved: read x twice + write y once = 3 numel 2 B (+ tiny partials), the same as the NCHW op:
  [1,128,1024,1024]: 805 MB -> floor 218 us at 3.7 TB/s; [1,256,1024,1024] 1.61 GB -> 435 us;
  [1,512,512,512] 805 MB -> 218 us; [1,512,256,256] 201 MB -> 54 us; [1,512,128,128] 50 MB ->
  14 us (x fits in L2).  The FLUX decoder's 30 GroupNorms: 10.5 GB, floor ~2.85 ms per decode.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from . import launching
from .jit import NUMBA_OK, jit_kernel
from . import runtime
from .registry import registry
from .config import NHWC
# module globals (not closure cells): the simulator swaps `cuda` per thread
from .device import cuda, float32, int32, unpack4, pack4, ld2, st2, bf2f, rsqrt  # noqa: F401

OP = "groupnorm_silu_nhwc"
SIMULATOR = runtime.SIMULATOR
U = 4  # 16-byte loads per thread per iteration (the normalise kernel's loop is unrolled by hand for 4)
# threads per block and the most pixel chunks per sample: config.NhwcConfig (tpb, max_s; the last
# block merges G x S partials: run g, S up to 1024, cost 30-80 us per call)


def reference(x, num_groups, weight, bias, eps: float = 1e-6, silu: bool = True, pre_bias=None):
    """ComfyUI's math (the conv's bias add, ``F.group_norm``, ``F.silu``, each in x's dtype), channels_last out."""
    if pre_bias is not None:
        x = x + pre_bias.to(x.dtype).view(1, -1, 1, 1)
    y = F.group_norm(x, num_groups, weight, bias, eps)
    if silu:
        y = F.silu(y)
    return y.contiguous(memory_format=torch.channels_last)


registry.register(OP, reference, doc=__doc__)

if NUMBA_OK:
    from .groupnorm_silu import _merge, _group_merge, _act  # noqa: F401  (device helpers)

    _dev = cuda.jit(device=True) if SIMULATOR else cuda.jit(device=True, forceinline=True)

    @_dev
    def _y4(w, a0, a1, a2, a3, b0, b1, b2, b3, silu):
        """One int64 word of 4 bf16 channels -> act(x a + b) of each, RNE-rounded, packed."""
        t = unpack4(w)
        return pack4(_act(t[0] * a0 + b0, silu), _act(t[1] * a1 + b1, silu),
                     _act(t[2] * a2 + b2, silu), _act(t[3] * a3 + b3, silu))


def _layout(C, G, TPB):
    """(CC 16-byte columns, R pixel lanes, GPC groups per column, CPA channels per group in a column)
    for blocks of TPB threads."""
    CC = C // 8
    cpg = C // G
    GPC = 1 if cpg >= 8 else 8 // cpg
    return CC, TPB // CC, GPC, 8 // GPC


def make_part_kernel(C, G, PB, PB16, W16, TPB):
    CC, R, GPC, CPA = _layout(C, G, TPB)
    cpg = C // G
    CW2 = C // 8                     # 16-byte columns per pixel
    NV = U * 8
    BN_F = float32(U * CPA)          # values per group per batch
    INV_B = float32(1.0 / (U * CPA))
    ONE_F = float32(CPA)
    INV_1 = float32(1.0 / CPA)
    SHW = TPB * GPC
    COLS_PER_G = cpg // 8 if cpg >= 8 else 1

    def gnh_part(xw, pb, part, cnt, w, b, coef, HW, S, P, N, eps):
        """block blk = n * S + s -> part[(n G + g) S + s] (+ P, + 2P) = (count, mean, M2) of group g
        (of x + pb when PB) over pixels [HW s // S, HW (s + 1) // S) of sample n; the block that
        finishes sample n's last chunk (atomic ticket cnt[n] == S - 1) merges its G groups' S
        partials and writes coef[n C + c] = a_c, coef[N C + n C + c] = b_c (+ pb_c a_c)."""
        flag = cuda.shared.array(1, int32)
        sh = cuda.shared.array(96, float32)
        shn = cuda.shared.array(SHW, float32)
        shm = cuda.shared.array(SHW, float32)
        shq = cuda.shared.array(SHW, float32)
        v = cuda.local.array(NV, float32)
        an = cuda.local.array(GPC, float32)
        am = cuda.local.array(GPC, float32)
        aq = cuda.local.array(GPC, float32)
        pbv = cuda.local.array(8, float32)
        tid = cuda.threadIdx.x
        r = tid // CC
        j = tid - r * CC
        for e in range(8):
            pbv[e] = float32(0)
            if PB == 1 and r < R:
                if PB16 == 1:
                    pbv[e] = bf2f(pb[8 * j + e])
                else:
                    pbv[e] = pb[8 * j + e]
        blk = cuda.blockIdx.x
        nblk = P // G
        while blk < nblk:
            n = blk // S
            s = blk - n * S
            lo = (HW * s) // S
            hi = (HW * (s + 1)) // S
            for a in range(GPC):
                an[a] = float32(0)
                am[a] = float32(0)
                aq[a] = float32(0)
            if r < R:
                p = lo + r
                base = n * HW
                while p + (U - 1) * R < hi:
                    for k in range(U):     # U independent 16-byte loads first
                        t2 = ld2(xw, 2 * ((base + p + k * R) * CW2 + j))
                        f0 = unpack4(t2[0])
                        f1 = unpack4(t2[1])
                        for e in range(4):
                            v[8 * k + e] = f0[e] + pbv[e]
                            v[8 * k + 4 + e] = f1[e] + pbv[4 + e]
                    for a in range(GPC):
                        s1 = float32(0)
                        for k in range(U):
                            for e in range(CPA):
                                s1 += v[8 * k + a * CPA + e]
                        bm = s1 * INV_B
                        bq = float32(0)
                        for k in range(U):
                            for e in range(CPA):
                                d = v[8 * k + a * CPA + e] - bm
                                bq += d * d
                        nn = an[a] + BN_F          # branch-free Chan update (batch never empty)
                        d = bm - am[a]
                        f = BN_F / nn
                        am[a] = am[a] + d * f
                        aq[a] = aq[a] + bq + d * d * an[a] * f
                        an[a] = nn
                    p += U * R
                while p < hi:
                    t2 = ld2(xw, 2 * ((base + p) * CW2 + j))
                    f0 = unpack4(t2[0])
                    f1 = unpack4(t2[1])
                    for e in range(4):
                        v[e] = f0[e] + pbv[e]
                        v[4 + e] = f1[e] + pbv[4 + e]
                    for a in range(GPC):
                        s1 = float32(0)
                        for e in range(CPA):
                            s1 += v[a * CPA + e]
                        bm = s1 * INV_1
                        bq = float32(0)
                        for e in range(CPA):
                            d = v[a * CPA + e] - bm
                            bq += d * d
                        nn = an[a] + ONE_F
                        d = bm - am[a]
                        f = ONE_F / nn
                        am[a] = am[a] + d * f
                        aq[a] = aq[a] + bq + d * d * an[a] * f
                        an[a] = nn
                    p += R
            for a in range(GPC):
                shn[tid * GPC + a] = an[a]
                shm[tid * GPC + a] = am[a]
                shq[tid * GPC + a] = aq[a]
            cuda.syncthreads()
            g = tid
            while g < G:
                n1 = float32(0)
                m1 = float32(0)
                q1 = float32(0)
                if cpg >= 8:
                    a = 0
                    j0 = g * COLS_PER_G
                else:
                    j0 = (g * cpg) // 8
                    a = (g * cpg - j0 * 8) // cpg
                for rr in range(R):
                    for jj in range(COLS_PER_G):
                        k = (rr * CC + j0 + jj) * GPC + a
                        n1, m1, q1 = _merge(n1, m1, q1, shn[k], shm[k], shq[k])
                o = (n * G + g) * S + s
                part[o] = n1
                part[P + o] = m1
                part[2 * P + o] = q1
                g += TPB
            cuda.threadfence()
            cuda.syncthreads()
            if tid == 0:
                flag[0] = cuda.atomic.add(cnt, n, 1)
            cuda.syncthreads()
            if flag[0] == S - 1:                  # sample n's last chunk: its coefficients
                cuda.threadfence()
                lane = tid & 31
                g = tid >> 5                      # warp w: groups w, w + 8, ... (simulator: one warp)
                while g < G:
                    n1, m1, q1 = _group_merge(part, P, n * G + g, S, sh)
                    var = q1 / n1
                    if var < float32(0):
                        var = float32(0)
                    rstd = rsqrt(var + eps)
                    c = g * cpg + lane
                    while c < (g + 1) * cpg:
                        if W16 == 1:
                            a = rstd * bf2f(w[c])
                            bb = bf2f(b[c]) - m1 * a
                        else:
                            a = rstd * w[c]
                            bb = b[c] - m1 * a
                        if PB == 1:
                            if PB16 == 1:
                                bb += bf2f(pb[c]) * a
                            else:
                                bb += pb[c] * a
                        coef[n * C + c] = a
                        coef[N * C + n * C + c] = bb
                        c += 32
                    g += (TPB + 31) >> 5
            cuda.syncthreads()
            blk += cuda.gridDim.x

    return jit_kernel(gnh_part)


def make_norm_kernel(CC, SILU):
    def gnh_norm(xw, yw, coef, N, V, C):
        """Vectors v = V-1-i of each sample (V = H W CC per sample; i grid-strided, the stride a
        multiple of CC): y = act(x a_c + b_c) for the 8 channels of column v % CC."""
        tid = cuda.threadIdx.x
        stride = cuda.gridDim.x * cuda.blockDim.x
        i0 = cuda.blockIdx.x * cuda.blockDim.x + tid
        j = CC - 1 - (i0 % CC)
        c0 = 8 * j
        NC = N * C
        for n in range(N):
            o = n * C + c0
            a0 = coef[o]
            a1 = coef[o + 1]
            a2 = coef[o + 2]
            a3 = coef[o + 3]
            a4 = coef[o + 4]
            a5 = coef[o + 5]
            a6 = coef[o + 6]
            a7 = coef[o + 7]
            b0 = coef[NC + o]
            b1 = coef[NC + o + 1]
            b2 = coef[NC + o + 2]
            b3 = coef[NC + o + 3]
            b4 = coef[NC + o + 4]
            b5 = coef[NC + o + 5]
            b6 = coef[NC + o + 6]
            b7 = coef[NC + o + 7]
            top = (n + 1) * V - 1
            i = i0
            while i + (U - 1) * stride < V:
                t0 = ld2(xw, 2 * (top - i))
                t1 = ld2(xw, 2 * (top - i - stride))
                t2 = ld2(xw, 2 * (top - i - 2 * stride))
                t3 = ld2(xw, 2 * (top - i - 3 * stride))
                st2(yw, 2 * (top - i), _y4(t0[0], a0, a1, a2, a3, b0, b1, b2, b3, SILU),
                    _y4(t0[1], a4, a5, a6, a7, b4, b5, b6, b7, SILU))
                st2(yw, 2 * (top - i - stride), _y4(t1[0], a0, a1, a2, a3, b0, b1, b2, b3, SILU),
                    _y4(t1[1], a4, a5, a6, a7, b4, b5, b6, b7, SILU))
                st2(yw, 2 * (top - i - 2 * stride), _y4(t2[0], a0, a1, a2, a3, b0, b1, b2, b3, SILU),
                    _y4(t2[1], a4, a5, a6, a7, b4, b5, b6, b7, SILU))
                st2(yw, 2 * (top - i - 3 * stride), _y4(t3[0], a0, a1, a2, a3, b0, b1, b2, b3, SILU),
                    _y4(t3[1], a4, a5, a6, a7, b4, b5, b6, b7, SILU))
                i += U * stride
            while i < V:
                t0 = ld2(xw, 2 * (top - i))
                st2(yw, 2 * (top - i), _y4(t0[0], a0, a1, a2, a3, b0, b1, b2, b3, SILU),
                    _y4(t0[1], a4, a5, a6, a7, b4, b5, b6, b7, SILU))
                i += stride

    return jit_kernel(gnh_norm)


_launchers = {}


def _launcher(kind, *key):
    fac = {"part": make_part_kernel, "norm": make_norm_kernel}[kind]
    return launching.cached_launcher(_launchers, (kind,) + key, fac, *key)


def _chunks(N, HW, R, MAX_S):
    """Pixel chunks per sample: >= 4 blocks per SM overall, each chunk >= 8 iterations, <= MAX_S."""
    target = -(-4 * runtime.sm_count() // N)
    cap = max(1, HW // (8 * U * R))
    S = 1
    while S < target and 2 * S <= cap and 2 * S <= MAX_S:
        S *= 2
    return S


def _norm_grid(V, tpb):
    """Blocks of the normalise stream: enough for 8 blocks per SM, no more than the work needs."""
    if SIMULATOR:
        return 2
    return max(1, min(-(-V // (tpb * U)), 8 * runtime.sm_count()))


def check(x, num_groups, weight, bias, eps=1e-6, silu=True, pre_bias=None, config=None):
    why = launching.common_check(x, weight, bias, pre_bias, bf16_only=False)
    if why:
        return why
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype} (bf16 only)"
    if x.dim() != 4 or x.numel() == 0:
        return "x must be a non-empty [N, C, H, W]"
    if not x.is_contiguous(memory_format=torch.channels_last):
        return "x must be channels_last (NHWC) contiguous"
    C = x.shape[1]
    G = int(num_groups)
    tpb = (config or NHWC).tpb
    if C % 8 or C % G or C // 8 > tpb:
        return f"C={C}, groups={G}: C must be a multiple of 8 and of groups, C <= {8 * tpb}"
    cpg = C // G
    if cpg % 8 and 8 % cpg:
        return f"channels per group {cpg}: must divide 8 or be a multiple of 8"
    if x.data_ptr() % 16:
        return "x not 16-byte aligned"
    for t in (weight, bias):
        if t is None:
            return "affine weight and bias required"
        if t.dtype not in (torch.bfloat16, torch.float32) or t.dim() != 1 or t.numel() != C:
            return "weight/bias must be [C] bf16/fp32"
    if pre_bias is not None and (pre_bias.dtype not in (torch.bfloat16, torch.float32) or pre_bias.dim() != 1
                                 or pre_bias.numel() != C):
        return "pre_bias must be [C] bf16/fp32"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return "no autograd"
    return None


_PLANS = {}


def _plan(shape, G, wdt, pdt, silu, cfg):
    """Launch plan per (shape, groups, affine / pre_bias dtypes, SiLU, config): launchers, grids,
    sizes."""
    key = (shape, G, wdt, pdt, silu, cfg)
    pl = _PLANS.get(key)
    if pl is None:
        N, C, H, W = shape
        HW = H * W
        TPB = cfg.tpb
        CC, R, _, _ = _layout(C, G, TPB)
        S = _chunks(N, HW, R, cfg.max_s)
        NG = N * G
        P = NG * S
        PB, PB16 = (0, 0) if pdt is None else (1, 1 if pdt == torch.bfloat16 else 0)
        tpb = (TPB // CC) * CC
        V = HW * CC
        nblk = N * S
        pl = (_launcher("part", C, G, PB, PB16, 1 if wdt == torch.bfloat16 else 0, TPB),
              min(nblk, 2) if SIMULATOR else nblk,
              _launcher("norm", CC, 1 if silu else 0), _norm_grid(V, tpb), tpb, (HW, S, P, N), (N, V, C),
              3 * P, 2 * N * C, TPB)
        if len(_PLANS) > 512:
            _PLANS.clear()
        _PLANS[key] = pl
    return pl


def groupnorm_silu_nhwc_numba(x, num_groups, weight, bias, eps=1e-6, silu=True, pre_bias=None, config=None):
    """``config``: an NhwcConfig (benchmarks / tests; ``tpb``, ``max_s`` used), else ``config.NHWC``."""
    if weight.dtype != bias.dtype:
        weight, bias = weight.float(), bias.float()
    lp, gp, ln, gn, tpb, ap, an, npart, ncoef, TPB = _plan(
        tuple(x.shape), int(num_groups), weight.dtype, None if pre_bias is None else pre_bias.dtype, bool(silu),
        config or NHWC)
    buf = torch.empty(npart + ncoef, device=x.device, dtype=torch.float32)
    part, coef = buf[:npart], buf[npart:]
    cnt = torch.zeros(x.shape[0], device=x.device, dtype=torch.int32)   # chunk tickets per sample
    y = torch.empty_like(x, memory_format=torch.channels_last)
    xw, yw = launching.nhwc_words(x), launching.nhwc_words(y)
    pb = weight if pre_bias is None else pre_bias               # (a placeholder of the same kind when unused)
    lp(gp, TPB, xw, pb, part, cnt, weight, bias, coef, *ap, np.float32(eps))
    ln(gn, tpb, xw, yw, coef, *an)
    return y


registry.register_backend(OP, "numba", groupnorm_silu_nhwc_numba, check=check, priority=10)
