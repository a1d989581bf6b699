"""fp8 e4m3 rows (``fp8_format``) from bf16 rows, optionally through GELU: the GEMM inputs whose
producer is not a row kernel of ln_modulate.  One kernel, three ops:

  * ``quantize_fp8(x)``         x [B, L, K] -> q, scale.  The attention output feeding the double
                                blocks' proj (cuDNN writes the attention: the one pass that cannot
                                be fused into its producer).
  * ``gelu_tanh_fp8(x)``        x [B, L, M] -> fp8 of GELU_tanh(x) (double blocks' mlp-down input).
  * ``attn_gelu_fp8(a, m)``     a [B, L, C], m [B, L, M] -> ONE fp8 row [a | GELU_tanh(m)] of width
                                C + M with one row scale: the single blocks' linear2 input, read
                                straight from the attention output and the mlp columns of
                                linear1's output (both may be row-strided views of one buffer).
q is [B*L, K] contiguous (K = C + M), scale [B*L, 1] fp32; inputs bf16 [B, L, *] (or [rows, *])
with unit stride on the last dim and any row / batch strides (the contract of the bf16 kernels).
K, C, M multiples of 16.

Numba backend ("numba", bf16 only): one thread block per row (grid (1, L, B), while loops), the
row split into slots of E = VEC * VW elements (E 8: one 16-byte load when every row of both
inputs is 16-byte aligned; E 4: 8-byte words; E 1: int16 scalars), NS slots per thread (32 / 16 /
16 elements), slot j < C/E from ``a``, the rest from ``m`` (C is a multiple of 16: a slot never
straddles; at FLUX's C = 3072, E = 8 the boundary is warp aligned).  All loads are issued first,
then each slot is widened to fp32 (GELU applied on the ``m`` slots, ex2/rcp.approx form as in
gelu_tanh) into a per-thread fp32 array held in registers (GELU is evaluated once: recomputing it
for the second pass would double the MUFU work, which at 56.6 M elements per call is about the
memory time), max |v| -> block_max -> scale, then one E-byte fp8 word per slot (uint8 / int32 /
int64 store).  Threads per row: K / (NS * E) rounded up to 32 (FLUX: 384 for 12288, 480 for
15360, 96 for 3072); K <= 16384 (the launch-bound register budget: <= 512 threads at E = 8,
<= 1024 otherwise).

Bytes per call at FLUX 1024^2 (B = 1), read 2 B + write 1 B per element (+ 4 B per row), floor at
3.7 TB/s:
  quantize_fp8   img L=4096, K=3072:  37.8 MB -> 10.2 us;  txt L=512: 4.7 MB -> 1.3 us
  gelu_tanh_fp8  img L=4096, M=12288: 151.0 MB -> 40.8 us; txt L=512: 18.9 MB -> 5.1 us
                 (bf16 gelu_tanh: 201.3 MB -> 54.4 us; its mlp-down then reads 2 B instead of 1)
  attn_gelu_fp8  single L=4608, 3072 + 12288: 212.4 MB -> 57.4 us
                 (bf16 path: gelu_tanh in place over linear1's mlp columns, 226.5 MB -> 61.2 us;
                 linear2 then reads 141.6 MB of bf16 instead of 70.8 MB of fp8)
"""
import functools

import torch
import torch.nn.functional as F

from . import launching
from .jit import jit_kernel
from .device import RED_SMEM
from . import fp8_format as f8
# module globals (not closure cells): the simulator swaps `cuda` per thread
from .device import cuda, float32, int64, unpack_w, gelu_fast, ld2, block_max, fdiv_rn  # noqa: F401
from .fp8_format import e4m3_1, e4m3x4, e4m3x8  # noqa: F401
from .registry import registry
from .config import FP8_ROWS, launcher_key

OP_Q, OP_GELU, OP_CAT = "quantize_fp8", "gelu_tanh_fp8", "attn_gelu_fp8"


def _gelu32(x):
    return F.gelu(x.float(), approximate="tanh")


def reference_quantize(x):
    """(q [rows, K], scale [rows, 1]) of x widened to fp32."""
    return f8.quantize_rows_reference(x.float())


def reference_gelu(x):
    """fp8 rows of the fp32 GELU_tanh of x (no bf16 rounding in between)."""
    return f8.quantize_rows_reference(_gelu32(x))


def reference_cat(a, m):
    """fp8 rows of [a | GELU_tanh(m)] in fp32, one scale per row."""
    return f8.quantize_rows_reference(torch.cat((a.float(), _gelu32(m)), -1))


registry.register(OP_Q, reference_quantize, doc=__doc__)
registry.register(OP_GELU, reference_gelu, doc=__doc__)
registry.register(OP_CAT, reference_cat, doc=__doc__)

# ----------------------------------------------------------------------------- numba backend
# (VEC, VW) -> words per thread (NS = NW / VW slots of VEC * VW elements), the widest row and the
# launch bounds: config.Fp8RowsConfig


def make_rows_kernel(VEC, NW, VW, LB_T, LB_B):
    """q[B, L, Qs] (words of E = VEC*VW fp8) and qsc[B, L] from a[B, L, *] (slots 0 .. na-1,
    identity) and m[B, L, *] (slots na .. na+nm-1, GELU), word views; see the module docstring.
    (LB_T, LB_B): the launch bounds, max threads and min blocks per SM (plain ints: a prebuild recipe)."""
    NS = NW // VW
    E = VEC * VW
    G = NS * E
    RED = RED_SMEM
    AMAX_FLOOR = f8.AMAX_FLOOR
    E4M3_MAX = f8.E4M3_MAX

    def rows_kernel(a, m, q, qsc, na, nm):
        smem = cuda.shared.array(RED, float32)
        w = cuda.local.array(NW, int64)
        g = cuda.local.array(G, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        ns = na + nm
        b = cuda.blockIdx.z
        while b < q.shape[0]:
            li = cuda.blockIdx.y
            while li < q.shape[1]:
                ar = a[b, li]
                mr = m[b, li]
                qr = q[b, li]
                for k in range(NS):  # every load first
                    j = tid + k * nt
                    if j < ns:
                        src = ar
                        jj = j
                        if j >= na:
                            src = mr
                            jj = j - na
                        if VW == 2:
                            t2 = ld2(src, 2 * jj)
                            w[2 * k] = t2[0]
                            w[2 * k + 1] = t2[1]
                        else:
                            w[k] = src[jj]
                mx = float32(0)
                for k in range(NS):
                    j = tid + k * nt
                    if j < ns:
                        for v in range(VW):
                            unpack_w(w[k * VW + v], g, k * E + v * VEC, VEC)
                        if j >= na:
                            for e in range(E):
                                g[k * E + e] = gelu_fast(g[k * E + e])
                        for e in range(E):
                            mx = max(mx, abs(g[k * E + e]))
                amax = max(block_max(mx, smem), float32(AMAX_FLOOR))
                qinv = fdiv_rn(float32(E4M3_MAX), amax)
                if tid == 0:
                    qsc[b, li] = fdiv_rn(amax, float32(E4M3_MAX))
                for k in range(NS):
                    j = tid + k * nt
                    if j < ns:
                        o = k * E
                        if E == 8:
                            qr[j] = e4m3x8(g[o] * qinv, g[o + 1] * qinv, g[o + 2] * qinv, g[o + 3] * qinv,
                                           g[o + 4] * qinv, g[o + 5] * qinv, g[o + 6] * qinv, g[o + 7] * qinv)
                        elif E == 4:
                            qr[j] = e4m3x4(g[o] * qinv, g[o + 1] * qinv, g[o + 2] * qinv, g[o + 3] * qinv)
                        else:
                            qr[j] = e4m3_1(g[o] * qinv)
                li += cuda.gridDim.y
            b += cuda.gridDim.z

    return jit_kernel(rows_kernel, launch_bounds=(LB_T, LB_B))


_launchers = {}


def _launcher(VEC, VW, cfg=FP8_ROWS):
    return launching.cached_launcher(_launchers, launcher_key((VEC, VW), cfg, FP8_ROWS), make_rows_kernel,
                                     VEC, cfg.nw(VEC, VW), VW, *cfg.lb(VEC, VW))


@functools.lru_cache(maxsize=1024)
def _threads(slots, NS):
    n = -(-slots // NS)
    return max(32, -(-n // 32) * 32)


def _views(*ts):
    """(VEC, VW, word views) shared by all inputs: 16-byte pairs when every one allows them,
    else 8-byte words, else int16 scalars."""
    ws = [launching.words(t) for t in ts]
    if all(w is not None for w in ws):
        return 4, (2 if launching.aligned16(*ws) else 1), ws
    return 1, 1, [t.view(torch.int16) for t in ts]


def _check_parts(*ts, config=None):
    why = launching.common_check(*ts)
    if why:
        return why
    ts = [_3d(t) for t in ts]
    x = ts[0]
    for t in ts:
        if t.ndim != 3:
            return f"inputs must be [B, L, K] or [rows, K], got {tuple(t.shape)}"
        if t.shape[:2] != x.shape[:2]:
            return f"shapes {tuple(t.shape)} and {tuple(x.shape)} differ in [B, L]"
        if t.shape[-1] % f8.K_ALIGN:
            return f"width {t.shape[-1]} is not a multiple of {f8.K_ALIGN}"
    K = sum(t.shape[-1] for t in ts)
    max_k = (config or FP8_ROWS).max_k
    if K > max_k:
        return f"row width {K} > {max_k}"
    return f8.check(K, x)


def _3d(t):
    return t[None] if t.ndim == 2 else t


def _launch(a, m, na_el, nm_el, cfg):
    """a / m bf16 [B, L, *] or [rows, *] (m may be a when nm_el == 0 and vice versa)."""
    a, m = _3d(a), _3d(m)
    B, L = a.shape[:2]
    K = na_el + nm_el
    VEC, VW, (aw, mw) = _views(a, m)
    E = VEC * VW
    q, qs = f8.empty(B * L, K, a.device)
    nt = _threads(K // E, cfg.nw(VEC, VW) // VW)
    _launcher(VEC, VW, cfg)(launching.grid3(1, L, B), nt, aw, mw, f8.q_words(q, E, B, L), qs.view(B, L), na_el // E, nm_el // E)
    return q, qs


def numba_quantize(x, config=None):
    """``config`` (all three backends): an Fp8RowsConfig (benchmarks / tests), else ``config.FP8_ROWS``."""
    return _launch(x, x, x.shape[-1], 0, config or FP8_ROWS)


def numba_gelu(x, config=None):
    return _launch(x, x, 0, x.shape[-1], config or FP8_ROWS)


def numba_cat(a, m, config=None):
    return _launch(a, m, a.shape[-1], m.shape[-1], config or FP8_ROWS)


registry.register_backend(OP_Q, "numba", numba_quantize, check=lambda x, config=None: _check_parts(x, config=config))
registry.register_backend(OP_GELU, "numba", numba_gelu, check=lambda x, config=None: _check_parts(x, config=config))
registry.register_backend(OP_CAT, "numba", numba_cat, check=lambda a, m, config=None: _check_parts(a, m, config=config))


def _ptx_cases():
    from numba import types as nt
    A = lambda dt, nd: nt.Array(dt, nd, "A")  # noqa: E731
    c = {}
    for (vec, vw), nw in FP8_ROWS.nw_for().items():
        dt = nt.int64 if vec == 4 else nt.int16
        qt = {(4, 2): nt.int64, (4, 1): nt.int32, (1, 1): nt.uint8}[(vec, vw)]
        c["fp8_rows v%dw%d" % (vec, vw)] = lambda vec=vec, vw=vw, nw=nw, dt=dt, qt=qt: (
            make_rows_kernel(vec, nw, vw, *FP8_ROWS.lb(vec, vw)), (A(dt, 3), A(dt, 3), A(qt, 3), A(nt.float32, 2), nt.int64, nt.int64))
    return c


PTX_CASES = _ptx_cases()
