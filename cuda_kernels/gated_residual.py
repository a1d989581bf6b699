"""Gated residual ``x += gate * y`` (in place), optionally fused with the next LN+modulate.

Shapes: x, y [B, L, C]; gate, shift, scale [B, 1, C] (unit stride on C).
``gated_residual_ln_modulate`` returns ``LN(x_new) * (1 + scale) + shift`` and leaves the
updated residual in x: one read of x and y gives both the new residual and the next input.

Numba backends ("numba", bf16 only).  Rounding: like the reference, ``gate * y`` is rounded to
bf16 and then added to x and rounded again, so the new residual is bit-identical to stock
(fp32 products, RNE).  The fused variant computes LN statistics from the rounded new x held in
registers (the row kernel of ``ln_modulate`` with GATED=1) and rounds its output once.
  * gated_residual: block per row chunk (grid (chunks, L, B), while loops, no integer
    division), 16 bf16 per thread, all loads issued before the math; 16-byte accesses when
    16-byte aligned, int64 words (4 bf16) when 8-byte aligned, int16 scalar fallback.
  * gated_residual_ln_modulate: the row kernel of ln_modulate with GATED=1 (packed words in
    registers: 69 registers instead of 168, i.e. 4 rows in flight per SM instead of 2).

Bytes per call at FLUX 1024^2 (C = 3072, B = 1), floor at 3.7 TB/s:
  gated_residual            read x, y + write x = 6*L*C:  img 75.5 MB 20.4 us; txt 9.4 MB 2.6 us;
                                                         single (L=4608) 84.9 MB 22.9 us
  gated_residual_ln_modulate read x, y + write x, h = 8*L*C: img 100.7 MB 27.2 us;
                                                         txt 12.6 MB 3.4 us
  (unfused gated_residual + ln_modulate: 10*L*C, img 125.8 MB 34.0 us; stock ~2x more.)

``gated_residual_ln_modulate_fp8`` (fast profile): the same fused row kernel with FP8=1 -- the
residual is updated in place exactly as above (bf16, bit-identical to stock), and the next LN +
modulate comes back as ``fp8_format`` rows (q [B*L, C] fp8, scale [B*L, 1] fp32) of its fp32
value: the mlp-up input of the double blocks.  Bytes: read x, y + write x (bf16) + q (fp8) =
7*L*C: img 88.1 MB -> 23.8 us floor, txt 11.0 MB -> 3.0 us.  Not yet timed on a GPU.
"""
import numpy as np
import torch

from . import launching
from .jit import jit_kernel
# module globals (not closure cells): the simulator swaps `cuda` per thread, and the on-disk
# cache key then only hashes the factory's int constants
from .device import cuda, float32, int64, unpack_w, pack4, pack1, round_bf16, ld2, st2  # noqa: F401
from . import fp8_format as f8
from . import ln_modulate as _lm
from .ln_modulate import reference as ln_modulate_reference
from .ln_modulate import row_check, vec_views, _threads, _expand
from .config import ROWS, launcher_key
from .registry import registry

OP = "gated_residual"
OP_LN = "gated_residual_ln_modulate"


def reference(x, gate, y):
    """ComfyUI's math: ``x += y * gate`` in x's dtype (y * gate rounded first)."""
    x += y * gate
    return x


def reference_ln(x, gate, y, shift, scale, eps: float = 1e-6):
    reference(x, gate, y)
    return ln_modulate_reference(x, shift, scale, eps)


registry.register(OP, reference, doc=__doc__, mutates=(0,))
registry.register(OP_LN, reference_ln, doc=__doc__, mutates=(0,))

# ----------------------------------------------------------------------------- numba backend


def make_gated_kernel(VEC, NW, VW=1):
    """x[B, L, Cw] += gate[B, 1, Cw] * y[B, L, Cw] on word views; work item = (row, chunk);
    thread slot k of chunk c covers words (c*nt*NS + k*nt + tid)*VW .. +VW (VW 2: 16-byte
    accesses); all loads before the math; while loops (no 64-bit division)."""
    NS = NW // VW

    def gated_kernel(x, gate, y, nchunks):
        wx = cuda.local.array(NW, int64)
        wy = cuda.local.array(NW, int64)
        wg = cuda.local.array(NW, int64)
        ta = cuda.local.array(4, float32)
        tb = cuda.local.array(4, float32)
        tc = cuda.local.array(4, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        Cs = x.shape[2] // VW
        b = cuda.blockIdx.z
        while b < x.shape[0]:
            gr = gate[b, 0]
            li = cuda.blockIdx.y
            while li < x.shape[1]:
                xr = x[b, li]
                yr = y[b, li]
                c = cuda.blockIdx.x
                while c < nchunks:
                    base = c * nt * NS + tid
                    for k in range(NS):
                        j = base + k * nt
                        if j < Cs:
                            if VW == 2:
                                t2 = ld2(xr, 2 * j)
                                wx[2 * k] = t2[0]
                                wx[2 * k + 1] = t2[1]
                                t2 = ld2(yr, 2 * j)
                                wy[2 * k] = t2[0]
                                wy[2 * k + 1] = t2[1]
                                t2 = ld2(gr, 2 * j)
                                wg[2 * k] = t2[0]
                                wg[2 * k + 1] = t2[1]
                            else:
                                wx[k] = xr[j]
                                wy[k] = yr[j]
                                wg[k] = gr[j]
                    for k in range(NS):
                        j = base + k * nt
                        if j < Cs:
                            for v in range(VW):
                                unpack_w(wx[k * VW + v], ta, 0, VEC)
                                unpack_w(wy[k * VW + v], tb, 0, VEC)
                                unpack_w(wg[k * VW + v], tc, 0, VEC)
                                for e in range(VEC):  # stock: bf16(x + bf16(y * gate))
                                    ta[e] = ta[e] + round_bf16(tc[e] * tb[e])
                                if VEC == 4:
                                    wx[k * VW + v] = pack4(ta[0], ta[1], ta[2], ta[3])
                                else:
                                    wx[k * VW + v] = pack1(ta[0])
                            if VW == 2:
                                st2(xr, 2 * j, wx[2 * k], wx[2 * k + 1])
                            else:
                                xr[j] = wx[k]
                    c += cuda.gridDim.x
                li += cuda.gridDim.y
            b += cuda.gridDim.z

    return jit_kernel(gated_kernel)


_launchers = {}


def _launcher(kind, VEC, VW, cfg=ROWS):
    return launching.cached_launcher(_launchers, launcher_key((kind, VEC, VW), cfg, ROWS), make_gated_kernel,
                                     VEC, cfg.nw(VEC, VW), VW)


def check(x, gate, y, config=None):
    return row_check(x, (y,), (gate,))


def check_ln(x, gate, y, shift, scale, eps: float = 1e-6, config=None):
    return row_check(x, (y,), (gate, shift, scale))


def numba_gated_residual(x, gate, y, config=None):
    """``config``: a RowsConfig (benchmarks / tests; its words per thread), else ``config.ROWS``."""
    cfg = config or ROWS
    B, L, C = x.shape
    VEC, VW, (xw, gw, yw) = vec_views(x, _expand(gate, B), y)
    Cw = xw.shape[2]
    NW = cfg.nw(VEC, VW)
    nt = _threads(Cw, NW)
    nchunks = -(-Cw // (nt * NW))
    _launcher("gated", VEC, VW, cfg)(launching.grid3(nchunks, L, B), nt, xw, gw, yw, nchunks)
    return x


def numba_gated_residual_ln_modulate(x, gate, y, shift, scale, eps: float = 1e-6, config=None):
    """``config``: a RowsConfig (benchmarks / tests), else ``config.ROWS``."""
    B = x.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    VEC, VW, (xw, yw, ow, gw, shw, scw) = vec_views(x, y, out, _expand(gate, B), _expand(shift, B), _expand(scale, B))
    _lm.launch_rows(1, VEC, VW, xw, yw, gw, shw, scw, ow, eps, cfg=config or ROWS)
    return out


registry.register_backend(OP, "numba", numba_gated_residual, check=check)
registry.register_backend(OP_LN, "numba", numba_gated_residual_ln_modulate, check=check_ln)


# ------------------------------------------------------------------------------ fp8 output
OP_LN_FP8 = "gated_residual_ln_modulate_fp8"


def reference_ln_fp8(x, gate, y, shift, scale, eps: float = 1e-6):
    """x += y * gate (stock's bf16 rounding, in place); returns (q [B*L, C] fp8, scales [B*L, 1])
    of the fp32 LN + modulate of the new x."""
    reference(x, gate, y)
    return f8.quantize_rows_reference(_lm.modulate_fp32(x, shift, scale, eps))


registry.register(OP_LN_FP8, reference_ln_fp8, doc=__doc__, mutates=(0,))


def check_ln_fp8(x, gate, y, shift, scale, eps: float = 1e-6, config=None):
    return row_check(x, (y,), (gate, shift, scale)) or f8.check(x.shape[-1], x)


def numba_gated_residual_ln_modulate_fp8(x, gate, y, shift, scale, eps: float = 1e-6, config=None):
    B, L, C = x.shape
    q, qs = f8.empty(B * L, C, x.device)
    VEC, VW, (xw, yw, gw, shw, scw) = vec_views(x, y, _expand(gate, B), _expand(shift, B), _expand(scale, B))
    _lm.launch_rows(1, VEC, VW, xw, yw, gw, shw, scw, f8.q_words(q, VEC * VW, B, L), eps, qs.view(B, L),
                    config or ROWS)
    return q, qs


registry.register_backend(OP_LN_FP8, "numba", numba_gated_residual_ln_modulate_fp8, check=check_ln_fp8)


def _ptx_cases():
    from numba import types as nt
    A = lambda dt, nd: nt.Array(dt, nd, "A")  # noqa: E731
    c = {}
    for (vec, vw), nw in ROWS.nw_for().items():
        dt = nt.int64 if vec == 4 else nt.int16
        c["gated v%dw%d" % (vec, vw)] = lambda vec=vec, vw=vw, nw=nw, dt=dt: (
            make_gated_kernel(vec, nw, vw), (A(dt, 3),) * 3 + (nt.int64,))
    return c


PTX_CASES = _ptx_cases()
