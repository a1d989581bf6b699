"""LayerNorm (no affine) + adaLN modulate: ``y = LN(x) * (1 + scale) + shift``.

Shapes: x [B, L, C]; shift, scale [B, 1, C] (views of the modulation output: unit stride on C,
any batch stride).  Used before every qkv / mlp / linear1 / final linear of FLUX.

Numba backend ("numba", bf16 only): one thread block per row (grid (1, L, B), while loops),
each thread holds NW = 8 words of the row (32 bf16; C=3072: 96 threads per row) as *packed*
words in registers and unpacks them again in each pass (a shift or mask per element) instead
of keeping 16+ floats per thread; shift/scale are read only in the last pass (``RowsConfig.late``:
L1/L2 hits, 88 -> 64 registers, i.e. 10 rows in flight per SM instead of 7 -- the kernel is
latency bound: each row waits for its loads, then two block reductions, then stores);
16-byte loads/stores (ld.global.v2.u64) when every row and
vector is 16-byte aligned, int64 words when 8-byte aligned, else the int16 scalar fallback.
16-byte rows go through the software-pipelined variant (``make_row_kernel(PIPE=1)``: 8 blocks per
SM, each striding over rows and issuing the next row's loads before the current row's
reductions): img 20.0 us (68% of 3.7 TB/s; a torch copy of the same bytes takes 14.7 us).
Tried and measured slower on the H200 (11-29 runs #2, #3): one warp per row (shuffle-only
reductions, 12 x 16-byte loads per lane, 125 registers): 25.1 us vs 23.4 at img size; loading
the vectors once per block for several rows (more live registers): 24.0 vs 22.4.
Exact two-pass statistics (mean, then sum of squared deviations; warp-shuffle + shared-memory
block reductions), fp32 math, one bf16 rounding of the output (pack: cvt.rn.bf16x2.f32).  The
stock path rounds LN(x) and (1 + scale) to bf16 before the addcmul; this kernel does not
(differences are within one bf16 ulp of the output).

Bytes per call at FLUX 1024^2 (C = 3072, B = 1): read x + write y = 4*L*C bytes
(shift/scale 12 KB, cache-resident):
  img  L=4096: 50.3 MB -> 13.6 us floor at 3.7 TB/s
  txt  L=512 :  6.3 MB ->  1.7 us
  single L=4608: 56.6 MB -> 15.3 us
(stock: layer_norm + 1+scale + addcmul moves ~2x that.)

``ln_modulate_fp8`` (fast profile, issue #13): the same row kernel with FP8=1 returns the
``fp8_format`` rows of the fp32 modulate output -- (q [B*L, C] float8_e4m3fn, scale [B*L, 1]
fp32), the input of qkv / mlp-up / linear1 as ``torch._scaled_mm`` takes it.  The modulate pass
only takes max |y| (one more block reduction, block_max), a last pass recomputes the same fp32 y
from the packed x words (shift/scale read again: L1/L2 hits) and writes y * 448/amax as e4m3,
one 8-byte word per 16-byte input pair.  ptxas 13.0 sm_90: 93 registers one-row / 96 pipelined
(bf16: 59 / 76), so the pipelined grid takes the blocks per SM from the occupancy API instead of
assuming 8.  Bytes: read x + write q = 3*L*C (+ 4 B/row): img 37.8 MB -> 10.2 us floor,
txt 4.7 MB -> 1.3 us, single 42.5 MB -> 11.5 us.  Not yet timed on a GPU (bench/ops/gpu_fp8.py).
"""
import functools

import numpy as np
import torch
import torch.nn.functional as F

from . import launching
from .jit import jit_kernel
from .device import RED_SMEM
# module globals (not closure cells): the simulator swaps `cuda` per thread, and the on-disk
# cache key then only hashes the factory's int constants
from .device import cuda, float32, int64, unpack_w, pack4, pack1, round_bf16, block_sum, rsqrt, ld2, st2  # noqa: F401
from .device import block_max, fdiv_rn  # noqa: F401
from . import fp8_format as f8
from .fp8_format import e4m3_1, e4m3x4, e4m3x8  # noqa: F401
from .registry import registry
from .config import ROWS, RowsConfig, WORD_LAYOUTS, launcher_key  # noqa: F401

OP = "ln_modulate"


def reference(x, shift, scale, eps: float = 1e-6):
    """ComfyUI's math: ``addcmul(shift, layer_norm(x), 1 + scale)`` in x's dtype."""
    return torch.addcmul(shift, F.layer_norm(x, (x.shape[-1],), eps=eps), 1 + scale)


registry.register(OP, reference, doc=__doc__)

# ----------------------------------------------------------------------------- numba backend
MAX_THREADS = 1024  # CUDA's most threads per block
# words per thread for each (word width VEC, words per access VW), the pipelined kernel's blocks per
# SM and the late vector loads: config.RowsConfig (shared with gated_residual)


def make_row_kernel(VEC, NW, GATED, VW=1, LATE=0, PIPE=0, FP8=0):
    """Row kernel factory.  GATED=1: first ``x += gate * y`` (x rounded to bf16 and stored),
    then LN + modulate of the new x.  Arrays are word views: x, y, out [B, L, Cw];
    gate, shift, scale [B, 1, Cw].
    FP8=1: the output is the fp8 e4m3 row format (fp8_format): out is the [B, L, Cs] word view
    of q (one word per thread slot: int64 = 8 fp8 at VW 2, int32 = 4 at VEC 4 / VW 1, uint8 at
    VEC 1) and qsc [B, L] fp32 gets the row scales; the modulate pass computes y in fp32 and only
    takes max |y| (block_max), a last pass recomputes the same y (same instructions on the same
    registers) and writes e4m3(y * 448 / amax).  FP8=0: qsc is unused (any array).  Thread slot k covers words (tid + k*nt)*VW .. +VW (VW 2:
    one 16-byte access).  Only packed words stay in registers (each pass unpacks again: a
    shift or mask per element), which keeps the kernel near 40 registers -> many rows in
    flight per SM; every load of a row is issued before the first reduction.
    LATE=1: shift/scale are read in the last pass (fewer live registers).
    PIPE=1 (16-byte words only), software pipeline: a block strides over rows li,
    li + gridDim.y, ... and issues the next row's x (and y) loads before the current row's
    reductions, so it always has a row in flight (the one-row kernel leaves the memory system
    idle between its loads and its stores; it reached 58-63% of copy bandwidth)."""

    RED = RED_SMEM
    NS = NW // VW
    AMAX_FLOOR = f8.AMAX_FLOOR
    E4M3_MAX = f8.E4M3_MAX
    assert not PIPE or (VEC == 4 and VW == 2)

    @cuda.jit(device=True, inline=True)
    def load_row(xr, yr, wxr, wyr, tid, nt, Cs):
        """PIPE: this thread's 16-byte words of row xr (and yr) into wxr (wyr)."""
        for k in range(NS):
            j = tid + k * nt
            if j < Cs:
                t2 = ld2(xr, 2 * j)
                wxr[2 * k] = t2[0]
                wxr[2 * k + 1] = t2[1]
                if GATED:
                    t2 = ld2(yr, 2 * j)
                    wyr[2 * k] = t2[0]
                    wyr[2 * k + 1] = t2[1]

    def row_kernel(x, y, gate, shift, scale, out, qsc, eps):
        smem = cuda.shared.array(RED, float32)
        tq = cuda.local.array(8, float32)  # FP8: one slot's values (VW * VEC)
        ta = cuda.local.array(4, float32)
        tb = cuda.local.array(4, float32)
        tc = cuda.local.array(4, float32)
        wx = cuda.local.array(NW, int64)
        wy = cuda.local.array(NW, int64)
        wg = cuda.local.array(NW, int64)
        wsh = cuda.local.array(NW, int64)
        wsc = cuda.local.array(NW, int64)
        nx = cuda.local.array(NW, int64)  # PIPE: the next row's x / y
        ny = cuda.local.array(NW, int64)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        Cs = x.shape[2] // VW
        inv_n = float32(1) / float32(x.shape[2] * VEC)
        # grid (1, L, B), while loops in y / z: no integer division anywhere
        b = cuda.blockIdx.z
        while b < x.shape[0]:
            gr = gate[b, 0]
            shr = shift[b, 0]
            scr = scale[b, 0]
            li = cuda.blockIdx.y
            if PIPE and li < x.shape[1]:  # prologue: the first row's loads
                load_row(x[b, li], y[b, li], nx, ny, tid, nt, Cs)
            while li < x.shape[1]:
                xr = x[b, li]  # 1-D row views: one index per access
                orow = out[b, li]
                yr = y[b, li]
                if PIPE:
                    for i in range(NW):
                        wx[i] = nx[i]
                        if GATED:
                            wy[i] = ny[i]
                    ln = li + cuda.gridDim.y
                    if ln < x.shape[1]:  # the next row's loads, in flight during this row's reductions
                        load_row(x[b, ln], y[b, ln], nx, ny, tid, nt, Cs)
                for k in range(NS):
                    j = tid + k * nt
                    if j < Cs:
                        if VW == 2:
                            if not PIPE:
                                t2 = ld2(xr, 2 * j)
                                wx[2 * k] = t2[0]
                                wx[2 * k + 1] = t2[1]
                                if GATED:
                                    t2 = ld2(yr, 2 * j)
                                    wy[2 * k] = t2[0]
                                    wy[2 * k + 1] = t2[1]
                            if GATED and not PIPE:
                                t2 = ld2(gr, 2 * j)
                                wg[2 * k] = t2[0]
                                wg[2 * k + 1] = t2[1]
                            if not LATE:
                                t2 = ld2(shr, 2 * j)
                                wsh[2 * k] = t2[0]
                                wsh[2 * k + 1] = t2[1]
                                t2 = ld2(scr, 2 * j)
                                wsc[2 * k] = t2[0]
                                wsc[2 * k + 1] = t2[1]
                        else:
                            wx[k] = xr[j]
                            if GATED:
                                wy[k] = yr[j]
                                wg[k] = gr[j]
                            if not LATE:
                                wsh[k] = shr[j]
                                wsc[k] = scr[j]
                s = float32(0)
                for k in range(NS):
                    j = tid + k * nt
                    if j < Cs:
                        if GATED and PIPE:  # the pipelined kernel reads the gate next to its use
                            t2 = ld2(gr, 2 * j)
                            wg[2 * k] = t2[0]
                            wg[2 * k + 1] = t2[1]
                        for v in range(VW):
                            unpack_w(wx[k * VW + v], ta, 0, VEC)
                            if GATED:  # x_new = bf16(x + bf16(gate * y)), exactly stock's rounding
                                unpack_w(wy[k * VW + v], tb, 0, VEC)
                                unpack_w(wg[k * VW + v], tc, 0, VEC)
                                for e in range(VEC):
                                    ta[e] = ta[e] + round_bf16(tc[e] * tb[e])
                                if VEC == 4:
                                    wx[k * VW + v] = pack4(ta[0], ta[1], ta[2], ta[3])
                                else:
                                    wx[k * VW + v] = pack1(ta[0])
                                unpack_w(wx[k * VW + v], ta, 0, VEC)
                            for e in range(VEC):
                                s += ta[e]
                        if GATED:
                            if VW == 2:
                                st2(xr, 2 * j, wx[2 * k], wx[2 * k + 1])
                            else:
                                xr[j] = wx[k]
                mean = block_sum(s, smem) * inv_n
                q = float32(0)
                for k in range(NS):
                    if tid + k * nt < Cs:
                        for v in range(VW):
                            unpack_w(wx[k * VW + v], ta, 0, VEC)
                            for e in range(VEC):
                                d = ta[e] - mean
                                q += d * d
                var = block_sum(q, smem) * inv_n
                r = rsqrt(var + eps)
                mx = float32(0)
                for k in range(NS):
                    j = tid + k * nt
                    if j < Cs:
                        if LATE:  # modulation vectors read only now (cache hits): fewer live registers
                            if VW == 2:
                                t2 = ld2(shr, 2 * j)
                                wsh[2 * k] = t2[0]
                                wsh[2 * k + 1] = t2[1]
                                t2 = ld2(scr, 2 * j)
                                wsc[2 * k] = t2[0]
                                wsc[2 * k + 1] = t2[1]
                            else:
                                wsh[k] = shr[j]
                                wsc[k] = scr[j]
                        for v in range(VW):
                            unpack_w(wx[k * VW + v], ta, 0, VEC)
                            unpack_w(wsh[k * VW + v], tb, 0, VEC)
                            unpack_w(wsc[k * VW + v], tc, 0, VEC)
                            for e in range(VEC):
                                ta[e] = (ta[e] - mean) * r * (float32(1) + tc[e]) + tb[e]
                            if FP8:
                                for e in range(VEC):
                                    mx = max(mx, abs(ta[e]))
                            elif VEC == 4:
                                wx[k * VW + v] = pack4(ta[0], ta[1], ta[2], ta[3])
                            else:
                                wx[k * VW + v] = pack1(ta[0])
                        if not FP8:
                            if VW == 2:
                                st2(orow, 2 * j, wx[2 * k], wx[2 * k + 1])
                            else:
                                orow[j] = wx[k]
                if FP8:  # row scale, then the same y again, quantised (fp8_format)
                    amax = max(block_max(mx, smem), float32(AMAX_FLOOR))
                    qinv = fdiv_rn(float32(E4M3_MAX), amax)
                    if tid == 0:
                        qsc[b, li] = fdiv_rn(amax, float32(E4M3_MAX))
                    for k in range(NS):
                        j = tid + k * nt
                        if j < Cs:
                            if LATE:  # read again (cache hits) instead of holding 2 x NW words over block_max
                                if VW == 2:
                                    t2 = ld2(shr, 2 * j)
                                    wsh[2 * k] = t2[0]
                                    wsh[2 * k + 1] = t2[1]
                                    t2 = ld2(scr, 2 * j)
                                    wsc[2 * k] = t2[0]
                                    wsc[2 * k + 1] = t2[1]
                                else:
                                    wsh[k] = shr[j]
                                    wsc[k] = scr[j]
                            for v in range(VW):
                                unpack_w(wx[k * VW + v], ta, 0, VEC)
                                unpack_w(wsh[k * VW + v], tb, 0, VEC)
                                unpack_w(wsc[k * VW + v], tc, 0, VEC)
                                for e in range(VEC):
                                    tq[v * VEC + e] = ((ta[e] - mean) * r * (float32(1) + tc[e]) + tb[e]) * qinv
                            if VW == 2:
                                orow[j] = e4m3x8(tq[0], tq[1], tq[2], tq[3], tq[4], tq[5], tq[6], tq[7])
                            elif VEC == 4:
                                orow[j] = e4m3x4(tq[0], tq[1], tq[2], tq[3])
                            else:
                                orow[j] = e4m3_1(tq[0])
                li += cuda.gridDim.y
            b += cuda.gridDim.z

    return jit_kernel(row_kernel)


@functools.lru_cache(maxsize=16)
def _sms(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_rows(GATED, VEC, VW, xw, yw, gw, shw, scw, ow, eps, qsc=None, cfg=ROWS):
    """Launch the row kernel (LN + modulate, optionally after the gated residual) on word views.
    ``qsc`` (fp32 [B, L]): the fp8 variant -- ``ow`` is then q's word view (``fp8_format.q_words``
    with E = VEC * VW) and qsc receives the row scales.  Same pipelining / late-vector choices
    (``cfg``, a RowsConfig) as the bf16 kernel (not tuned separately yet; the fp8 launchers' keys
    end in "fp8")."""
    B, L, Cw = xw.shape
    nt = _threads(Cw, cfg.nw(VEC, VW))
    FP8 = int(qsc is not None)
    tail = ("fp8",) if FP8 else ()
    if qsc is None:
        qsc = ow  # unused by the bf16 kernel
    per_sm = cfg.pipe(GATED)
    if per_sm > 0 and VEC == 4 and VW == 2:
        key = launcher_key(("pipe", GATED) + tail, cfg, ROWS)
        la = launching.cached_launcher(_launchers, key, make_row_kernel, 4, cfg.nw16, GATED, 2, 1, 1, FP8)
        ny = L
        if xw.is_cuda:  # enough blocks to fill the GPU once, each striding over several rows
            dev = xw.device.index if xw.device.index is not None else torch.cuda.current_device()
            if FP8:  # more registers than the bf16 kernel (ptxas 13.0, sm_90: 96 vs 76): what fits
                per_sm = _resident(key, la, nt, per_sm, (xw, yw, gw, shw, scw, ow, qsc, np.float32(eps)),
                                   fallback=min(per_sm, 7))  # 7 x 96 threads x 96 registers fit
            ny = min(L, max(1, _sms(dev) * per_sm // B))
        la(launching.grid3(1, ny, B), nt, xw, yw, gw, shw, scw, ow, qsc, np.float32(eps))
        return
    _launcher(VEC, GATED, VW, FP8, cfg)(launching.grid3(1, L, B), nt, xw, yw, gw, shw, scw, ow, qsc, np.float32(eps))


_launchers = {}
_occupancy = {}


def _resident(key, la, nt, cap, args, fallback):
    """min(cap, blocks of nt threads per SM the launcher's kernel keeps resident), cached with the
    occupancy API's answer (``fallback`` when it gives none)."""
    k = (key, nt, cap)
    hit = _occupancy.get(k)
    if hit is None:
        occ = la.occupancy(nt, *args)
        hit = (fallback if not occ else max(1, min(cap, occ)), occ)
        if not launching.planning():  # a planning pass gets no answer: ask again when it runs
            _occupancy[k] = hit
    return hit[0]


def _launcher(VEC, GATED, VW=1, FP8=0, cfg=ROWS):
    late = int(cfg.late_vec(GATED))
    key = launcher_key((VEC, GATED, VW) + ((late,) if late else ()) + (("fp8",) if FP8 else ()), cfg, ROWS)
    return launching.cached_launcher(_launchers, key, make_row_kernel, VEC, cfg.nw(VEC, VW), GATED, VW, late, 0, FP8)


@functools.lru_cache(maxsize=1024)
def _threads(Cw, NW):
    """Threads per row block: enough for NW words each, a multiple of 32."""
    n = -(-Cw // NW)
    return min(MAX_THREADS, max(32, -(-n // 32) * 32))


def row_check(x, rows, vecs):
    """Shared check for the row kernels (ln_modulate and gated_residual_ln_modulate)."""
    why = launching.common_check(x, *rows, *vecs)
    if why:
        return why
    if x.ndim != 3:
        return f"x must be [B, L, C], got {tuple(x.shape)}"
    B, L, C = x.shape
    for t in rows:
        if t.shape != x.shape:
            return f"shape {tuple(t.shape)} != x {tuple(x.shape)}"
    for t in vecs:
        if t.ndim != 3 or t.shape[1] != 1 or t.shape[2] != C or t.shape[0] not in (1, B):
            return f"modulation vector must be [B, 1, C], got {tuple(t.shape)}"
    if C > MAX_THREADS * 16:
        return f"C={C} > {MAX_THREADS * 16}"
    return None


def check(x, shift, scale, eps: float = 1e-6, config=None):
    return row_check(x, (), (shift, scale))


def vec_views(x, *ts):
    """(VEC, VW, views): int64 word views of all tensors when every one is 8-byte aligned
    (VW 2 when also 16-byte aligned, see ``launching.aligned16``), else int16 views (VEC 1, VW 1)."""
    ws = [launching.words(t) for t in (x,) + ts]
    if all(w is not None for w in ws):
        return 4, (2 if launching.aligned16(*ws) else 1), ws
    return 1, 1, [t.view(torch.int16) for t in (x,) + ts]


def _expand(t, B):
    return t if t.shape[0] == B else t.expand(B, *t.shape[1:])


def numba_ln_modulate(x, shift, scale, eps: float = 1e-6, config=None):
    """``config``: a RowsConfig (benchmarks / tests), else ``config.ROWS``."""
    B = x.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    VEC, VW, (xw, ow, shw, scw) = vec_views(x, out, _expand(shift, B), _expand(scale, B))
    # y and gate are unused when GATED=0: pass x / shift again (same types, no extra work)
    launch_rows(0, VEC, VW, xw, xw, shw, shw, scw, ow, eps, cfg=config or ROWS)
    return out


registry.register_backend(OP, "numba", numba_ln_modulate, check=check)


# ------------------------------------------------------------------------------ fp8 output
def modulate_fp32(x, shift, scale, eps: float = 1e-6):
    """fp32 ``LN(x) * (1 + scale) + shift`` in the kernel's order of operations (two-pass
    statistics, ``(x - mean) * rstd * (1 + scale) + shift``), no bf16 rounding."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    d = xf - mean
    r = torch.rsqrt((d * d).mean(-1, keepdim=True) + eps)
    return d * r * (1 + scale.float()) + shift.float()


def reference_fp8(x, shift, scale, eps: float = 1e-6):
    """(q [B*L, C] fp8 e4m3, row scales [B*L, 1] fp32) of the fp32 LN + modulate output."""
    return f8.quantize_rows_reference(modulate_fp32(x, shift, scale, eps))


OP_FP8 = "ln_modulate_fp8"
registry.register(OP_FP8, reference_fp8, doc=__doc__)


def check_fp8(x, shift, scale, eps: float = 1e-6, config=None):
    return row_check(x, (), (shift, scale)) or f8.check(x.shape[-1], x)


def numba_ln_modulate_fp8(x, shift, scale, eps: float = 1e-6, config=None):
    B, L, C = x.shape
    q, qs = f8.empty(B * L, C, x.device)
    # q is this call's own (aligned) allocation: only the inputs decide the access width
    VEC, VW, (xw, shw, scw) = vec_views(x, _expand(shift, B), _expand(scale, B))
    launch_rows(0, VEC, VW, xw, xw, shw, shw, scw, f8.q_words(q, VEC * VW, B, L), eps, qs.view(B, L),
                config or ROWS)
    return q, qs


registry.register_backend(OP_FP8, "numba", numba_ln_modulate_fp8, check=check_fp8)


def _ptx_cases():
    from numba import types as nt
    A = lambda dt, nd: nt.Array(dt, nd, "A")  # noqa: E731
    c = {}
    cfg = ROWS
    for G in (0, 1):
        n = "gated_ln" if G else "ln_modulate"
        late = int(cfg.late_vec(G))
        for (vec, vw), nw in cfg.nw_for().items():
            dt = nt.int64 if vec == 4 else nt.int16
            c[n + " v%dw%d" % (vec, vw)] = lambda G=G, vec=vec, vw=vw, nw=nw, dt=dt, late=late: (
                make_row_kernel(vec, nw, G, vw, late), (A(dt, 3),) * 7 + (nt.float32,))
            qt = {(4, 2): nt.int64, (4, 1): nt.int32, (1, 1): nt.uint8}[(vec, vw)]
            c[n + " fp8 v%dw%d" % (vec, vw)] = lambda G=G, vec=vec, vw=vw, nw=nw, dt=dt, qt=qt, late=late: (
                make_row_kernel(vec, nw, G, vw, late, 0, 1),
                (A(dt, 3),) * 5 + (A(qt, 3), A(nt.float32, 2), nt.float32))
        c[n + " pipe"] = lambda G=G: (make_row_kernel(4, cfg.nw16, G, 2, 1, 1), (A(nt.int64, 3),) * 7 + (nt.float32,))
        c[n + " fp8 pipe"] = lambda G=G: (make_row_kernel(4, cfg.nw16, G, 2, 1, 1, 1),
                                          (A(nt.int64, 3),) * 6 + (A(nt.float32, 2), nt.float32))
        c[n + " v4w2 other"] = lambda G=G, late=late: (make_row_kernel(4, cfg.nw16, G, 2, 1 - late),
                                             (A(nt.int64, 3),) * 7 + (nt.float32,))
    return c


PTX_CASES = _ptx_cases()
