"""1x1 convolution of an NHWC bf16 activation on tensor cores (the VAE decoder's shortcuts and AttnBlock).

``conv1x1_nhwc(x, wp, bias=None, residual=None, norm=None)``: x [N, H, W, Cin] bf16 contiguous,
wp = ``conv3x3.pack_weight(w)`` of a [Cout, Cin, 1, 1] weight ([Cout, 1, Cin]); bias, residual and
the GroupNorm(+SiLU) prologue ``norm`` exactly as in conv3x3.py.  Returns [N, H, W, Cout] bf16.
It is conv3x3.py's kernel built with KSZ=1: the "halo" is the block's own TH x TW pixels, one tap,
an S-buffered cp.async ring for both operands (a plain GEMM with M = N H W, N = Cout, K = Cin).

Floor (H200, 765 TFLOP/s, 3.7 TB/s): nin_shortcut 512->256 @512^2: 69 GFLOP (90 us) / 201 MB
(54 us); 256->128 @1024^2: 69 GFLOP (90 us) / 403 MB (109 us) -- near balance, i.e. these want
the bigger tiles' full MMA rate AND full bandwidth; the AttnBlock's q / k / v / proj_out at 512
@128^2 (17 GFLOP, 34 MB each) are small.
"""
from __future__ import annotations

from .registry import registry
from .conv3x3 import reference as _reference, check_common, conv_nhwc_numba

OP = "conv1x1_nhwc"


def reference(x, wp, bias=None, residual=None, norm=None):
    """(GroupNorm+SiLU,) ``F.conv2d`` with the 1x1 weight, + residual (conv3x3.reference)."""
    return _reference(x, wp, bias, residual, norm, False)


registry.register(OP, reference, doc=__doc__)


def check(x, wp, bias=None, residual=None, norm=None):
    return check_common(x, wp, bias, residual, norm, 1, False)


def conv1x1_nhwc_numba(x, wp, bias=None, residual=None, norm=None, cfg=None):
    return conv_nhwc_numba(x, wp, bias, residual, norm, False, cfg=cfg)


registry.register_backend(OP, "numba", conv1x1_nhwc_numba, check=check, priority=10)
