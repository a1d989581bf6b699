"""Nearest-neighbour 2x upsampling of a channels_last (NHWC) activation (the VAE decoder's Upsample).

``upsample_nearest2x(x)``
  x: [N, C, H, W] in channels_last memory, any dtype with C * itemsize a multiple of 16 bytes;
  returns [N, C, 2H, 2W] channels_last = ``F.interpolate(x, scale_factor=2.0, mode="nearest")``
  (a pure copy: bit-exact).  torch's own NHWC kernel (``upsample_nearest2d_nhwc_out_frame``)
  runs the FLUX decoder's three upsamples ~9x slower than their copy floor (BENCHMARKS.md, VAE
  decoder); its NCHW kernel is what stock runs.

Numba backend, one launch: block = one input pixel row (n, h), grid-strided over the N H rows;
thread = 16-byte vectors i of the row (pixel i // CC, column i % CC, CC = C itemsize / 16 a
compile-time constant): one 16-byte load, four 16-byte stores (output pixels (2h, 2w), (2h, 2w+1),
(2h+1, 2w), (2h+1, 2w+1)).  A warp's 32 consecutive vectors are contiguous in both rows.

Bytes: read x once, write 4x: 5 numel itemsize.  FLUX decoder (bf16, 1024^2 image): 512x128^2 ->
256^2 84 MB, 512x256^2 -> 512^2 335 MB, 256x512^2 -> 1024^2 671 MB; 1.09 GB -> floor 0.29 ms.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import launching
from .jit import jit_kernel
from . import runtime
from .registry import registry
from .config import NHWC
from .device import cuda, ld2, st2  # noqa: F401

OP = "upsample_nearest2x"
SIMULATOR = runtime.SIMULATOR


def reference(x):
    """``F.interpolate(x, scale_factor=2.0, mode="nearest")`` (ComfyUI's ``interpolate_up``), channels_last."""
    return F.interpolate(x, scale_factor=2.0, mode="nearest").contiguous(memory_format=torch.channels_last)


registry.register(OP, reference, doc=__doc__)


def make_kernel(CC):
    def up2x(xw, yw, H, W, NH):
        """row = n H + h: the W CC vectors of input row (n, h) -> output rows 2h, 2h + 1 of sample n."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        WC = W * CC
        row = cuda.blockIdx.x
        while row < NH:
            n = row // H
            h = row - n * H
            src = row * WC
            d0 = (n * 2 * H + 2 * h) * 2 * WC
            d1 = d0 + 2 * WC
            i = tid
            while i < WC:
                w = i // CC
                j = i - w * CC
                t = ld2(xw, 2 * (src + i))
                o = 2 * w * CC + j
                st2(yw, 2 * (d0 + o), t[0], t[1])
                st2(yw, 2 * (d0 + o + CC), t[0], t[1])
                st2(yw, 2 * (d1 + o), t[0], t[1])
                st2(yw, 2 * (d1 + o + CC), t[0], t[1])
                i += nt
            row += cuda.gridDim.x

    return jit_kernel(up2x)


_launchers = {}


def _launcher(CC):
    return launching.cached_launcher(_launchers, CC, make_kernel, CC)


def check(x, config=None):
    why = launching.common_check(x, bf16_only=False)
    if why:
        return why
    if x.dim() != 4 or x.numel() == 0:
        return "x must be a non-empty [N, C, H, W]"
    if not x.is_contiguous(memory_format=torch.channels_last):
        return "x must be channels_last (NHWC) contiguous"
    if (x.shape[1] * x.element_size()) % 16:
        return f"C={x.shape[1]} x {x.element_size()} B is not a multiple of 16 bytes"
    if x.data_ptr() % 16:
        return "x not 16-byte aligned"
    if torch.is_grad_enabled() and x.requires_grad:
        return "no autograd"
    return None


def upsample_nearest2x_numba(x, config=None):
    """``config``: an NhwcConfig (benchmarks / tests; ``tpb`` used), else ``config.NHWC``."""
    cfg = config or NHWC
    N, C, H, W = x.shape
    y = torch.empty((N, C, 2 * H, 2 * W), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    xw, yw = launching.nhwc_words(x), launching.nhwc_words(y)
    NH = N * H
    grid = min(NH, 2) if SIMULATOR else min(NH, 32 * runtime.sm_count())
    _launcher(C * x.element_size() // 16)(grid, cfg.tpb, xw, yw, H, W, NH)
    return y


registry.register_backend(OP, "numba", upsample_nearest2x_numba, check=check, priority=10)
