"""GELU with the tanh approximation, optionally written into a slice of a larger buffer.

``gelu_tanh(x, out=None)``: x [B, L, M] (may be a row-strided view, e.g. the MLP half of the
single block's linear1 output); ``out`` [B, L, M] view (e.g. ``buf[..., C:]`` of the buffer that
feeds linear2), so the single block's ``cat(attn, gelu(mlp))`` copy disappears.

Numba backend ("numba", bf16 only): block per (chunk of NT*NW words, row, batch) = grid
(chunks, L, B), grid-stride in all three (no integer division); each
thread loads NW words (int64 = 4 bf16 when x and out rows are 8-byte aligned, int16 scalar
fallback otherwise) before computing; fp32 math, one RNE rounding (the reference also computes
in fp32 and rounds once).  ``0.5*x*(1+tanh(u))`` is evaluated as ``x / (1 + exp(-2u))`` (same
function; one fast exp + one division per element keeps the kernel memory-bound).

Bytes per call at FLUX 1024^2 (single block, B=1, L=4608, M=12288), floor at 3.7 TB/s:
  read x 113.2 MB + write out 113.2 MB = 226.5 MB -> 61.2 us
  (double-block MLP, L=4096: 201.3 MB -> 54.4 us; txt L=512: 25.2 MB -> 6.8 us)
"""
import torch
import torch.nn.functional as F

from . import intrinsics as ik
# module globals (not closure cells): the simulator swaps `cuda` per thread, and the on-disk
# cache key then only hashes the factory's int constants
from .intrinsics import cuda, float32, int64, unpack_w, pack4, pack1, gelu_tanh  # noqa: F401
from .registry import registry

OP = "gelu_tanh"


def reference(x, out=None):
    y = F.gelu(x, approximate="tanh")
    if out is None:
        return y
    out.copy_(y)
    return out


registry.register(OP, reference, doc=__doc__)

# ----------------------------------------------------------------------------- numba backend
NW_FOR = {4: 4, 1: 16}
THREADS = 256


def make_gelu_kernel(VEC, NW):
    """out[B, L, Mw] = gelu(x[B, L, Mw]) on word views (any row strides)."""


    def gelu_kernel(x, out, nchunks):
        wx = cuda.local.array(NW, int64)
        ta = cuda.local.array(4, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        Mw = x.shape[2]
        # grid (chunks, L, B), grid-stride in every dimension: no integer division
        for b in range(cuda.blockIdx.z, x.shape[0], cuda.gridDim.z):
            for li in range(cuda.blockIdx.y, x.shape[1], cuda.gridDim.y):
                xr = x[b, li]
                orow = out[b, li]
                for c in range(cuda.blockIdx.x, nchunks, cuda.gridDim.x):
                    base = c * nt * NW + tid
                    for k in range(NW):
                        j = base + k * nt
                        if j < Mw:
                            wx[k] = xr[j]
                    for k in range(NW):
                        j = base + k * nt
                        if j < Mw:
                            unpack_w(wx[k], ta, 0, VEC)
                            for e in range(VEC):
                                ta[e] = gelu_tanh(ta[e])
                            if VEC == 4:
                                orow[j] = pack4(ta[0], ta[1], ta[2], ta[3])
                            else:
                                orow[j] = pack1(ta[0])

    return ik.jit_kernel(gelu_kernel)


_launchers = {}


def _launcher(VEC):
    la = _launchers.get(VEC)
    if la is None:
        la = _launchers[VEC] = ik.Launcher(lambda: make_gelu_kernel(VEC, NW_FOR[VEC]))
    return la


def check(x, out=None):
    why = ik.common_check(x, out)
    if why:
        return why
    if x.ndim != 3:
        return f"x must be [B, L, M], got {tuple(x.shape)}"
    if out is not None and out.shape != x.shape:
        return f"out shape {tuple(out.shape)} != x {tuple(x.shape)}"
    return None


def numba_gelu_tanh(x, out=None):
    ret = out
    if out is None:
        ret = out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xw, ow = ik.words(x), ik.words(out)
    if xw is None or ow is None:
        VEC, xw, ow = 1, x.view(torch.int16), out.view(torch.int16)
    else:
        VEC = 4
    B, L, Mw = xw.shape
    NW = NW_FOR[VEC]
    n = -(-Mw // NW)  # threads wanted for one row
    nt = min(THREADS, max(32, -(-n // 32) * 32))
    nchunks = -(-Mw // (nt * NW))
    _launcher(VEC)(ik.grid3(nchunks, L, B), nt, xw, ow, nchunks)
    return ret


registry.register_backend(OP, "numba", numba_gelu_tanh, check=check)
