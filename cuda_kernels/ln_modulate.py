"""LayerNorm (no affine) + adaLN modulate: ``y = LN(x) * (1 + scale) + shift``.

Shapes: x [B, L, C]; shift, scale [B, 1, C] (views of the modulation output: unit stride on C,
any batch stride).  Used before every qkv / mlp / linear1 / final linear of FLUX.

Numba backend ("numba", bf16 only): one thread block per row (grid (1, L, B), grid-stride), each
thread holds NW words of the row in registers (word = int64 = 4 bf16 when every row is 8-byte
aligned, else int16 = 1 bf16, the scalar fallback), exact two-pass statistics from registers
(mean, then sum of squared deviations; warp-shuffle + shared-memory block reductions), fp32
math, one bf16 rounding of the output (unpack: 32-bit shifts/masks; pack: cvt.rn.bf16x2.f32).  The stock path rounds LN(x) and (1 + scale) to bf16
before the addcmul; this kernel does not (differences are within one bf16 ulp of the output).

Bytes per call at FLUX 1024^2 (C = 3072, B = 1): read x + write y = 4*L*C bytes
(shift/scale 12 KB, cache-resident):
  img  L=4096: 50.3 MB -> 13.6 us floor at 3.7 TB/s
  txt  L=512 :  6.3 MB ->  1.7 us
  single L=4608: 56.6 MB -> 15.3 us
(stock: layer_norm + 1+scale + addcmul moves ~2x that.)
"""
import functools

import numpy as np
import torch
import torch.nn.functional as F

from . import intrinsics as ik
# module globals (not closure cells): the simulator swaps `cuda` per thread, and the on-disk
# cache key then only hashes the factory's int constants
from .intrinsics import cuda, float32, int64, unpack_w, pack4, pack1, round_bf16, block_sum, rsqrt  # noqa: F401
from .registry import registry

OP = "ln_modulate"


def reference(x, shift, scale, eps: float = 1e-6):
    """ComfyUI's math: ``addcmul(shift, layer_norm(x), 1 + scale)`` in x's dtype."""
    return torch.addcmul(shift, F.layer_norm(x, (x.shape[-1],), eps=eps), 1 + scale)


registry.register(OP, reference, doc=__doc__)

# ----------------------------------------------------------------------------- numba backend
MAX_THREADS = 1024
NW_FOR = {4: 4, 1: 16}  # words per thread for each word width (16 bf16 per thread)


def make_row_kernel(VEC, NW, GATED):
    """Row kernel factory.  GATED=1: first ``x += gate * y`` (x rounded to bf16 and stored),
    then LN + modulate of the new x.  Arrays are word views: x, y, out [B, L, Cw];
    gate, shift, scale [B, 1, Cw]."""

    RED = ik.RED_SMEM
    NV = NW * VEC  # floats of the row each thread keeps in registers

    def row_kernel(x, y, gate, shift, scale, out, eps):
        smem = cuda.shared.array(RED, float32)
        v = cuda.local.array(NV, float32)
        ta = cuda.local.array(4, float32)
        tb = cuda.local.array(4, float32)
        wx = cuda.local.array(NW, int64)
        wy = cuda.local.array(NW, int64)
        wg = cuda.local.array(NW, int64)
        wsh = cuda.local.array(NW, int64)
        wsc = cuda.local.array(NW, int64)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        Cw = x.shape[2]
        inv_n = float32(1) / float32(Cw * VEC)
        # grid (1, L, B), grid-stride in y / z: no integer division anywhere
        for b in range(cuda.blockIdx.z, x.shape[0], cuda.gridDim.z):
            for li in range(cuda.blockIdx.y, x.shape[1], cuda.gridDim.y):
                xr = x[b, li]  # 1-D row views: one index per access
                orow = out[b, li]
                yr = y[b, li]
                gr = gate[b, 0]
                shr = shift[b, 0]
                scr = scale[b, 0]
                # every load first (all in flight, shift/scale latency hidden behind the
                # reductions), then math
                for k in range(NW):
                    j = tid + k * nt
                    if j < Cw:
                        wx[k] = xr[j]
                        if GATED:
                            wy[k] = yr[j]
                            wg[k] = gr[j]
                        wsh[k] = shr[j]
                        wsc[k] = scr[j]
                s = float32(0)
                for k in range(NW):
                    j = tid + k * nt
                    if j < Cw:
                        unpack_w(wx[k], v, k * VEC, VEC)
                        if GATED:  # x_new = bf16(x + bf16(gate * y)), exactly stock's rounding
                            unpack_w(wy[k], ta, 0, VEC)
                            unpack_w(wg[k], tb, 0, VEC)
                            for e in range(VEC):
                                v[k * VEC + e] = round_bf16(v[k * VEC + e] + round_bf16(tb[e] * ta[e]))
                            if VEC == 4:
                                xr[j] = pack4(v[k * 4], v[k * 4 + 1], v[k * 4 + 2], v[k * 4 + 3])
                            else:
                                xr[j] = pack1(v[k])
                        for e in range(VEC):
                            s += v[k * VEC + e]
                    else:
                        for e in range(VEC):
                            v[k * VEC + e] = float32(0)
                mean = block_sum(s, smem) * inv_n
                q = float32(0)
                for k in range(NW):
                    if tid + k * nt < Cw:
                        for e in range(VEC):
                            d = v[k * VEC + e] - mean
                            q += d * d
                var = block_sum(q, smem) * inv_n
                r = rsqrt(var + eps)
                for k in range(NW):
                    j = tid + k * nt
                    if j < Cw:
                        unpack_w(wsh[k], ta, 0, VEC)
                        unpack_w(wsc[k], tb, 0, VEC)
                        for e in range(VEC):
                            ta[e] = (v[k * VEC + e] - mean) * r * (float32(1) + tb[e]) + ta[e]
                        if VEC == 4:
                            orow[j] = pack4(ta[0], ta[1], ta[2], ta[3])
                        else:
                            orow[j] = pack1(ta[0])

    return ik.jit_kernel(row_kernel)


_launchers = {}


def _launcher(VEC, GATED):
    key = (VEC, GATED)
    la = _launchers.get(key)
    if la is None:
        la = _launchers[key] = ik.Launcher(lambda: make_row_kernel(VEC, NW_FOR[VEC], GATED))
    return la


@functools.lru_cache(maxsize=1024)
def _threads(Cw, NW):
    """Threads per row block: enough for NW words each, a multiple of 32."""
    n = -(-Cw // NW)
    return min(MAX_THREADS, max(32, -(-n // 32) * 32))


def row_check(x, rows, vecs):
    """Shared check for the row kernels (ln_modulate and gated_residual_ln_modulate)."""
    why = ik.common_check(x, *rows, *vecs)
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


def check(x, shift, scale, eps: float = 1e-6):
    return row_check(x, (), (shift, scale))


def vec_views(x, *ts):
    """int64 word views of all tensors when every one is 8-byte aligned, else int16 views."""
    ws = [ik.words(t) for t in (x,) + ts]
    if all(w is not None for w in ws):
        return 4, ws
    return 1, [t.view(torch.int16) for t in (x,) + ts]


def _expand(t, B):
    return t if t.shape[0] == B else t.expand(B, *t.shape[1:])


def numba_ln_modulate(x, shift, scale, eps: float = 1e-6):
    B = x.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    VEC, (xw, ow, shw, scw) = vec_views(x, out, _expand(shift, B), _expand(scale, B))
    Cw = xw.shape[2]
    # y and gate are unused when GATED=0: pass x / shift again (same types, no extra work)
    _launcher(VEC, 0)(ik.grid3(1, x.shape[1], B), _threads(Cw, NW_FOR[VEC]),
                      xw, xw, shw, shw, scw, ow, np.float32(eps))
    return out


registry.register_backend(OP, "numba", numba_ln_modulate, check=check)
