"""GroupNorm (affine) + optional SiLU for the VAE decoder's NCHW activations.

``groupnorm_silu(x, num_groups, weight, bias, eps, silu=True)``
  x: [N, C, *spatial] contiguous, bf16 or fp32; weight/bias [C] (bf16 or fp32); returns a new
  tensor in x's dtype = ``silu(group_norm(x))`` (or just ``group_norm(x)`` when silu=False).
  This is ComfyUI's ``Normalize`` (GroupNorm 32, eps 1e-6, affine) followed by ``swish`` /
  ``nonlinearity`` in ResnetBlock and Decoder.norm_out, i.e. the input of the next conv3x3.

Layout fact used: in contiguous NCHW one (sample, group) is ONE contiguous run of
L = (C/G) * H * W elements, and one (sample, channel) plane is a contiguous run of H*W.

Numba backend, two launches through ``launching.Launcher`` (fast path: no as_cuda_array, no
argument typing; configured per kernel variant; plan per shape cached):
  1. ``gn_stats``: each group run is cut into S chunks (S a power of two, <= 128, chosen so
     N*G*S >= 8 blocks per SM when the run is long enough); one block per chunk.  Per
     iteration every thread issues U=4 independent 16-byte loads (``ld.global.v2.u64``: 8 bf16
     each, 64 B per thread, 16 KB per 256-thread block in flight) BEFORE any math, then folds
     the exact two-pass mean/M2 of those 32 values into its running (n, mean, M2) with one
     branch-free Chan update (no E[x^2]-E[x]^2 cancellation).  Block merge: warp shuffles
     (5 Chan steps) + one shared-memory step.  Partials: fp32 SoA [3, N*G*S].
  2. ``gn_norm``: one block per (plane = (n, c), slice of <= 8 iterations of that plane); work
     items in reverse order (the tail of x the stats pass left in the 50 MB L2 is re-read
     first).  Every warp merges its group's S partials itself with shuffles (no barrier, same
     order in every warp -> identical result), so a = rstd*w[c], b = bias[c] - mean*a are two
     registers; the loop is then a pure stream: 4 x 16-byte loads, y = x*a + b, SiLU as
     y * rcp(1 + ex2(-y*log2e)) (2 MUFU ops), two ``cvt.rn.bf16x2.f32`` per 8 values (RNE),
     one 16-byte store.  No division, no channel bookkeeping per element.
  Fallbacks, same kernels specialised at compile time: 8-byte words when H*W % 8 != 0 but
  % 4 == 0 (bf16) or x is only 8-byte aligned; scalar elements (odd spatial sizes).
  Simulator: warp shuffles replaced by a shared-memory tree, ex2/rcp by math, grid 2 blocks.

Bytes moved: read x twice + write y once = 3 * numel * itemsize (+ tiny partials).
  [1,128,1024,1024] bf16: 3 * 268 MB = 805 MB -> floor 218 us at 3.7 TB/s.
  [1,256,1024,1024] bf16: 1.61 GB -> 435 us.   [1,512,512,512]: 805 MB -> 218 us.
  [1,512,256,256]:  201 MB -> 54 us.            [1,512,128,128]: 50 MB -> 14 us (x fits in
  L2, so the second read is mostly an L2 hit and the kernel can beat that "floor").
  The FLUX decoder runs 30 calls per decode (2 per ResnetBlock x 14, norm_out, one silu=False
  for the mid attention): x sizes sum to 3.5 GB, i.e. 10.5 GB traffic, floor ~2.85 ms.

Why the previous version was slow, and predictions for this one (H200):
  * host: 292 us/call (two lazily typed numba launches, 2-3 as_cuda_array, a partials cache
    lookup) -> now ~40-60 us/call (two fast-path launches ~15 us each, 2 torch.empty, views,
    the registry's check).  Small shapes were host-bound: 512x128^2 0.54 ms -> expect
    <= 0.06 ms per call with events around a single call, ~0.02-0.03 ms device time.
  * device, big shapes: ptxas (sm_90) said 47 / 56 registers for the old stats / normalize
    kernels -> 5 / 4 blocks of 256 per SM with 32 B in flight per thread = 32-40 KB per SM
    (the old split said stats 2.07 / normalize 2.44 TB/s, but it timed single calls, host
    launch latency included, so the device rate is unknown).  Now
    64 B per thread in flight (16-byte loads, 4 per thread) with the register counts in
    ``PTXAS`` below -> 64-96 KB per SM.  Caveat: the old per-shape table timed ONE call between
    events, i.e. mostly host latency; its profiler total (3.2 ms of GroupNorm kernels for
    10.5 GB in the decoder, ~3.3 TB/s) says the old kernels were already near 85% of copy on
    the big shapes.  Prediction (device time, bench/ops/gpu_vae.py "dev ms"): stats ~3.4 TB/s,
    normalize ~3.3 TB/s: 128x1024^2 and 512x512^2 ~0.24-0.26 ms (85-92% of copy), 256x1024^2
    ~0.48-0.50 ms, 512x256^2 ~0.06-0.07 ms, 512x128^2 ~0.015-0.02 ms (L2-resident second
    read), odd 2x128x97x131 (element path) ~0.02-0.03 ms.  Host ~40-60 us/call.
  * decoder 1024^2: GroupNorm kernels ~3.0-3.2 ms device; the ~5.8 ms of host gaps seen in run
    5 (41.96 ms wall vs 36.18 ms of kernels) mostly disappear -> expect ~36.5-38 ms (bar: 40).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from . import launching
from .jit import NUMBA_OK, jit_kernel
from .device import wrap_i64
from . import runtime
from .registry import registry
from .config import GROUPNORM
# module globals (not closure cells): the simulator swaps `cuda` per thread, and the on-disk
# cache key of a kernel then only hashes the factory's int constants
from .device import cuda, float32, int64, unpack4, unpack_f32x2, bf2f, pack4, pack1, ld2, st2, rsqrt  # noqa: F401

OP = "groupnorm_silu"
SIMULATOR = runtime.SIMULATOR
# threads per block TPB and slots per thread per iteration U: config.GroupNormConfig
# ptxas (CUDA 13.0, -arch=sm_90) on the PTX numba-cuda 0.30.4 emits for every variant: no spills,
# no stack frame.  bf16 16-byte path: stats 56 registers (4 blocks of 256 per SM -> 64 KB of
# loads in flight per SM), normalize 40 (silu) / 44 (no silu) -> 6 / 5 blocks per SM, 96 / 80 KB.
# fp32 16-byte: stats 38, normalize 38-40.  (Run 5's kernels: 47 and 56 registers, 32 B per
# thread -> 40 / 32 KB in flight per SM.)
PTXAS = {"stats_bf16": 56, "norm_bf16_silu": 40, "norm_bf16": 44, "stats_f32": 38, "norm_f32": 40}


def reference(x, num_groups, weight, bias, eps: float = 1e-6, silu: bool = True):
    """ComfyUI's math: ``F.group_norm`` then ``F.silu``, both in x's dtype."""
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if silu else y


registry.register(OP, reference, doc=__doc__)


# ---------------------------------------------------------------------------------- device helpers
if not NUMBA_OK:  # pragma: no cover - the torch reference still works
    _silu = _f32pair = None  # (the kernel factories are never called: check() declines)

elif SIMULATOR:
    import struct

    _F32 = np.float32

    def _silu(y):
        y = float(y)
        if y >= 0.0:
            return _F32(y / (1.0 + math.exp(-y)))
        e = math.exp(y)
        return _F32(y * e / (1.0 + e))

    def _f32pair(a, b):
        lo = struct.unpack("<I", struct.pack("<f", float(_F32(a))))[0]
        hi = struct.unpack("<I", struct.pack("<f", float(_F32(b))))[0]
        return wrap_i64(lo | (hi << 32))

    _dev = cuda.jit(device=True)

else:
    from llvmlite import ir as _ir
    from numba import types as _nbt
    from numba.cuda.extending import intrinsic as _intrinsic
    from .device import _ex2, _rcp  # noqa: F401  (GPU-only helpers: ex2.approx, rcp.approx)

    _dev = cuda.jit(device=True, forceinline=True)

    @_intrinsic
    def _f32pair(typingctx, a, b):
        """Two float32 -> one int64 word (a in the low 32 bits)."""
        if not all(isinstance(t, _nbt.Float) for t in (a, b)):
            return None
        sig = _nbt.int64(a, b)

        def codegen(context, builder, sig, args):
            i32, i64 = _ir.IntType(32), _ir.IntType(64)
            f = [context.cast(builder, v, t, _nbt.float32) for v, t in zip(args, sig.args)]
            lo = builder.zext(builder.bitcast(f[0], i32), i64)
            hi = builder.zext(builder.bitcast(f[1], i32), i64)
            return builder.or_(lo, builder.shl(hi, _ir.Constant(i64, 32)))
        return sig, codegen

    @_dev
    def _silu(y):
        """y * sigmoid(y) = y * rcp(1 + 2^(-y*log2 e)); y -> -inf gives y * 0 = -0."""
        return y * _rcp(float32(1) + _ex2(y * float32(-1.4426950408889634)))


if NUMBA_OK:
    @_dev
    def _merge(na, ma, qa, nb, mb, qb):
        """Chan et al.: (count, mean, M2) of the union; either side may be empty."""
        n = na + nb
        if nb == float32(0):
            return na, ma, qa
        if na == float32(0):
            return nb, mb, qb
        d = mb - ma
        f = nb / n
        return n, ma + d * f, qa + qb + d * d * na * f

    @_dev
    def _wsum(w, x16):
        """Sum of the values of one int64 word (x16: 4 bf16, else 2 fp32)."""
        if x16 == 1:
            t = unpack4(w)
            return (t[0] + t[1]) + (t[2] + t[3])
        t = unpack_f32x2(w)
        return t[0] + t[1]

    @_dev
    def _wsq(w, m, x16):
        """Sum of squared deviations from m of the values of one word."""
        if x16 == 1:
            t = unpack4(w)
            d0 = t[0] - m
            d1 = t[1] - m
            d2 = t[2] - m
            d3 = t[3] - m
            return (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3)
        t = unpack_f32x2(w)
        d0 = t[0] - m
        d1 = t[1] - m
        return d0 * d0 + d1 * d1

    @_dev
    def _act(y, silu):
        if silu == 1:
            return _silu(y)
        return y

    @_dev
    def _yword(w, a, b, x16, silu):
        """One word of x -> the word of y = act(x*a + b), RNE-rounded to bf16 when x16."""
        if x16 == 1:
            t = unpack4(w)
            return pack4(_act(t[0] * a + b, silu), _act(t[1] * a + b, silu),
                         _act(t[2] * a + b, silu), _act(t[3] * a + b, silu))
        t = unpack_f32x2(w)
        return _f32pair(_act(t[0] * a + b, silu), _act(t[1] * a + b, silu))

if NUMBA_OK and SIMULATOR:
    @_dev
    def _block_merge(n, m, q, sh):
        """Merge over the block (shared-memory tree, blockDim a power of 2); every thread
        gets the result.  sh: shared float32[3 * blockDim]."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        sh[tid] = n
        sh[nt + tid] = m
        sh[2 * nt + tid] = q
        cuda.syncthreads()
        step = nt // 2
        while step > 0:
            if tid < step:
                r = _merge(sh[tid], sh[nt + tid], sh[2 * nt + tid],
                           sh[tid + step], sh[nt + tid + step], sh[2 * nt + tid + step])
                sh[tid] = r[0]
                sh[nt + tid] = r[1]
                sh[2 * nt + tid] = r[2]
            cuda.syncthreads()
            step //= 2
        n = sh[0]
        m = sh[nt]
        q = sh[2 * nt]
        cuda.syncthreads()
        return n, m, q

    @_dev
    def _group_merge(part, P, gi, S, sh):
        """(count, mean, M2) of group gi from its S partials, in every thread."""
        n = float32(0)
        m = float32(0)
        q = float32(0)
        j = cuda.threadIdx.x
        while j < S:
            k = gi * S + j
            n, m, q = _merge(n, m, q, part[k], part[P + k], part[2 * P + k])
            j += cuda.blockDim.x
        return _block_merge(n, m, q, sh)

elif NUMBA_OK:
    _FULL = 0xFFFFFFFF

    @_dev
    def _warp_merge(n, m, q):
        """Butterfly Chan merge over the warp (lanes may differ in the last ulp)."""
        off = 16
        while off > 0:
            n2 = cuda.shfl_xor_sync(_FULL, n, off)
            m2 = cuda.shfl_xor_sync(_FULL, m, off)
            q2 = cuda.shfl_xor_sync(_FULL, q, off)
            n, m, q = _merge(n, m, q, n2, m2, q2)
            off >>= 1
        return n, m, q

    @_dev
    def _block_merge(n, m, q, sh):
        """Merge over the block; the result is valid in thread 0.  sh: shared float32[96]."""
        tid = cuda.threadIdx.x
        lane = tid & 31
        w = tid >> 5
        n, m, q = _warp_merge(n, m, q)
        if lane == 0:
            sh[w] = n
            sh[32 + w] = m
            sh[64 + w] = q
        cuda.syncthreads()
        if w == 0:
            if lane < ((cuda.blockDim.x + 31) >> 5):
                n = sh[lane]
                m = sh[32 + lane]
                q = sh[64 + lane]
            else:
                n = float32(0)
                m = float32(0)
                q = float32(0)
            n, m, q = _warp_merge(n, m, q)
        cuda.syncthreads()
        return n, m, q

    @_dev
    def _group_merge(part, P, gi, S, sh):
        """(count, mean, M2) of group gi from its S partials, computed by every warp on its own
        (same order in every warp: identical results; no barrier), lane 0's value broadcast."""
        lane = cuda.threadIdx.x & 31
        n = float32(0)
        m = float32(0)
        q = float32(0)
        j = lane
        while j < S:
            k = gi * S + j
            n, m, q = _merge(n, m, q, part[k], part[P + k], part[2 * P + k])
            j += 32
        n, m, q = _warp_merge(n, m, q)
        return (cuda.shfl_sync(_FULL, n, 0), cuda.shfl_sync(_FULL, m, 0), cuda.shfl_sync(_FULL, q, 0))


# ---------------------------------------------------------------------------------- kernels
def _mode_consts(X16, MODE):
    """(words per slot, values per slot).  MODE 2: 16-byte slots (2 int64 words), 1: one int64
    word, 0: one element (int16 bf16 bits or float32)."""
    EPW = 4 if X16 else 2
    if MODE == 2:
        return 2, 2 * EPW
    if MODE == 1:
        return 1, EPW
    return 1, 1


def _shared(TPB):
    """Shared floats of one block merge."""
    return 3 * TPB if SIMULATOR else 96


def make_stats_kernel(X16, MODE, TPB, U):
    VW, VPS = _mode_consts(X16, MODE)
    SH = _shared(TPB)
    NWD = U * VW  # words (or elements) loaded per thread per iteration
    KF = float32(U * VPS)
    INV_K = float32(1.0 / (U * VPS))
    K1F = float32(VPS)
    INV_K1 = float32(1.0 / VPS)

    def gn_stats(xw, part, Ls, S, P):
        """Work item blk = (group blk // S, chunk blk % S) -> part[blk], part[P+blk], part[2P+blk]
        = (count, mean, M2) of that chunk.  xw: slots of x (see _mode_consts)."""
        sh = cuda.shared.array(SH, float32)
        wv = cuda.local.array(NWD, int64)
        fv = cuda.local.array(U, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        blk = cuda.blockIdx.x
        while blk < P:
            gi = blk // S
            s = blk - gi * S
            base = gi * Ls
            lo = base + (s * Ls) // S
            hi = base + ((s + 1) * Ls) // S
            n = float32(0)
            m = float32(0)
            q = float32(0)
            i = lo + tid
            while i + (U - 1) * nt < hi:
                # all U loads first (independent, in flight together), then the math
                for k in range(U):
                    j = i + k * nt
                    if MODE == 2:
                        t2 = ld2(xw, 2 * j)
                        wv[2 * k] = t2[0]
                        wv[2 * k + 1] = t2[1]
                    elif MODE == 1:
                        wv[k] = xw[j]
                    elif X16 == 1:
                        fv[k] = bf2f(xw[j])
                    else:
                        fv[k] = xw[j]
                s1 = float32(0)
                if MODE == 0:
                    for k in range(U):
                        s1 += fv[k]
                else:
                    for k in range(NWD):
                        s1 += _wsum(wv[k], X16)
                bm = s1 * INV_K
                bq = float32(0)
                if MODE == 0:
                    for k in range(U):
                        d = fv[k] - bm
                        bq += d * d
                else:
                    for k in range(NWD):
                        bq += _wsq(wv[k], bm, X16)
                nn = n + KF  # branch-free Chan update (the batch is never empty)
                d = bm - m
                f = KF / nn
                m = m + d * f
                q = q + bq + d * d * n * f
                n = nn
                i += U * nt
            while i < hi:  # < U slots left for this thread
                if MODE == 2:
                    t2 = ld2(xw, 2 * i)
                    s1 = _wsum(t2[0], X16) + _wsum(t2[1], X16)
                    bm = s1 * INV_K1
                    bq = _wsq(t2[0], bm, X16) + _wsq(t2[1], bm, X16)
                elif MODE == 1:
                    w0 = xw[i]
                    bm = _wsum(w0, X16) * INV_K1
                    bq = _wsq(w0, bm, X16)
                else:
                    if X16 == 1:
                        bm = bf2f(xw[i])
                    else:
                        bm = float32(xw[i])
                    bq = float32(0)
                nn = n + K1F
                d = bm - m
                f = K1F / nn
                m = m + d * f
                q = q + bq + d * d * n * f
                n = nn
                i += nt
            n, m, q = _block_merge(n, m, q, sh)
            if tid == 0:
                part[blk] = n
                part[P + blk] = m
                part[2 * P + blk] = q
            blk += cuda.gridDim.x

    return jit_kernel(gn_stats)


def make_norm_kernel(X16, MODE, SILU, W16, TPB, U):
    VW, VPS = _mode_consts(X16, MODE)
    SH = _shared(TPB)
    NWD = U * VW

    def gn_norm(xw, yw, part, w, b, HWs, C, cpg, S, P, T, nper, nwork, eps):
        """Work item k = nwork-1-blk -> plane p = k // nper (= n*C + c), slots
        [p*HWs + (k % nper)*T, ... + T) clipped to the plane: y = act(x * a_c + b_c)."""
        sh = cuda.shared.array(SH, float32)
        wv = cuda.local.array(NWD, int64)
        fv = cuda.local.array(U, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        blk = cuda.blockIdx.x
        while blk < nwork:
            k = nwork - 1 - blk  # reverse: the end of x is still in L2 after the stats pass
            p = k // nper
            t = k - p * nper
            gi = p // cpg
            c = p - (p // C) * C
            n, m, q = _group_merge(part, P, gi, S, sh)
            var = q / n
            if var < float32(0):
                var = float32(0)
            rstd = rsqrt(var + eps)
            if W16 == 1:
                a = rstd * bf2f(w[c])
                bb = bf2f(b[c]) - m * a
            else:
                a = rstd * w[c]
                bb = b[c] - m * a
            pb = p * HWs
            lo = pb + t * T
            hi = lo + T
            if hi > pb + HWs:
                hi = pb + HWs
            i = lo + tid
            while i + (U - 1) * nt < hi:
                for kk in range(U):  # loads first
                    j = i + kk * nt
                    if MODE == 2:
                        t2 = ld2(xw, 2 * j)
                        wv[2 * kk] = t2[0]
                        wv[2 * kk + 1] = t2[1]
                    elif MODE == 1:
                        wv[kk] = xw[j]
                    elif X16 == 1:
                        fv[kk] = bf2f(xw[j])
                    else:
                        fv[kk] = xw[j]
                for kk in range(U):
                    j = i + kk * nt
                    if MODE == 2:
                        st2(yw, 2 * j, _yword(wv[2 * kk], a, bb, X16, SILU),
                            _yword(wv[2 * kk + 1], a, bb, X16, SILU))
                    elif MODE == 1:
                        yw[j] = _yword(wv[kk], a, bb, X16, SILU)
                    elif X16 == 1:
                        yw[j] = pack1(_act(fv[kk] * a + bb, SILU))
                    else:
                        yw[j] = _act(fv[kk] * a + bb, SILU)
                i += U * nt
            while i < hi:
                if MODE == 2:
                    t2 = ld2(xw, 2 * i)
                    st2(yw, 2 * i, _yword(t2[0], a, bb, X16, SILU), _yword(t2[1], a, bb, X16, SILU))
                elif MODE == 1:
                    yw[i] = _yword(xw[i], a, bb, X16, SILU)
                elif X16 == 1:
                    yw[i] = pack1(_act(bf2f(xw[i]) * a + bb, SILU))
                else:
                    yw[i] = _act(float32(xw[i]) * a + bb, SILU)
                i += nt
            blk += cuda.gridDim.x

    return jit_kernel(gn_norm)


# ---------------------------------------------------------------------------------- host side
_launchers = {}


def _launcher(kind, *key):
    fac = make_stats_kernel if kind == "stats" else make_norm_kernel
    return launching.cached_launcher(_launchers, (kind,) + key, fac, *key)


def _pow2_at_least(v):
    p = 1
    while p < v:
        p *= 2
    return p


def _chunks(NG, Ls, per_iter):
    """Stats chunks per group: a power of two <= 128 with N*G*S >= 8 blocks per SM (2 waves at
    the 4 blocks/SM its 56 registers allow), each chunk at least one iteration (per_iter slots)."""
    iters = -(-Ls // per_iter)
    target = 8 * runtime.sm_count()
    S = 1
    while S < 128 and NG * S < target and 2 * S <= iters:
        S *= 2
    if SIMULATOR:
        S = min(S, 2)
    return S


def _tiles(NP, HWs, per_iter):
    """(T slots per normalize work item, items per plane): T a power-of-two number (<= 8) of
    iterations, >= 16 blocks per SM overall when the planes are long enough."""
    iters = -(-HWs // per_iter)
    want = max(1, -(-16 * runtime.sm_count() // NP))  # items per plane wanted
    ipb = min(8, _pow2_at_least(-(-iters // want)))
    if SIMULATOR:  # fewer work items (each pays a barrier-heavy merge in the simulator)
        ipb = _pow2_at_least(iters)
    nper = -(-iters // ipb)
    return ipb * per_iter, nper


def _mode(x, HW):
    """2: 16-byte slots, 1: 8-byte words, 0: elements."""
    epw = 4 if x.dtype == torch.bfloat16 else 2
    ptr = x.data_ptr()
    if HW % (2 * epw) == 0 and ptr % 16 == 0:
        return 2
    if HW % epw == 0 and ptr % 8 == 0:
        return 1
    return 0


_PLANS = {}


def _plan(x, G, wdt, silu, eps, cfg):
    N, C = x.shape[0], x.shape[1]
    HW = x.numel() // (N * C)
    mode = _mode(x, HW)
    key = (tuple(x.shape), x.dtype, G, wdt, bool(silu), float(eps), mode, cfg)
    pl = _PLANS.get(key)
    if pl is not None:
        return pl
    x16 = 1 if x.dtype == torch.bfloat16 else 0
    VW, VPS = _mode_consts(x16, mode)
    cpg = C // G
    HWs = HW // VPS
    Ls = cpg * HWs
    NG = N * G
    TPB, U = cfg.tpb, cfg.u
    per_iter = U * TPB
    S = _chunks(NG, Ls, per_iter)
    P = NG * S
    T, nper = _tiles(N * C, HWs, per_iter)
    nwork = N * C * nper
    w16 = 1 if wdt == torch.bfloat16 else 0
    g1 = min(P, 2) if SIMULATOR else P
    g2 = min(nwork, 2) if SIMULATOR else nwork
    pl = (mode, _launcher("stats", x16, mode, TPB, U), _launcher("norm", x16, mode, 1 if silu else 0, w16, TPB, U),
          g1, g2, (Ls, S, P), (HWs, C, cpg, S, P, T, nper, nwork, np.float32(eps)), 3 * P, TPB)
    if len(_PLANS) > 1024:
        _PLANS.clear()
    _PLANS[key] = pl
    return pl


def check(x, num_groups, weight, bias, eps=1e-6, silu=True, config=None):
    why = runtime.device_ok(x, weight, bias)
    if why:
        return why
    if not NUMBA_OK:
        return "numba not importable"
    if x.dtype not in (torch.bfloat16, torch.float32):
        return f"x dtype {x.dtype} (bf16/fp32 only)"
    if x.dim() < 2 or x.numel() == 0:
        return "x must be [N, C, ...] and non-empty"
    if not x.is_contiguous():
        return "x must be contiguous (NCHW)"
    C = x.shape[1]
    if C % num_groups:
        return "channels not divisible by groups"
    for t in (weight, bias):
        if t is None:
            return "affine weight and bias required"
        if t.dtype not in (torch.bfloat16, torch.float32) or t.dim() != 1 or t.numel() != C:
            return "weight/bias must be [C] bf16/fp32"
        if t.device != x.device:
            return "weight/bias on another device"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return "no autograd"
    if x.numel() // (x.shape[0] * num_groups) >= 2 ** 31:
        return "group too large"
    return None


def _prepare(x, num_groups, weight, bias, eps, silu, cfg):
    if weight.dtype != bias.dtype:
        weight, bias = weight.float(), bias.float()
    mode, ls, ln, g1, g2, a1, a2, npart, tpb = _plan(x, int(num_groups), weight.dtype, silu, eps, cfg)
    y = torch.empty_like(x)
    part = torch.empty(npart, device=x.device, dtype=torch.float32)
    if mode:
        xv = x.view(-1).view(torch.int64)
        yv = y.view(-1).view(torch.int64)
    else:
        xv = x.view(-1)
        yv = y.view(-1)
    return y, tpb, (ls, g1, (xv, part) + a1), (ln, g2, (xv, yv, part, weight, bias) + a2)


def plan(x, num_groups, weight, bias, eps=1e-6, silu=True, config=None):
    """(y, run_stats, run_norm): the output and the two configured launches (bench hook)."""
    y, tpb, (ls, g1, s_args), (ln, g2, n_args) = _prepare(x, num_groups, weight, bias, eps, silu, config or GROUPNORM)
    return y, (lambda: ls(g1, tpb, *s_args)), (lambda: ln(g2, tpb, *n_args))


def groupnorm_silu_numba(x, num_groups, weight, bias, eps=1e-6, silu=True, config=None):
    """``config``: a GroupNormConfig (benchmarks / tests), else ``config.GROUPNORM``."""
    y, tpb, (ls, g1, s_args), (ln, g2, n_args) = _prepare(x, num_groups, weight, bias, eps, silu, config or GROUPNORM)
    ls(g1, tpb, *s_args)
    ln(g2, tpb, *n_args)
    return y


registry.register_backend(OP, "numba", groupnorm_silu_numba, check=check, priority=10)
