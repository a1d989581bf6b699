"""Per-channel bias (+ residual) added in place to a channels_last (NHWC) convolution output.

``bias_residual_nhwc(y, bias, residual=None)``
  y: [N, C, H, W] bf16 channels_last (a convolution's output computed without its bias);
  bias [C] bf16 or fp32; residual None or a tensor like y.  y becomes y + bias (+ residual) and is
  returned.  Why: torch's cuDNN convolution adds its bias in a separate broadcast kernel
  (``elementwise_kernel<128, 4>``, not vectorised: ~3x its bytes' floor over the FLUX decoder's 39
  convolutions, BENCHMARKS.md VAE decoder), and a ResnetBlock then adds the residual in one more pass.  Here both are one pass at copy bandwidth, and the sum is rounded once (fp32
  y + bias + residual -> bf16; stock rounds after the bias and again after the residual: the
  reference does the same).

Numba backend, one launch: a grid-stride stream over the 16-byte vectors of y whose stride is a
multiple of C/8, so each thread's 8 channels -- and their 8 biases, registers -- never change;
4 independent 16-byte loads (+ 4 of the residual) in flight per thread, 16-byte stores.
C must be a multiple of 8 with C/8 <= 256, tensors 16-byte aligned, residual channels_last.

Bytes: read y (+ residual), write y: 2 (3) numel 2 B.  FLUX decoder: the 14 ResnetBlocks' conv2 +
the attention's proj_out with residual (1.8 GB), the other 24 convolutions' bias only (3.0 GB,
of which conv1's 14 move into the next GroupNorm instead, see groupnorm_silu_nhwc's pre_bias).
"""
from __future__ import annotations

import torch

from . import launching
from .jit import NUMBA_OK, jit_kernel
from . import runtime
from .registry import registry
from .config import NHWC
from .device import cuda, float32, unpack4, pack4, ld2, st2, bf2f  # noqa: F401

OP = "bias_residual_nhwc"
SIMULATOR = runtime.SIMULATOR
U = 4  # loads per thread per iteration: the kernel's main loop is unrolled by hand for 4


def reference(y, bias, residual=None):
    """Stock math: the conv's bias add (rounded to y's dtype), then ``x + h`` (rounded again)."""
    y.add_(bias.to(y.dtype).view(1, -1, 1, 1))
    if residual is not None:
        y.add_(residual)
    return y


registry.register(OP, reference, doc=__doc__, mutates=(0,))

if NUMBA_OK:
    _dev = cuda.jit(device=True) if SIMULATOR else cuda.jit(device=True, forceinline=True)

    @_dev
    def _w4(w, r, b0, b1, b2, b3, res):
        """One int64 word of 4 bf16 channels (+ the residual's word) + 4 biases -> the rounded word."""
        t = unpack4(w)
        if res == 1:
            q = unpack4(r)
            return pack4(t[0] + b0 + q[0], t[1] + b1 + q[1], t[2] + b2 + q[2], t[3] + b3 + q[3])
        return pack4(t[0] + b0, t[1] + b1, t[2] + b2, t[3] + b3)


def make_kernel(CC, RES, B16):
    def bias_res(yw, rw, bias, V):
        """Vectors v of y (V in all; grid stride a multiple of CC): y[v] += bias (+ r[v])."""
        tid = cuda.threadIdx.x
        stride = cuda.gridDim.x * cuda.blockDim.x
        i = cuda.blockIdx.x * cuda.blockDim.x + tid
        c0 = 8 * (i % CC)
        if B16 == 1:
            b0 = bf2f(bias[c0])
            b1 = bf2f(bias[c0 + 1])
            b2 = bf2f(bias[c0 + 2])
            b3 = bf2f(bias[c0 + 3])
            b4 = bf2f(bias[c0 + 4])
            b5 = bf2f(bias[c0 + 5])
            b6 = bf2f(bias[c0 + 6])
            b7 = bf2f(bias[c0 + 7])
        else:
            b0 = float32(bias[c0])
            b1 = float32(bias[c0 + 1])
            b2 = float32(bias[c0 + 2])
            b3 = float32(bias[c0 + 3])
            b4 = float32(bias[c0 + 4])
            b5 = float32(bias[c0 + 5])
            b6 = float32(bias[c0 + 6])
            b7 = float32(bias[c0 + 7])
        while i + (U - 1) * stride < V:
            t0 = ld2(yw, 2 * i)
            t1 = ld2(yw, 2 * (i + stride))
            t2 = ld2(yw, 2 * (i + 2 * stride))
            t3 = ld2(yw, 2 * (i + 3 * stride))
            if RES == 1:
                r0 = ld2(rw, 2 * i)
                r1 = ld2(rw, 2 * (i + stride))
                r2 = ld2(rw, 2 * (i + 2 * stride))
                r3 = ld2(rw, 2 * (i + 3 * stride))
            else:
                r0 = t0
                r1 = t1
                r2 = t2
                r3 = t3
            st2(yw, 2 * i, _w4(t0[0], r0[0], b0, b1, b2, b3, RES), _w4(t0[1], r0[1], b4, b5, b6, b7, RES))
            st2(yw, 2 * (i + stride), _w4(t1[0], r1[0], b0, b1, b2, b3, RES),
                _w4(t1[1], r1[1], b4, b5, b6, b7, RES))
            st2(yw, 2 * (i + 2 * stride), _w4(t2[0], r2[0], b0, b1, b2, b3, RES),
                _w4(t2[1], r2[1], b4, b5, b6, b7, RES))
            st2(yw, 2 * (i + 3 * stride), _w4(t3[0], r3[0], b0, b1, b2, b3, RES),
                _w4(t3[1], r3[1], b4, b5, b6, b7, RES))
            i += U * stride
        while i < V:
            t0 = ld2(yw, 2 * i)
            if RES == 1:
                r0 = ld2(rw, 2 * i)
            else:
                r0 = t0
            st2(yw, 2 * i, _w4(t0[0], r0[0], b0, b1, b2, b3, RES), _w4(t0[1], r0[1], b4, b5, b6, b7, RES))
            i += stride

    return jit_kernel(bias_res)


_launchers = {}


def _launcher(*key):
    return launching.cached_launcher(_launchers, key, make_kernel, *key)


def _nhwc16(t):
    return (t.dim() == 4 and t.dtype == torch.bfloat16 and t.is_contiguous(memory_format=torch.channels_last)
            and t.data_ptr() % 16 == 0)


def check(y, bias, residual=None, config=None):
    why = launching.common_check(y, bias, residual, bf16_only=False)
    if why:
        return why
    if not _nhwc16(y) or y.numel() == 0:
        return "y must be a non-empty 16-byte aligned channels_last bf16 [N, C, H, W]"
    C = y.shape[1]
    tpb = (config or NHWC).tpb
    if C % 8 or C // 8 > tpb:
        return f"C={C}: a multiple of 8, <= {8 * tpb}"
    if bias is None or bias.dim() != 1 or bias.numel() != C or bias.dtype not in (torch.bfloat16, torch.float32):
        return "bias must be [C] bf16/fp32"
    if residual is not None and (not _nhwc16(residual) or residual.shape != y.shape):
        return "residual must be a 16-byte aligned channels_last bf16 tensor of y's shape"
    if torch.is_grad_enabled() and (y.requires_grad or bias.requires_grad):
        return "no autograd"
    return None


def bias_residual_nhwc_numba(y, bias, residual=None, config=None):
    """``config``: an NhwcConfig (benchmarks / tests; ``tpb`` used), else ``config.NHWC``."""
    C = y.shape[1]
    CC = C // 8
    yw = launching.nhwc_words(y)
    rw = yw if residual is None else launching.nhwc_words(residual)
    V = y.numel() // 8
    tpb = ((config or NHWC).tpb // CC) * CC
    grid = 2 if SIMULATOR else max(1, min(-(-V // (tpb * U)), 8 * runtime.sm_count()))
    _launcher(CC, 0 if residual is None else 1, 1 if bias.dtype == torch.bfloat16 else 0)(grid, tpb, yw, rw, bias, V)
    return y


registry.register_backend(OP, "numba", bias_residual_nhwc_numba, check=check, priority=10)
