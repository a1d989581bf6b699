"""GroupNorm (affine) + optional SiLU for the VAE decoder's NCHW activations.

``groupnorm_silu(x, num_groups, weight, bias, eps, silu=True)``
  x: [N, C, *spatial] contiguous, bf16 or fp32; weight/bias [C] (bf16 or fp32); returns a new
  tensor in x's dtype = ``silu(group_norm(x))`` (or just ``group_norm(x)`` when silu=False).
  This is ComfyUI's ``Normalize`` (GroupNorm 32, eps 1e-6, affine) followed by ``swish`` /
  ``nonlinearity`` in ResnetBlock and Decoder.norm_out, i.e. the input of the next conv3x3.

Layout fact used: in contiguous NCHW one (sample, group) is ONE contiguous run of
L = (C/G) * H * W elements (4 channels x 1M pixels = 4M elements at 1024^2 / 128 ch), and
a run of V aligned elements never crosses a channel when H*W % V == 0.

Numba backend, two launches:
  1. ``_stats``: the N*G runs are cut into S chunks each (S a power of two chosen so that
     ~8 blocks per SM exist); every block reduces its chunk to (count, mean, M2) with Chan's
     parallel (Welford) update -- per 4 loaded 8-byte vectors: exact two-pass mean/M2 of
     their 16 (bf16) or 8 (fp32) values in registers, then one branch-free merge into the
     thread's running (n, mean, M2); threads merge through a shared-memory tree.  Numerically safe for a large common offset (no
     E[x^2]-E[x]^2 cancellation).  Partials: fp32 [N*G*S, 3].
  2. ``_norm``: each block first merges its group's S partials (finalize, fused: no third
     launch; work items in reverse order so the tail the stats pass left in L2 is re-read
     first), builds per-channel a = rstd*w, b = bias - mean*a in shared memory, then streams
     its chunk: y = x*a + b, SiLU (fastmath exp), round-to-nearest-even bf16 (one
     ``cvt.rn.bf16x2.f32`` per pair via inline PTX; simulator: numpy), 8-byte stores.
  Loads/stores are 8-byte (int64 view: 4 bf16 or 2 fp32), 4 independent loads in flight per
  thread; odd spatial sizes (H*W % V != 0) use a scalar variant of the same kernels.

Bytes moved: read x twice + write y once = 3 * numel * itemsize (+ tiny partials).
  [1,128,1024,1024] bf16: 3 * 256 MiB = 805 MB -> floor 218 us at 3.7 TB/s copy bandwidth.
  [1,512,128,128]   bf16: 3 * 16 MiB = 50 MB  -> floor 13.6 us (the second read of x mostly
  hits the 50 MB L2, so it can beat the "floor").
  The FLUX decoder runs 30 calls per decode: 2 per ResnetBlock x 14, norm_out, and one
  silu=False (mid attention norm).  At 1024^2 that is ~11 GB of bf16 traffic in all
  (floor ~3.0 ms at 3.7 TB/s; stock spends ~45 ms in GroupNorm) -- bench/gpu_vae.py
  prints the per-shape table.
Goal: >= 85% of copy bandwidth for these bytes on the large shapes.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from .registry import registry
from . import runtime

try:  # kernels need numba's ``cuda`` as a module global (the simulator swaps it per kernel)
    from numba import cuda, float32, int32, int64, uint64
except Exception:  # pragma: no cover - numba missing: the torch reference still works
    cuda = None

OP = "groupnorm_silu"

MAX_CPG = 64  # channels per group held in shared memory (C <= 2048 with 32 groups)


def reference(x, num_groups, weight, bias, eps: float = 1e-6, silu: bool = True):
    """ComfyUI's math: ``F.group_norm`` then ``F.silu``, both in x's dtype."""
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if silu else y


registry.register(OP, reference, doc=__doc__)


# ---------------------------------------------------------------------------------- numba
_SUPPORTED = (torch.bfloat16, torch.float32)


def _tpb() -> int:
    return 8 if runtime.SIMULATOR else 256


def _bitcast_helpers():
    """(f32_from_bits(int), bits_from_f32(float)) device functions; simulator-safe."""
    if runtime.SIMULATOR:
        def f32_from_bits(u):
            return np.array([int(u) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

        def bits_from_f32(f):  # unsigned 32-bit value as int64
            return np.int64(np.array([f], dtype=np.float32).view(np.uint32)[0])

        def pack2(lo, hi):  # two 32-bit halves -> int64
            v = (int(lo) & 0xFFFFFFFF) | ((int(hi) & 0xFFFFFFFF) << 32)
            return np.int64(v - (1 << 64) if v >= (1 << 63) else v)

        return cuda.jit(device=True)(f32_from_bits), cuda.jit(device=True)(bits_from_f32), cuda.jit(device=True)(pack2)

    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def f32_from_bits(u):
        return libdevice.int_as_float(int32(u))

    @cuda.jit(device=True, inline=True)
    def bits_from_f32(f):
        return int64(libdevice.float_as_int(f)) & 0xFFFFFFFF

    @cuda.jit(device=True, inline=True)
    def pack2(lo, hi):
        return (int64(lo) & 0xFFFFFFFF) | (int64(hi) << 32)

    return f32_from_bits, bits_from_f32, pack2


def _cvt_bf16x2():
    """cvt_bf16x2(hi, lo) -> int32 holding bf16(hi) << 16 | bf16(lo), round-to-nearest-even.

    GPU: one ``cvt.rn.bf16x2.f32`` (sm_80+) through llvmlite inline PTX; simulator: numpy."""
    if runtime.SIMULATOR:
        def rne(f):
            u = int(np.array([f], dtype=np.float32).view(np.uint32)[0])
            if (u & 0x7FFFFFFF) > 0x7F800000:
                return 0x7FC0
            return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

        def cvt_bf16x2(hi, lo):
            v = (rne(hi) << 16) | rne(lo)
            return v - (1 << 32) if v >= (1 << 31) else v
        return cuda.jit(device=True)(cvt_bf16x2)

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def cvt_bf16x2(typingctx, hi, lo):
        sig = types.int32(types.float32, types.float32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
            asm = ir.InlineAsm(fnty, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, list(args))
        return sig, codegen

    return cvt_bf16x2


@functools.lru_cache(maxsize=None)
def _kernels(x16: bool, vec: bool, silu: bool, w16: bool, tpb: int):
    """Compile-time specialised (stats, norm) kernels.

    x16: x/y are bf16 (else fp32); vec: 8-byte vectors (x viewed as int64), else scalar
    elements (int16 bits / float32); w16: weight/bias are bf16 bits (int16) else float32.
    """
    f32_from_bits, bits_from_f32, pack2 = _bitcast_helpers()
    cvt_bf16x2 = _cvt_bf16x2()
    V = (4 if x16 else 2) if vec else 1
    VF = float32(V)
    VF4 = float32(4 * V)
    INV_4V = float32(1.0 / (4 * V))
    INV_V = float32(1.0 / V)
    ONE = float32(1.0)
    ZERO = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def bf16_to_f32(h):  # h: bf16 bits in the low 16 bits of an integer
        return f32_from_bits((int64(h) & 0xFFFF) << 16)

    @cuda.jit(device=True, inline=True)
    def f32_to_bf16(f):  # round to nearest even; quiet NaN
        u = bits_from_f32(f)
        if (u & 0x7FFFFFFF) > 0x7F800000:
            return int64(0x7FC0)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

    # ---- element access: load(xa, i) -> UniTuple(float32, V); store(ya, i, t, a, b)
    if vec and x16:
        @cuda.jit(device=True, inline=True)
        def load(xa, i):
            v = xa[uint64(i)]
            return (bf16_to_f32(v), bf16_to_f32(v >> 16), bf16_to_f32(v >> 32), bf16_to_f32(v >> 48))
    elif vec:
        @cuda.jit(device=True, inline=True)
        def load(xa, i):
            v = xa[uint64(i)]
            return (f32_from_bits(v & 0xFFFFFFFF), f32_from_bits((v >> 32) & 0xFFFFFFFF))
    elif x16:
        @cuda.jit(device=True, inline=True)
        def load(xa, i):
            return (bf16_to_f32(xa[uint64(i)]),)
    else:
        @cuda.jit(device=True, inline=True)
        def load(xa, i):
            return (float32(xa[uint64(i)]),)

    if silu:
        @cuda.jit(device=True, inline=True)
        def act(y):
            return y / (ONE + math.exp(-y))
    else:
        @cuda.jit(device=True, inline=True)
        def act(y):
            return y

    if vec and x16:
        @cuda.jit(device=True, inline=True)
        def store(ya, i, t, a, b):
            lo = cvt_bf16x2(act(t[1] * a + b), act(t[0] * a + b))
            hi = cvt_bf16x2(act(t[3] * a + b), act(t[2] * a + b))
            ya[uint64(i)] = pack2(lo, hi)
    elif vec:
        @cuda.jit(device=True, inline=True)
        def store(ya, i, t, a, b):
            ya[uint64(i)] = pack2(bits_from_f32(act(t[0] * a + b)), bits_from_f32(act(t[1] * a + b)))
    elif x16:
        @cuda.jit(device=True, inline=True)
        def store(ya, i, t, a, b):
            r = f32_to_bf16(act(t[0] * a + b))
            ya[uint64(i)] = r - 0x10000 if r >= 0x8000 else r
    else:
        @cuda.jit(device=True, inline=True)
        def store(ya, i, t, a, b):
            ya[uint64(i)] = act(t[0] * a + b)

    if w16:
        @cuda.jit(device=True, inline=True)
        def wload(w, c):
            return bf16_to_f32(w[c])
    else:
        @cuda.jit(device=True, inline=True)
        def wload(w, c):
            return float32(w[c])

    @cuda.jit(device=True, inline=True)
    def vstats(t):  # exact mean / M2 of the V values of one vector
        s = ZERO
        for k in range(V):
            s += t[k]
        m = s * INV_V
        q = ZERO
        for k in range(V):
            d = t[k] - m
            q += d * d
        return m, q

    @cuda.jit(device=True, inline=True)
    def merge(na, ma, qa, nb, mb, qb):  # Chan et al. parallel update
        n = na + nb
        if nb == ZERO:
            return na, ma, qa
        if na == ZERO:
            return nb, mb, qb
        d = mb - ma
        f = nb / n
        return n, ma + d * f, qa + qb + d * d * na * f

    @cuda.jit(device=True, inline=True)
    def add_vec(n, m, q, t):
        vm, vq = vstats(t)
        return merge(n, m, q, VF, vm, vq)

    @cuda.jit(device=True, inline=True)
    def add_vec4(n, m, q, t0, t1, t2, t3):
        """Exact two-pass mean/M2 of 4 vectors (4V values), then one branch-free Chan merge
        (correct for n == 0 too since the batch is never empty)."""
        s = ZERO
        for k in range(V):
            s += (t0[k] + t1[k]) + (t2[k] + t3[k])
        bm = s * INV_4V
        bq = ZERO
        for k in range(V):
            d0 = t0[k] - bm
            d1 = t1[k] - bm
            d2 = t2[k] - bm
            d3 = t3[k] - bm
            bq += d0 * d0 + d1 * d1 + d2 * d2 + d3 * d3
        nn = n + VF4
        d = bm - m
        f = VF4 / nn
        return nn, m + d * f, q + bq + d * d * n * f

    @cuda.jit(device=True, inline=True)
    def block_reduce(n, m, q, sn, sm, sq):
        tid = cuda.threadIdx.x
        sn[tid] = n
        sm[tid] = m
        sq[tid] = q
        cuda.syncthreads()
        step = tpb // 2
        while step > 0:
            if tid < step:
                n2, m2, q2 = merge(sn[tid], sm[tid], sq[tid], sn[tid + step], sm[tid + step], sq[tid + step])
                sn[tid] = n2
                sm[tid] = m2
                sq[tid] = q2
            cuda.syncthreads()
            step //= 2
        return sn[0], sm[0], sq[0]

    @cuda.jit(fastmath=True)
    def stats(xa, part, Lv, S, nwork):
        sn = cuda.shared.array(tpb, float32)
        sm = cuda.shared.array(tpb, float32)
        sq = cuda.shared.array(tpb, float32)
        blk = cuda.blockIdx.x
        while blk < nwork:  # one work item = (group, chunk); grid-stride (the simulator uses 2 blocks)
            gi = blk // S
            s = blk - gi * S
            base = gi * Lv
            lo = base + (s * Lv) // S
            hi = base + ((s + 1) * Lv) // S
            n = ZERO
            m = ZERO
            q = ZERO
            i = lo + cuda.threadIdx.x
            while i + 3 * tpb < hi:  # 4 independent loads in flight
                t0 = load(xa, i)
                t1 = load(xa, i + tpb)
                t2 = load(xa, i + 2 * tpb)
                t3 = load(xa, i + 3 * tpb)
                n, m, q = add_vec4(n, m, q, t0, t1, t2, t3)
                i += 4 * tpb
            while i < hi:
                n, m, q = add_vec(n, m, q, load(xa, i))
                i += tpb
            n, m, q = block_reduce(n, m, q, sn, sm, sq)
            if cuda.threadIdx.x == 0:
                part[blk * 3] = n
                part[blk * 3 + 1] = m
                part[blk * 3 + 2] = q
            cuda.syncthreads()
            blk += cuda.gridDim.x

    @cuda.jit(fastmath=True)
    def norm(xa, ya, part, w, b, Lv, S, HWv, cpg, G, eps, nwork):
        sn = cuda.shared.array(tpb, float32)
        sm = cuda.shared.array(tpb, float32)
        sq = cuda.shared.array(tpb, float32)
        sa = cuda.shared.array(MAX_CPG, float32)
        sb = cuda.shared.array(MAX_CPG, float32)
        tid = cuda.threadIdx.x
        blk = cuda.blockIdx.x
        while blk < nwork:
            # reverse order: the chunks the stats pass read last are still in L2 (50 MB)
            wk = nwork - 1 - blk
            gi = wk // S
            s = wk - gi * S
            # finalize: merge this group's S partials
            n = ZERO
            m = ZERO
            q = ZERO
            j = tid
            while j < S:
                p = (gi * S + j) * 3
                n, m, q = merge(n, m, q, part[p], part[p + 1], part[p + 2])
                j += tpb
            n, m, q = block_reduce(n, m, q, sn, sm, sq)
            var = q / n
            if var < ZERO:
                var = ZERO
            rstd = ONE / math.sqrt(var + eps)
            c0 = (gi % G) * cpg
            c = tid
            while c < cpg:
                a = rstd * wload(w, c0 + c)
                sa[c] = a
                sb[c] = wload(b, c0 + c) - m * a
                c += tpb
            cuda.syncthreads()
            base = gi * Lv
            lo = base + (s * Lv) // S
            hi = base + ((s + 1) * Lv) // S
            i = lo + tid
            e = i - base
            ch = e // HWv  # channel within the group; advanced incrementally below
            bound = (ch + 1) * HWv + base
            while i + 3 * tpb < hi:
                t0 = load(xa, i)
                t1 = load(xa, i + tpb)
                t2 = load(xa, i + 2 * tpb)
                t3 = load(xa, i + 3 * tpb)
                while i >= bound:
                    ch += 1
                    bound += HWv
                store(ya, i, t0, sa[ch], sb[ch])
                i += tpb
                while i >= bound:
                    ch += 1
                    bound += HWv
                store(ya, i, t1, sa[ch], sb[ch])
                i += tpb
                while i >= bound:
                    ch += 1
                    bound += HWv
                store(ya, i, t2, sa[ch], sb[ch])
                i += tpb
                while i >= bound:
                    ch += 1
                    bound += HWv
                store(ya, i, t3, sa[ch], sb[ch])
                i += tpb
            while i < hi:
                t0 = load(xa, i)
                while i >= bound:
                    ch += 1
                    bound += HWv
                store(ya, i, t0, sa[ch], sb[ch])
                i += tpb
            cuda.syncthreads()
            blk += cuda.gridDim.x

    return stats, norm


def _chunks(ng: int, lv: int, tpb: int) -> int:
    """Chunks per group: a power of two giving ~8 blocks per SM, >= 8 vectors per thread."""
    target = runtime.sm_count() * 8
    s = 1
    while s < tpb and ng * s < target and lv // (2 * s) >= 8 * tpb:
        s *= 2
    if runtime.SIMULATOR:
        s = min(s, 2)
    return s


def check(x, num_groups, weight, bias, eps=1e-6, silu=True):
    why = runtime.device_ok(x, weight, bias)
    if why:
        return why
    if x.dtype not in _SUPPORTED:
        return f"x dtype {x.dtype} (bf16/fp32 only)"
    if x.dim() < 2 or x.numel() == 0:
        return "x must be [N, C, ...] and non-empty"
    if not x.is_contiguous():
        return "x must be contiguous (NCHW)"
    C = x.shape[1]
    if C % num_groups:
        return "channels not divisible by groups"
    if C // num_groups > MAX_CPG:
        return f"more than {MAX_CPG} channels per group"
    for t in (weight, bias):
        if t is None:
            return "affine weight and bias required"
        if t.dtype not in _SUPPORTED or t.dim() != 1 or t.numel() != C or not t.is_contiguous():
            return "weight/bias must be contiguous [C] bf16/fp32"
        if t.device != x.device:
            return "weight/bias on another device"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return "no autograd"
    if x.numel() // (x.shape[0] * C) * (C // num_groups) >= 2 ** 31:
        return "group too large"
    return None


def plan(x, num_groups, weight, bias, eps=1e-6, silu=True):
    """(y, run_stats, run_norm): the output buffer and the two configured launches (bench hook)."""
    N, C = x.shape[0], x.shape[1]
    HW = x.numel() // (N * C)
    G = int(num_groups)
    cpg = C // G
    x16 = x.dtype == torch.bfloat16
    V = 4 if x16 else 2
    vec = HW % V == 0 and x.data_ptr() % 8 == 0 and x.storage_offset() % V == 0
    if not vec:
        V = 1
    if weight.dtype != bias.dtype:
        weight, bias = weight.float(), bias.float()
    w16 = weight.dtype == torch.bfloat16
    tpb = _tpb()
    Lv = cpg * HW // V
    NG = N * G
    S = _chunks(NG, Lv, tpb)
    y = torch.empty_like(x)
    part = _partials(x.device, NG * S * 3)
    if vec:
        xa = _arr64(x)
        ya = _arr64(y)
    else:
        xa = runtime.arr(x.reshape(-1))
        ya = runtime.arr(y.reshape(-1))
    stats, norm = _kernels(x16, vec, bool(silu), w16, tpb)
    st = runtime.stream()
    pa = _view(part)
    wa, ba = _view(weight), _view(bias)
    nwork = NG * S
    grid = min(nwork, 2) if runtime.SIMULATOR else nwork
    k1 = stats[grid, tpb, st]
    k2 = norm[grid, tpb, st]
    e32 = np.float32(eps)
    return (y, lambda: k1(xa, pa, Lv, S, nwork),
            lambda: k2(xa, ya, pa, wa, ba, Lv, S, HW // V, cpg, G, e32, nwork))


def groupnorm_silu_numba(x, num_groups, weight, bias, eps=1e-6, silu=True):
    y, run_stats, run_norm = plan(x, num_groups, weight, bias, eps, silu)
    run_stats()
    run_norm()
    return y


_VIEWS = {}
_PARTS = {}


def _view(t):
    """Cached numba view of a small, long-lived tensor (weights, partials).  Keyed by address,
    size and dtype: a view only holds the pointer, so a tensor that later lives at the same
    address with the same size/dtype is described correctly by it."""
    if runtime.SIMULATOR:
        return runtime.arr(t)
    key = (t.data_ptr(), t.numel(), t.dtype)
    v = _VIEWS.get(key)
    if v is None:
        if len(_VIEWS) > 4096:
            _VIEWS.clear()
        v = _VIEWS[key] = runtime.arr(t)
    return v


def _partials(device, n):
    """fp32 partial-statistics buffer, reused per (device, stream): launches on one stream are
    ordered, so the next call cannot overwrite partials still being read."""
    if runtime.SIMULATOR:
        return torch.empty(n, device=device, dtype=torch.float32)
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    buf = _PARTS.get(key)
    if buf is None or buf.numel() < n:
        buf = _PARTS[key] = torch.empty(max(n, 1 << 14), device=device, dtype=torch.float32)
    return buf


def _arr64(t):
    v = t.reshape(-1).view(torch.int64)
    if runtime.SIMULATOR:
        return v.detach().numpy()
    return cuda.as_cuda_array(v.detach(), sync=False)


registry.register_backend(OP, "numba", groupnorm_silu_numba, check=check, priority=10)
