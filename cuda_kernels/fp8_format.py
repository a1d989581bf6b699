"""The fp8 e4m3 row format of the fast profile's GEMM inputs (issue #13), shared by every
quantising kernel: ln_modulate_fp8, gated_residual_ln_modulate_fp8 (the row kernel of
ln_modulate), quantize_fp8 / gelu_tanh_fp8 / attn_gelu_fp8 (fp8_rows).

Format, for an activation of ``rows`` x K (rows = B*L, K a multiple of 16):
  * ``q``     torch.float8_e4m3fn [rows, K], rows contiguous (written by the kernels as uint8 /
              int32 / int64 words, see ``q_words``); what ``torch._scaled_mm`` takes as A;
  * ``scale`` float32 [rows, 1] (``_scaled_mm``'s row-wise ``scale_a``), x ~= q.float() * scale.
Per row: ``amax = max(max |x|, AMAX_FLOOR)`` (AMAX_FLOOR = 1e-12: a row of zeros gets the finite
nonzero scale 1e-12/448 = 2.2e-15 and q = 0, no branch; a row whose amax is below 1e-12 but not
zero is quantised against 1e-12, i.e. coarser -- irrelevant for FLUX activations),
``inv = 448 / amax`` and ``scale = amax / 448`` (both IEEE round-to-nearest fp32 divisions:
``fdiv_rn`` on the GPU even under fastmath, ``torch.div`` of two fp32 tensors in the
reference), ``q = e4m3(x * inv)``: round to nearest even with saturation to +-448 (PTX
``cvt.rn.satfinite.e4m3x2.f32``, sm_89+; in the simulator the bit-exact software conversion
``e4m3_bits``).  NaN stays NaN (0x7F); +-inf saturate to +-448.

x is the fp32 value the kernel already holds (LN + modulate output, GELU output, the bf16 input
widened), never a bf16-rounded copy of it: the references compute the same fp32 math in torch and
quantise with ``quantize_rows_reference``.  Kernel and reference then differ only where the fp32
math itself rounds differently (summation order of the LN statistics, FMA contraction under
fastmath, ex2/rcp.approx GELU): at most one e4m3 step on an element that sits at a rounding
boundary; the scale matches to an fp32 ulp (amax is an exact max).  On the GPU fp32 subnormal
inputs are flushed to zero (fastmath ftz): harmless, as |x| * inv < 1.2e-38 * 448 / 1e-12 is far
below e4m3's smallest subnormal 2^-9.

Why per-token (row) scales and not per-tensor: one pass, no global reduction before the
quantisation (the kernel that writes the GEMM input has the whole row), and FLUX's activations
have outlier tokens (a per-tensor scale would crush the others).  The GEMM applies
``acc * scale_a[m] * scale_b[n]`` in its fp32 epilogue (cuBLASLt / CUTLASS row-wise scaling).
"""
from __future__ import annotations

import struct

import numpy as np
import torch

from . import runtime

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-12
FP8 = getattr(torch, "float8_e4m3fn", None)
K_ALIGN = 16          # _scaled_mm: K (and N) multiples of 16
MIN_CC = (8, 9)       # cvt.*.e4m3x2.f32 (Ada, Hopper, Blackwell)


# ----------------------------------------------------------------------------- torch side
def quantize_rows_reference(x):
    """fp32 ``x`` [..., K] -> (q float8_e4m3fn [rows, K], scale float32 [rows, 1]), rows = the
    product of the leading dims; the format above, in torch (the kernels' reference)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    amax = x2.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR)
    # tensor / tensor: a true IEEE division (``448.0 / t`` is reciprocal(t) * 448 in torch, and a
    # division by a Python scalar may become a multiply by its reciprocal on CUDA)
    c = torch.full_like(amax, E4M3_MAX)
    inv = c / amax
    q = (x2 * inv).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)  # clamp: older torch casts overflow to NaN
    return q, amax / c


def dequant(q, scale):
    """x ~= q.float() * scale (fp32, [rows, K])."""
    return q.float() * scale


def empty(rows: int, K: int, device):
    """Uninitialised (q [rows, K] fp8, scale [rows, 1] fp32) for a kernel to fill."""
    return (torch.empty((rows, K), dtype=FP8, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


_WORD = {8: torch.int64, 4: torch.int32, 1: torch.uint8}


def q_words(q, E: int, B: int, L: int):
    """``q`` [B*L, K] as the [B, L, K/E] word view a kernel writes E fp8 per store into
    (E 8: int64, 4: int32, 1: uint8)."""
    w = q.view(torch.uint8)
    if E != 1:
        w = w.view(_WORD[E])
    return w.view(B, L, -1)


def check(K: int, *tensors):
    """Reason the fp8 kernels cannot produce this format here (None when they can): torch without
    float8_e4m3fn, K not a multiple of 16, a GPU below sm_89 (no cvt to e4m3)."""
    if FP8 is None:
        return "this torch has no float8_e4m3fn"
    if K % K_ALIGN:
        return f"K={K} is not a multiple of {K_ALIGN} (fp8 GEMM operands)"
    if not runtime.SIMULATOR:
        for t in tensors:
            if t is not None and t.is_cuda:
                cc = _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())
                if cc < MIN_CC:
                    return f"fp8 e4m3 conversion needs sm_89+ (GPU is sm_{cc[0]}{cc[1]})"
    return None


_CC = {}


def _capability(index):
    cc = _CC.get(index)
    if cc is None:
        cc = _CC[index] = tuple(torch.cuda.get_device_capability(index))
    return cc


# ----------------------------------------------------------------------------- device side
def e4m3_bits(f) -> int:
    """Bit-exact float32 -> e4m3 (fn: no inf, 0x7F NaN) byte, round to nearest even, saturating
    to +-448: the simulator's conversion and the software definition of the GPU's cvt."""
    u = struct.unpack("<I", struct.pack("<f", float(np.float32(f))))[0]
    s = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:           # NaN
        return s | 0x7F
    if a >= 0x43E00000:          # |f| >= 448 (inf included): saturate
        return s | 0x7E
    if a < 0x3C800000:           # |f| < 2^-6: the subnormal grid m * 2^-9 (m = 8 is 2^-6, code 0x08)
        m = round(struct.unpack("<f", struct.pack("<I", a))[0] * 512.0)  # exact product, half-even
        return s | m
    # normal: drop 20 mantissa bits with RNE (a carry moves into the exponent), rebias 127 -> 7
    return s | (((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3))


try:
    from numba import cuda  # noqa: F401
    _NUMBA = True
except Exception:  # pragma: no cover
    _NUMBA = False

if not _NUMBA:  # pragma: no cover - names exist so op modules import; checks decline
    e4m3_1 = e4m3x4 = e4m3x8 = None

elif runtime.SIMULATOR:
    from .device import wrap_i32, wrap_i64

    def e4m3_1(a):
        """float32 -> e4m3 byte (0..255)."""
        return e4m3_bits(a)

    def e4m3x4(a, b, c, d):
        """4 float32 -> int32 of 4 e4m3 bytes (a in the lowest byte = lowest address)."""
        return wrap_i32(e4m3_bits(a) | (e4m3_bits(b) << 8) | (e4m3_bits(c) << 16) | (e4m3_bits(d) << 24))

    def e4m3x8(a, b, c, d, e, f, g, h):
        """8 float32 -> int64 of 8 e4m3 bytes (a lowest)."""
        lo = e4m3_bits(a) | (e4m3_bits(b) << 8) | (e4m3_bits(c) << 16) | (e4m3_bits(d) << 24)
        hi = e4m3_bits(e) | (e4m3_bits(f) << 8) | (e4m3_bits(g) << 16) | (e4m3_bits(h) << 24)
        return wrap_i64(lo | (hi << 32))

else:
    from llvmlite import ir as _ir
    from numba import types as _nbt
    from numba.cuda.extending import intrinsic as _intrinsic

    _I16, _I32, _I64, _F32T = _ir.IntType(16), _ir.IntType(32), _ir.IntType(64), _ir.FloatType()
    # cvt.rn.satfinite.e4m3x2.f32 d, a, b: a -> upper byte of the 16-bit d, b -> lower (sm_89+)
    _CVT8 = _ir.InlineAsm(_ir.FunctionType(_I16, [_F32T, _F32T]),
                          "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f")

    def _floats(context, builder, sig, args):
        return [context.cast(builder, v, t, _nbt.float32) for v, t in zip(args, sig.args)]

    def _x4(builder, f):
        lo = builder.zext(builder.call(_CVT8, [f[1], f[0]]), _I32)
        hi = builder.zext(builder.call(_CVT8, [f[3], f[2]]), _I32)
        return builder.or_(lo, builder.shl(hi, _ir.Constant(_I32, 16)))

    def _num(*ts):
        return all(isinstance(t, (_nbt.Float, _nbt.Integer)) for t in ts)

    @_intrinsic
    def e4m3_1(typingctx, a):
        """float32 -> e4m3 byte (int32 0..255)."""
        if not _num(a):
            return None
        sig = _nbt.int32(a)

        def codegen(context, builder, sig, args):
            f = _floats(context, builder, sig, args)
            return builder.zext(builder.call(_CVT8, [_ir.Constant(_F32T, 0.0), f[0]]), _I32)
        return sig, codegen

    @_intrinsic
    def e4m3x4(typingctx, a, b, c, d):
        """4 float32 -> int32 of 4 e4m3 bytes (a lowest): two cvt.rn.satfinite.e4m3x2.f32."""
        if not _num(a, b, c, d):
            return None
        sig = _nbt.int32(a, b, c, d)

        def codegen(context, builder, sig, args):
            return _x4(builder, _floats(context, builder, sig, args))
        return sig, codegen

    @_intrinsic
    def e4m3x8(typingctx, a, b, c, d, e, f, g, h):
        """8 float32 -> int64 of 8 e4m3 bytes (a lowest): four cvt.rn.satfinite.e4m3x2.f32."""
        if not _num(a, b, c, d, e, f, g, h):
            return None
        sig = _nbt.int64(a, b, c, d, e, f, g, h)

        def codegen(context, builder, sig, args):
            fs = _floats(context, builder, sig, args)
            lo = builder.zext(_x4(builder, fs[:4]), _I64)
            hi = builder.zext(_x4(builder, fs[4:]), _I64)
            return builder.or_(lo, builder.shl(hi, _ir.Constant(_I64, 32)))
        return sig, codegen


# ------------------------------------------------------------------ conversion check kernel
_conv = {}


def _make_convert_kernel():
    from .jit import jit_kernel

    def convert(x, o8, o4, o1):
        """x float32 [n] (n % 8 == 0) -> the same bytes three ways: o8 int64 [n/8] (e4m3x8),
        o4 int32 [n/4] (e4m3x4), o1 uint8 [n] (e4m3_1)."""
        i = cuda.grid(1)
        st = cuda.gridsize(1)
        while i < o8.shape[0]:
            b = 8 * i
            o8[i] = e4m3x8(x[b], x[b + 1], x[b + 2], x[b + 3], x[b + 4], x[b + 5], x[b + 6], x[b + 7])
            o4[2 * i] = e4m3x4(x[b], x[b + 1], x[b + 2], x[b + 3])
            o4[2 * i + 1] = e4m3x4(x[b + 4], x[b + 5], x[b + 6], x[b + 7])
            for e in range(8):
                o1[b + e] = e4m3_1(x[b + e])
            i += st
    return jit_kernel(convert)


def convert_bytes(x):
    """Run the device conversion helpers over fp32 ``x`` (1-D, padded to a multiple of 8 here):
    (bytes via e4m3x8, via e4m3x4, via e4m3_1), each uint8 [len(x)] -- the GPU's cvt (or the
    simulator's software conversion), for tests and the bench to compare with torch's cast."""
    from .launching import Launcher
    n = x.numel()
    xp = torch.zeros(-(-n // 8) * 8, dtype=torch.float32, device=x.device)
    xp[:n] = x.reshape(-1)
    m = xp.numel()
    o8 = torch.empty(m // 8, dtype=torch.int64, device=x.device)
    o4 = torch.empty(m // 4, dtype=torch.int32, device=x.device)
    o1 = torch.empty(m, dtype=torch.uint8, device=x.device)
    la = _conv.get("k")
    if la is None:
        la = _conv["k"] = Launcher(_make_convert_kernel)
    la(runtime.grid_for(m // 8, 256), 256 if not runtime.SIMULATOR else 32, xp, o8, o4, o1)
    return tuple(t.view(torch.uint8)[:n] for t in (o8, o4, o1))
