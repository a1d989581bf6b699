"""GELU with the tanh approximation, optionally written into a slice of a larger buffer.

``gelu_tanh(x, out=None)``: x [B, L, M] (may be a row-strided view, e.g. the MLP half of the
single block's linear1 output); ``out`` [B, L, M] view (e.g. ``buf[..., C:]`` of the buffer that
feeds linear2), so the single block's ``cat(attn, gelu(mlp))`` copy disappears.

Numba backend ("numba", bf16 only): block per (chunk, row, batch) = grid (chunks, L, B), while
loops in all three (no integer division; a stepped ``range`` costs a 64-bit division per loop);
each thread loads 8 words = 32 bf16 as four 16-byte loads (x and out rows 16-byte aligned; else
four 8-byte words, else the int16 scalar fallback) before computing; fp32 math, one RNE rounding.
``0.5*x*(1+tanh(u))`` is evaluated as ``x * rcp(1 + 2^(-2u*log2 e))`` with ex2.approx and
rcp.approx (2 MUFU ops + ~6 FP32 ops per element; relative error ~1e-6 before rounding, so
outputs match the reference to 1 bf16 ulp).  The old version (accurate expf + IEEE division +
range loops) was instruction-issue bound at ~52% of copy bandwidth.

Bytes per call at FLUX 1024^2 (single block, B=1, L=4608, M=12288), floor at 3.7 TB/s:
  read x 113.2 MB + write out 113.2 MB = 226.5 MB -> 61.2 us
  (double-block MLP, L=4096: 201.3 MB -> 54.4 us; txt L=512: 25.2 MB -> 6.8 us)
"""
import functools

import torch
import torch.nn.functional as F

from . import launching
from .jit import jit_kernel
# module globals (not closure cells): the simulator swaps `cuda` per thread, and the on-disk
# cache key then only hashes the factory's int constants
from .device import cuda, float32, int64, unpack_w, pack4, pack1, gelu_fast, ld2, st2  # noqa: F401
from .registry import registry
from .config import GELU, launcher_key

OP = "gelu_tanh"


def reference(x, out=None):
    y = F.gelu(x, approximate="tanh")
    if out is None:
        return y
    out.copy_(y)
    return out


registry.register(OP, reference, doc=__doc__)

# ----------------------------------------------------------------------------- numba backend
# (VEC, VW) -> words per thread: VEC 4 = int64 words of 4 bf16 (VW 2: 16-byte ld/st pairs when
# x and out rows are 16-byte aligned, VW 1: 8-byte words), VEC 1 = int16 scalar fallback; and the
# most threads per row chunk: config.GeluConfig


def make_gelu_kernel(VEC, NW, VW=1):
    """out[B, L, Mw] = gelu(x[B, L, Mw]) on word views (any row strides).  Thread slot s of
    chunk c covers words (c*nt*NS + k*nt + tid)*VW .. +VW, k < NS = NW / VW: all NS loads are
    issued before any math.  While loops (a stepped ``range`` costs a 64-bit division)."""
    NS = NW // VW

    def gelu_kernel(x, out, nchunks):
        wx = cuda.local.array(NW, int64)
        ta = cuda.local.array(4, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        Ms = x.shape[2] // VW  # slots per row (VW divides Mw: checked by the launcher)
        b = cuda.blockIdx.z
        while b < x.shape[0]:
            li = cuda.blockIdx.y
            while li < x.shape[1]:
                xr = x[b, li]
                orow = out[b, li]
                c = cuda.blockIdx.x
                while c < nchunks:
                    base = c * nt * NS + tid
                    for k in range(NS):
                        j = base + k * nt
                        if j < Ms:
                            if VW == 2:
                                t2 = ld2(xr, 2 * j)
                                wx[2 * k] = t2[0]
                                wx[2 * k + 1] = t2[1]
                            else:
                                wx[k] = xr[j]
                    for k in range(NS):
                        j = base + k * nt
                        if j < Ms:
                            for v in range(VW):
                                unpack_w(wx[k * VW + v], ta, 0, VEC)
                                for e in range(VEC):
                                    ta[e] = gelu_fast(ta[e])
                                if VEC == 4:
                                    wx[k * VW + v] = pack4(ta[0], ta[1], ta[2], ta[3])
                                else:
                                    wx[k * VW + v] = pack1(ta[0])
                            if VW == 2:
                                st2(orow, 2 * j, wx[2 * k], wx[2 * k + 1])
                            elif VEC == 4:
                                orow[j] = wx[k]
                            else:
                                orow[j] = wx[k]
                    c += cuda.gridDim.x
                li += cuda.gridDim.y
            b += cuda.gridDim.z

    return jit_kernel(gelu_kernel)


_launchers = {}


@functools.lru_cache(maxsize=1024)
def _split(Mw, NW, THREADS):
    """(threads, chunks) for a row of Mw words, NW words per thread: chunks of equal size (no
    half-empty last chunk), threads a multiple of 32, at most THREADS."""
    n = -(-Mw // NW)  # threads wanted for one row
    nchunks = -(-n // THREADS)
    nt = max(32, -(-(-(-n // nchunks)) // 32) * 32)
    return nt, nchunks


def _launcher(VEC, VW, cfg=GELU):
    return launching.cached_launcher(_launchers, launcher_key((VEC, VW), cfg, GELU), make_gelu_kernel,
                                     VEC, cfg.nw(VEC, VW), VW)


def check(x, out=None, config=None):
    why = launching.common_check(x, out)
    if why:
        return why
    if x.ndim != 3:
        return f"x must be [B, L, M], got {tuple(x.shape)}"
    if out is not None and out.shape != x.shape:
        return f"out shape {tuple(out.shape)} != x {tuple(x.shape)}"
    return None


def numba_gelu_tanh(x, out=None, config=None):
    """``config``: a GeluConfig (benchmarks / tests), else ``config.GELU``."""
    cfg = config or GELU
    ret = out
    if out is None:
        ret = out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xw, ow = launching.words(x), launching.words(out)
    if xw is None or ow is None:
        VEC, VW, xw, ow = 1, 1, x.view(torch.int16), out.view(torch.int16)
    else:
        VEC, VW = 4, 2 if launching.aligned16(xw, ow) else 1
    B, L, Mw = xw.shape
    nt, nchunks = _split(Mw, cfg.nw(VEC, VW), cfg.threads)
    _launcher(VEC, VW, cfg)(launching.grid3(nchunks, L, B), nt, xw, ow, nchunks)
    return ret


registry.register_backend(OP, "numba", numba_gelu_tanh, check=check)
