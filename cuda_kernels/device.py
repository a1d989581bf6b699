"""Shared device helpers for the memory-bound kernels, each with a simulator-safe fallback.

Chosen once at import time from ``runtime.SIMULATOR``:
  * real GPU: ``@cuda.jit(device=True, forceinline=True)`` functions using libdevice bit casts
    (``int_as_float`` / ``float_as_int``) and warp shuffles (``shfl_xor_sync``);
  * simulator: plain Python (numpy/struct bit casts, shared-memory reductions, Python-int
    wrapping so numpy never sees an out-of-range integer).

bf16 handling: tensors are passed as integer *bit views* (int16 = one bf16, int64 = four bf16,
lowest address in the low bits).  Hot path (GPU: numba ``@intrinsic`` LLVM IR, 32-bit ops only,
and ``cvt.rn.bf16x2.f32`` inline PTX for round-to-nearest-even packing):
``unpack4(w)`` -> 4 float32, ``pack4(a, b, c, d)`` -> int64 word, ``bf2f(h)`` / ``pack1(f)`` for
one element (int16), ``round_bf16(f)`` (float32 rounded to bf16), ``unpack_f32x2(w)`` (two fp32
read as one int64), ``unpack_w(w, a, base, vec)`` (word -> local array).  Reference helpers
(also the simulator's building blocks): ``word_get``, ``f2bf`` (RNE from the float bits,
``(u + 0x7FFF + ((u >> 16) & 1)) >> 16``, NaN kept quiet), ``wrap_i64`` / ``wrap_i16``.

Reductions (float32): ``block_sum(v, smem)`` / ``block_max(v, smem)`` over the whole block
(blockDim a multiple of 32 on the GPU), ``group_sum(v, g, smem)`` / ``group_max(v, g, smem)`` over
aligned groups of g lanes (g a power of two <= 32).  ``fdiv_rn(a, b)``: IEEE round-to-nearest fp32
division even under fastmath (libdevice ``__fdiv_rn``; the fp8 scales must be bit-reproducible by
a torch reference).  ``wrap_i32``: like ``wrap_i64`` for 32-bit words.
``smem`` is a ``cuda.shared.array(RED_SMEM, float32)`` the kernel allocates; every thread of
the block must call the reduction (uniform control flow).

Nothing here compiles at import; importing works without numba (``NUMBA_OK`` is then False and
every helper is None).
"""
from __future__ import annotations

import struct

from .jit import NUMBA_OK, SIMULATOR, cuda  # noqa: F401  (kernel modules take ``cuda`` from here)

if NUMBA_OK:
    from numba import float32, int32, int64, int16  # noqa: F401
else:  # pragma: no cover - names exist so op modules import; checks decline
    float32 = int32 = int64 = int16 = None

RED_SMEM = 1024 if SIMULATOR else 33  # floats of shared scratch a reduction needs


if not NUMBA_OK:  # pragma: no cover - names exist so op modules import; checks decline
    bf2f = word_get = f2bf = wrap_i64 = wrap_i32 = wrap_i16 = lo_f32 = hi_f32 = None
    unpack4 = pack4 = pack1 = round_bf16 = unpack_f32x2 = unpack_w = None
    rsqrt = tanh = gelu_tanh = gelu_fast = block_sum = block_max = group_sum = group_max = fdiv_rn = None
    ld2 = st2 = None

elif SIMULATOR:
    import math

    import numpy as _np

    _F32 = _np.float32

    def bf2f(h):
        """bf16 bits (low 16 bits of an int) -> float32."""
        return _F32(struct.unpack("<f", struct.pack("<I", (int(h) & 0xFFFF) << 16))[0])

    def word_get(w, i):
        return bf2f(int(w) >> (16 * int(i)))

    def f2bf(f):
        u = struct.unpack("<I", struct.pack("<f", float(_F32(f))))[0]
        if (u & 0x7FFFFFFF) > 0x7F800000:
            return ((u >> 16) | 0x40) & 0xFFFF
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

    def wrap_i64(w):
        w = int(w) & 0xFFFFFFFFFFFFFFFF
        return w - (1 << 64) if w >= (1 << 63) else w

    def wrap_i32(w):
        w = int(w) & 0xFFFFFFFF
        return w - (1 << 32) if w >= (1 << 31) else w

    def wrap_i16(w):
        w = int(w) & 0xFFFF
        return w - (1 << 16) if w >= (1 << 15) else w

    def fdiv_rn(a, b):
        return _F32(_F32(a) / _F32(b))

    def lo_f32(w):
        """float32 in the low 32 bits of an int64 word (fp32 pairs read as int64)."""
        return _F32(struct.unpack("<f", struct.pack("<I", int(w) & 0xFFFFFFFF))[0])

    def hi_f32(w):
        return _F32(struct.unpack("<f", struct.pack("<I", (int(w) >> 32) & 0xFFFFFFFF))[0])

    def rsqrt(x):
        return _F32(1.0 / math.sqrt(float(x)))

    def unpack4(w):
        w = int(w)
        return bf2f(w), bf2f(w >> 16), bf2f(w >> 32), bf2f(w >> 48)

    def pack4(a, b, c, d):
        return wrap_i64(f2bf(a) | (f2bf(b) << 16) | (f2bf(c) << 32) | (f2bf(d) << 48))

    def pack1(a):
        return wrap_i16(f2bf(a))

    def round_bf16(a):
        return bf2f(f2bf(a))

    def unpack_f32x2(w):
        return lo_f32(w), hi_f32(w)

    def unpack_w(w, a, base, vec):
        if vec == 4:
            t = unpack4(w)
            a[base], a[base + 1], a[base + 2], a[base + 3] = t
        else:
            a[base] = bf2f(w)

    def tanh(x):
        return _F32(math.tanh(float(x)))

    def ld2(a, i):
        """Words a[i], a[i+1] (GPU: one 16-byte load; i even, row 16-byte aligned)."""
        return a[i], a[i + 1]

    def st2(a, i, w0, w1):
        a[i] = w0
        a[i + 1] = w1

    def gelu_fast(x):
        return gelu_tanh(x)

    def gelu_tanh(x):
        x = float(x)
        return _F32(0.5 * x * (1.0 + math.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))))

    @cuda.jit(device=True)
    def block_sum(v, smem):
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        smem[tid] = v
        cuda.syncthreads()
        s = _F32(0)
        for i in range(nt):
            s += smem[i]
        cuda.syncthreads()
        return s

    @cuda.jit(device=True)
    def block_max(v, smem):
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        smem[tid] = v
        cuda.syncthreads()
        s = smem[0]
        for i in range(1, nt):
            s = max(s, smem[i])
        cuda.syncthreads()
        return s

    @cuda.jit(device=True)
    def group_sum(v, g, smem):
        tid = cuda.threadIdx.x
        smem[tid] = v
        cuda.syncthreads()
        base = tid - tid % g
        s = _F32(0)
        for i in range(g):
            s += smem[base + i]
        cuda.syncthreads()
        return s

    @cuda.jit(device=True)
    def group_max(v, g, smem):
        tid = cuda.threadIdx.x
        smem[tid] = v
        cuda.syncthreads()
        base = tid - tid % g
        s = smem[base]
        for i in range(1, g):
            s = max(s, smem[base + i])
        cuda.syncthreads()
        return s

else:
    import math

    from numba.cuda import libdevice

    _dev = dict(device=True, forceinline=True)

    from llvmlite import ir as _ir
    from numba import types as _nbt
    from numba.cuda.extending import intrinsic as _intrinsic

    _I16, _I32, _I64, _F32T = _ir.IntType(16), _ir.IntType(32), _ir.IntType(64), _ir.FloatType()
    _HI16 = _ir.Constant(_I32, -65536)  # 0xFFFF0000
    # cvt.rn.bf16x2.f32 d, a, b: RNE, a -> upper half of d, b -> lower half (sm_80+)
    _CVT = _ir.InlineAsm(_ir.FunctionType(_I32, [_F32T, _F32T]), "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")

    def _as(context, builder, v, ty, to):
        return context.cast(builder, v, ty, to)

    @_intrinsic
    def unpack4(typingctx, w):
        """int64 word -> 4 float32 (element 0 = low 16 bits); pure 32-bit ops after one split."""
        if not isinstance(w, _nbt.Integer):
            return None
        sig = _nbt.UniTuple(_nbt.float32, 4)(w)

        def codegen(context, builder, sig, args):
            v = _as(context, builder, args[0], sig.args[0], _nbt.int64)
            lo = builder.trunc(v, _I32)
            hi = builder.trunc(builder.lshr(v, _ir.Constant(_I64, 32)), _I32)
            c16 = _ir.Constant(_I32, 16)
            fs = [builder.bitcast(builder.shl(lo, c16), _F32T), builder.bitcast(builder.and_(lo, _HI16), _F32T),
                  builder.bitcast(builder.shl(hi, c16), _F32T), builder.bitcast(builder.and_(hi, _HI16), _F32T)]
            return context.make_tuple(builder, sig.return_type, fs)
        return sig, codegen

    @_intrinsic
    def pack4(typingctx, a, b, c, d):
        """4 float32 -> int64 word of RNE bf16 (two cvt.rn.bf16x2.f32)."""
        if not all(isinstance(t, (_nbt.Float, _nbt.Integer)) for t in (a, b, c, d)):
            return None
        sig = _nbt.int64(a, b, c, d)

        def codegen(context, builder, sig, args):
            f = [_as(context, builder, v, t, _nbt.float32) for v, t in zip(args, sig.args)]
            p01 = builder.call(_CVT, [f[1], f[0]])
            p23 = builder.call(_CVT, [f[3], f[2]])
            return builder.or_(builder.zext(p01, _I64), builder.shl(builder.zext(p23, _I64), _ir.Constant(_I64, 32)))
        return sig, codegen

    @_intrinsic
    def pack1(typingctx, a):
        """float32 -> int16 RNE bf16 bits."""
        if not isinstance(a, (_nbt.Float, _nbt.Integer)):
            return None
        sig = _nbt.int16(a)

        def codegen(context, builder, sig, args):
            f = _as(context, builder, args[0], sig.args[0], _nbt.float32)
            p = builder.call(_CVT, [_ir.Constant(_F32T, 0.0), f])
            return builder.trunc(p, _I16)
        return sig, codegen

    @_intrinsic
    def round_bf16(typingctx, a):
        """float32 rounded (RNE) to the nearest bf16 value, as float32."""
        if not isinstance(a, (_nbt.Float, _nbt.Integer)):
            return None
        sig = _nbt.float32(a)

        def codegen(context, builder, sig, args):
            f = _as(context, builder, args[0], sig.args[0], _nbt.float32)
            p = builder.call(_CVT, [_ir.Constant(_F32T, 0.0), f])
            return builder.bitcast(builder.shl(p, _ir.Constant(_I32, 16)), _F32T)
        return sig, codegen

    @_intrinsic
    def bf2f(typingctx, h):
        """bf16 bits (low 16 bits of any int) -> float32."""
        if not isinstance(h, _nbt.Integer):
            return None
        sig = _nbt.float32(h)

        def codegen(context, builder, sig, args):
            v = _as(context, builder, args[0], sig.args[0], _nbt.int32)
            return builder.bitcast(builder.shl(v, _ir.Constant(_I32, 16)), _F32T)
        return sig, codegen

    @_intrinsic
    def unpack_f32x2(typingctx, w):
        """int64 word holding two float32 -> (low, high)."""
        if not isinstance(w, _nbt.Integer):
            return None
        sig = _nbt.UniTuple(_nbt.float32, 2)(w)

        def codegen(context, builder, sig, args):
            v = _as(context, builder, args[0], sig.args[0], _nbt.int64)
            lo = builder.bitcast(builder.trunc(v, _I32), _F32T)
            hi = builder.bitcast(builder.trunc(builder.lshr(v, _ir.Constant(_I64, 32)), _I32), _F32T)
            return context.make_tuple(builder, sig.return_type, [lo, hi])
        return sig, codegen

    _V2 = _ir.VectorType(_I64, 2)
    _EX2 = _ir.InlineAsm(_ir.FunctionType(_F32T, [_F32T]), "ex2.approx.ftz.f32 $0, $1;", "=f,f")
    _RCP = _ir.InlineAsm(_ir.FunctionType(_F32T, [_F32T]), "rcp.approx.ftz.f32 $0, $1;", "=f,f")

    def _vec_ptr(context, builder, aryty, ary_val, idx_val, idx_ty):
        from numba.cuda import cgutils as _cg
        ary = context.make_array(aryty)(context, builder, ary_val)
        idx = context.cast(builder, idx_val, idx_ty, _nbt.intp)
        ptr = _cg.get_item_pointer(context, builder, aryty, ary, [idx], wraparound=False)
        return builder.addrspacecast(builder.bitcast(ptr, _ir.PointerType(_V2)), _ir.PointerType(_V2, 1))

    def _is_words(a):
        return isinstance(a, _nbt.Array) and a.ndim == 1 and a.dtype == _nbt.int64

    @_intrinsic
    def ld2(typingctx, a, i):
        """(a[i], a[i+1]) of a 1-D int64 array with unit stride as ONE 16-byte global load
        (ld.global.v2.u64); the caller guarantees 16-byte alignment of &a[i]."""
        if not (_is_words(a) and isinstance(i, _nbt.Integer)):
            return None
        sig = _nbt.UniTuple(_nbt.int64, 2)(a, i)

        def codegen(context, builder, sig, args):
            p = _vec_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            v = builder.load(p, align=16)
            w = [builder.extract_element(v, _ir.Constant(_I32, e)) for e in range(2)]
            return context.make_tuple(builder, sig.return_type, w)
        return sig, codegen

    @_intrinsic
    def st2(typingctx, a, i, w0, w1):
        """a[i], a[i+1] = w0, w1 as ONE 16-byte global store (alignment as for ld2)."""
        if not (_is_words(a) and isinstance(i, _nbt.Integer)
                and isinstance(w0, _nbt.Integer) and isinstance(w1, _nbt.Integer)):
            return None
        sig = _nbt.none(a, i, w0, w1)

        def codegen(context, builder, sig, args):
            p = _vec_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            v = _ir.Constant(_V2, _ir.Undefined)
            for e in range(2):
                x = _as(context, builder, args[2 + e], sig.args[2 + e], _nbt.int64)
                v = builder.insert_element(v, x, _ir.Constant(_I32, e))
            builder.store(v, p, align=16)
            return context.get_dummy_value()
        return sig, codegen

    @_intrinsic
    def _ex2(typingctx, x):
        if not isinstance(x, _nbt.Float):
            return None
        sig = _nbt.float32(x)

        def codegen(context, builder, sig, args):
            return builder.call(_EX2, [_as(context, builder, args[0], sig.args[0], _nbt.float32)])
        return sig, codegen

    @_intrinsic
    def _rcp(typingctx, x):
        if not isinstance(x, _nbt.Float):
            return None
        sig = _nbt.float32(x)

        def codegen(context, builder, sig, args):
            return builder.call(_RCP, [_as(context, builder, args[0], sig.args[0], _nbt.float32)])
        return sig, codegen

    @cuda.jit(**_dev)
    def gelu_fast(x):
        """gelu_tanh as x * rcp(1 + 2^(x*(a + b*x^2))): ex2.approx + rcp.approx (2 MUFU ops,
        ~2^-22 relative error each), 6 FP32 ops; overflow gives x * 0 = -0 for very negative x."""
        x = float32(x)
        x2 = x * x
        t = x * (float32(-2.302208198) + float32(-0.10294324) * x2)  # -2*sqrt(2/pi)*log2(e)*(1, 0.044715)
        return x * _rcp(float32(1) + _ex2(t))

    @cuda.jit(**_dev)
    def unpack_w(w, a, base, vec):
        """Word -> a[base:base+vec] (vec 4: int64 word of 4 bf16; vec 1: one bf16)."""
        if vec == 4:
            t = unpack4(w)
            a[base] = t[0]
            a[base + 1] = t[1]
            a[base + 2] = t[2]
            a[base + 3] = t[3]
        else:
            a[base] = bf2f(w)

    @cuda.jit(**_dev)
    def word_get(w, i):
        return libdevice.int_as_float(int32(((int64(w) >> (16 * i)) & 0xFFFF) << 16))

    @cuda.jit(**_dev)
    def f2bf(f):
        u = int64(libdevice.float_as_int(float32(f))) & 0xFFFFFFFF
        if (u & 0x7FFFFFFF) > 0x7F800000:
            return ((u >> 16) | 0x40) & 0xFFFF
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

    @cuda.jit(**_dev)
    def wrap_i64(w):
        return int64(w)

    @cuda.jit(**_dev)
    def wrap_i32(w):
        return int32(w)

    @cuda.jit(**_dev)
    def wrap_i16(w):
        return int16(w)

    @cuda.jit(**_dev)
    def fdiv_rn(a, b):
        return libdevice.fdiv_rn(float32(a), float32(b))

    @cuda.jit(**_dev)
    def lo_f32(w):
        return libdevice.int_as_float(int32(int64(w) & 0xFFFFFFFF))

    @cuda.jit(**_dev)
    def hi_f32(w):
        return libdevice.int_as_float(int32((int64(w) >> 32) & 0xFFFFFFFF))

    @cuda.jit(**_dev)
    def rsqrt(x):
        return libdevice.rsqrtf(float32(x))

    @cuda.jit(**_dev)
    def tanh(x):
        return math.tanh(float32(x))

    @cuda.jit(**_dev)
    def gelu_tanh(x):
        """0.5*x*(1+tanh(u)) == x*sigmoid(2u) == x / (1 + exp(-2u)), u = sqrt(2/pi)*(x+0.044715x^3);
        exp overflow gives x/inf = -0 for very negative x (the true value underflows too)."""
        x = float32(x)
        u = float32(-1.5957691216057308) * (x + float32(0.044715) * x * x * x)
        return x / (float32(1) + math.exp(u))

    @cuda.jit(**_dev)
    def warp_sum(v):
        off = 16
        while off > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            off >>= 1
        return v

    @cuda.jit(**_dev)
    def block_sum(v, smem):
        tid = cuda.threadIdx.x
        v = warp_sum(v)
        if (tid & 31) == 0:
            smem[tid >> 5] = v
        cuda.syncthreads()
        s = float32(0)
        for i in range((cuda.blockDim.x + 31) >> 5):
            s += smem[i]
        cuda.syncthreads()
        return s

    @cuda.jit(**_dev)
    def warp_max(v):
        off = 16
        while off > 0:
            v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, off))
            off >>= 1
        return v

    @cuda.jit(**_dev)
    def block_max(v, smem):
        tid = cuda.threadIdx.x
        v = warp_max(v)
        if (tid & 31) == 0:
            smem[tid >> 5] = v
        cuda.syncthreads()
        s = smem[0]
        for i in range(1, (cuda.blockDim.x + 31) >> 5):
            s = max(s, smem[i])
        cuda.syncthreads()
        return s

    @cuda.jit(**_dev)
    def group_sum(v, g, smem):
        off = g >> 1
        while off > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            off >>= 1
        return v

    @cuda.jit(**_dev)
    def group_max(v, g, smem):
        off = g >> 1
        while off > 0:
            v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, off))
            off >>= 1
        return v

