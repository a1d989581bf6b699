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

``Launcher`` holds one lazily-compiled kernel and launches it on torch's current stream.
Nothing here compiles at import; importing works without numba (``NUMBA_OK`` is then False).
"""
from __future__ import annotations

import contextlib
import functools
import os
import struct
import time as _time

from . import runtime

try:
    from numba import cuda, float32, int32, int64, int16  # noqa: F401
    NUMBA_OK = True
except Exception:  # pragma: no cover - numba missing: backends decline via check
    cuda = None
    NUMBA_OK = False

SIMULATOR = runtime.SIMULATOR
RED_SMEM = 1024 if SIMULATOR else 33  # floats of shared scratch a reduction needs


def tree_hash(root) -> str:
    """sha256 over every *.py below ``root``, subfolders included (path relative to root + bytes,
    in sorted order; __pycache__ skipped)."""
    import hashlib
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).replace(os.sep, "/").encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """``tree_hash`` of cuda_kernels/ (the attention/ package included): part of each cached
    kernel's key, so an edit of any file a kernel is built from misses the cache."""
    return tree_hash(os.path.dirname(os.path.abspath(__file__)))


def keyed_on_sources(disp):
    """Make numba's on-disk cache key of dispatcher ``disp`` include ``source_hash()``.

    numba keys a cached kernel on its own bytecode, closure values and the *defining* file's
    mtime/size: an edit of a device function in another file (intrinsics.py) would load a stale
    kernel, and two kernels that differ only in jit options (launch_bounds) would share an entry.
    With the hash and the options in the index key a changed tree simply misses (and
    recompiles once).

    numba hashes the closure values by pickling them, and a device function (a dispatcher) in a
    kernel's closure pickles differently in every process: such a kernel (the LayerNorm row kernels
    capture their ``load_row``) never hit the cache after a restart.  The key is computed from a
    stand-in of the function whose closure holds plain values as they are and each device function
    as its module, name and (recursively) closure -- its code is covered by the source hash."""
    c = getattr(disp, "_cache", None)
    ik = getattr(c, "_index_key", None)
    if ik is None or getattr(ik, "_flux_keyed", False):
        return disp
    if getattr(c, "_py_func", None) is not None:
        c._py_func = _StableKeyFunc(c._py_func)
    # numba's key also omits the jit options (fastmath, launch_bounds): add them too
    opts = repr(sorted((k, repr(v)) for k, v in getattr(disp, "targetoptions", {}).items()))
    tag = ("flux_numba_sources", source_hash(), opts)

    def _index_key(sig, codegen):
        return ik(sig, codegen) + (tag,)
    _index_key._flux_keyed = True
    c._index_key = _index_key
    return disp


class _Cell:
    __slots__ = ("cell_contents",)

    def __init__(self, v):
        self.cell_contents = v


def _stable(v):
    """A process-independent stand-in for a closure value (device functions by name)."""
    f = getattr(v, "py_func", None)
    if f is not None and callable(f):
        cl = getattr(f, "__closure__", None) or ()
        mod = getattr(f, "__module__", "") or ""
        i = mod.find("cuda_kernels")  # the pack's own name for it: ComfyUI names the pack by its path
        return ("device function", mod[i:] if i >= 0 else mod, getattr(f, "__qualname__", ""),
                tuple(_stable(x.cell_contents) for x in cl))
    return v


class _StableKeyFunc:
    """What numba's cache key reads of a kernel's Python function (``__code__``, ``__closure__``),
    with the closure made process-independent (``_stable``)."""

    def __init__(self, f):
        self._f = f
        self.__code__ = f.__code__
        cl = f.__closure__
        self.__closure__ = None if cl is None else tuple(_Cell(_stable(x.cell_contents)) for x in cl)

    def __getattr__(self, name):
        return getattr(self._f, name)


def jit_kernel(fn=None, **kw):
    """``cuda.jit`` for kernels: fastmath + on-disk cache on the GPU (keyed on the hash of all
    cuda_kernels sources, see ``keyed_on_sources``), lazy compilation."""
    def deco(f):
        if not NUMBA_OK:
            return f
        if SIMULATOR:
            return cuda.jit(f)
        return keyed_on_sources(cuda.jit(f, fastmath=True, cache=True, **kw))
    return deco(fn) if fn is not None else deco


if not NUMBA_OK:  # pragma: no cover - names exist so op modules import; checks decline
    float32 = int32 = int64 = int16 = None
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


# ---------------------------------------------------------------------------------- launching
import numpy as _np  # noqa: E402
import torch  # noqa: E402

_HALF = (torch.bfloat16, torch.float16)


FORCE_VW1 = False  # benchmarks set it to time the 8-byte variants


def aligned16(*ws) -> bool:
    """Every int64 word view has a 16-byte aligned base, even row strides and an even last dim
    (so word pairs (2j, 2j+1) of every row can move as one 16-byte access)."""
    if FORCE_VW1:
        return False
    for w in ws:
        if w.data_ptr() % 16 or w.shape[-1] % 2:
            return False
        if any(st % 2 for st, n in zip(w.stride()[:-1], w.shape[:-1]) if n > 1):
            return False
    return True


def nhwc_words(t: torch.Tensor):
    """Flat int64 view of a channels_last-contiguous [N, C, H, W] tensor's NHWC memory (no copy)."""
    return t.permute(0, 2, 3, 1).view(-1).view(torch.int64)


def words(t: torch.Tensor):
    """int64 view of a bf16 tensor (4 elements per word) or None when not 8-byte aligned.

    torch's dtype view enforces exactly what the kernels need: unit stride and a size divisible
    by 4 on the last dim, storage offset and every other stride divisible by 4 elements."""
    if t.element_size() != 2:
        return None
    try:
        return t.view(torch.int64)
    except RuntimeError:
        return None


class Launcher:
    """A lazily compiled kernel launched on torch's current stream with few Python steps.

    ``launcher(grid, block, *args)``; args are torch tensors (16-bit floats are passed as int16
    bit views), Python ints (typed int64) and ``numpy.float32`` scalars.

    GPU fast path: on the first call for a given (dtype, ndim) argument pattern the kernel is
    compiled explicitly for layout-'A' arrays (``dispatcher.compile``: the on-disk cache is
    used), and every launch then builds the kernel parameters straight from the tensors'
    data_ptr/shape/strides -- no ``as_cuda_array``, no argument typing -- packs them into the
    signature's preallocated buffer and calls ``cuLaunchKernel`` (``_Prepared``; cuda.core's launch,
    the one numba uses, where that is unavailable or from another thread) on torch's current stream
    (CUDA-graph capturable).
    Any failure there disables the fast path (logged) and the ordinary numba launch
    (``kernel[grid, block, stream](*arrays)``, also what the simulator uses) takes over
    (benchmarks compare the two by setting ``_FAST_OK``).
    """

    __slots__ = ("factory", "args", "kernel", "_cfg", "_fast")

    def __init__(self, factory, *args):
        self.factory = factory  # factory(*args) -> numba dispatcher; called on first launch only
        self.args = args
        self.kernel = None
        self._cfg = {}
        self._fast = {} if _FAST_OK else None

    def dispatcher(self):
        """The numba dispatcher (``factory(*args)``, made once)."""
        k = self.kernel
        if k is None:
            k = self.kernel = self.factory(*self.args)
        return k

    def recipe(self):
        """(module, qualname, args) that rebuild this launcher's kernel in another process -- the
        factory must be a module-level function and its args plain values -- or None."""
        f = self.factory
        mod, qn = getattr(f, "__module__", None), getattr(f, "__qualname__", "")
        if not mod or "<" in qn or not all(isinstance(a, (int, str, bool)) for a in self.args):
            return None
        return mod, qn, self.args

    def __call__(self, grid, block, *args):
        col = getattr(_COLLECT, "jobs", None)
        if col is not None:  # planning the kernels to build (prebuild.plan): record, launch nothing
            col.append((self, signature(args)))
            return
        k = self.kernel
        if k is None:
            k = self.dispatcher()
        fast = self._fast
        if fast is not None:
            key = tuple((a.dtype, a.dim()) if isinstance(a, torch.Tensor) else type(a) for a in args)
            handle = fast.get(key)
            if handle is None:
                handle = fast[key] = self._compile_fast(args)
            if handle is not False:
                if type(handle) is _Prepared and handle.owner == _get_ident():
                    handle.launch(grid, block, args)
                    return
                cfg = self._cfg.get((grid, block))
                if cfg is None:
                    cfg = self._cfg[(grid, block)] = _launch_config(grid, block)
                if type(handle) is _Prepared:
                    handle = handle.kernel
                _cuda_launch(runtime.stream(), cfg, handle, *_param_values(args, _c_float))
                return
        st = runtime.stream()
        key = (grid, block, st)
        cfg = None if SIMULATOR else self._cfg.get(key)
        if cfg is None:
            if len(self._cfg) > 256:
                self._cfg.clear()
            # (the simulator's kernel[...] configures and returns the kernel object itself: a cached
            # configuration would launch with the grid of the latest one, so it is never reused there)
            if not SIMULATOR:
                compile_gate(self)
            cfg = k[grid, block, st]
            if not SIMULATOR:
                self._cfg[key] = cfg
        cfg(*[_arg(a) for a in args])

    def occupancy(self, nt, *args):
        """Blocks of ``nt`` threads per SM that the kernel compiled for these launch arguments
        keeps resident (CUDA occupancy API: registers, shared memory, launch bounds), or None in
        the simulator or when numba cannot say.  For grids sized to fill the GPU exactly once."""
        if SIMULATOR or not NUMBA_OK:
            return None
        col = getattr(_COLLECT, "jobs", None)
        if col is not None:  # planning: the kernel is recorded, no answer yet
            col.append((self, signature(args)))
            return None
        try:
            fn = self.compile(signature(args))._codelibrary.get_cufunc()
            n = cuda.current_context().get_active_blocks_per_multiprocessor(fn, nt, 0)
            return int(n[-1] if isinstance(n, tuple) else n)
        except Exception:  # pragma: no cover - GPU only
            return None

    def label(self) -> str:
        """The kernel's name in logs: its factory and arguments."""
        rec = self.recipe()
        return f"{rec[1]}{tuple(rec[2])}" if rec else getattr(self.factory, "__name__", "?")

    def compile(self, sig):
        """``dispatcher.compile(sig)``, after ``compile_gate`` (a kernel the background build holds is
        not compiled twice); a kernel that had to be compiled here (not in memory, not in numba's
        on-disk cache, not built in the background) is logged with its time."""
        disp = self.dispatcher()
        if sig in getattr(disp, "overloads", {}):
            return disp.compile(sig)
        compile_gate(self)
        misses = getattr(disp, "_cache_misses", None)
        before = misses.get(sig, 0) if misses is not None else 0
        t0 = _time.perf_counter()
        kern = disp.compile(sig)
        if misses is not None and misses.get(sig, 0) > before:
            import logging
            logging.getLogger("flux_numba").info("[flux_numba] kernel %s compiled on first use in %.2f s",
                                                 self.label(), _time.perf_counter() - t0)
        return kern

    def _compile_fast(self, args):
        global _FAST_OK
        try:
            kern = self.compile(signature(args))
            if getattr(kern, "cooperative", False):
                raise TypeError("cooperative kernel")
            cufunc = kern._codelibrary.get_cufunc()
            if PREPARED and _DRV is not None:
                try:
                    return _Prepared(cufunc, args)
                except Exception as e:  # pragma: no cover - GPU only
                    import logging
                    logging.getLogger("flux_numba").info("[flux_numba] prepared launch unavailable (%s: %s); "
                                                         "cuda.core's launch is used", type(e).__name__, e)
            return cufunc.kernel
        except Exception as e:  # pragma: no cover - GPU only
            import logging
            logging.getLogger("flux_numba").warning("[flux_numba] fast launch disabled (%s: %s); "
                                                    "using numba's launcher", type(e).__name__, e)
            _FAST_OK = False
            self._fast = None
            return False


def cached_launcher(cache: dict, key, factory, *args):
    """``cache[key]``, made on first use as ``Launcher(factory, *args)`` -- each op keeps one
    Launcher per compile-time constant set (its module's ``_launchers``, which tests inspect).
    ``factory`` a module-level function and ``args`` plain values, so that a worker process can
    build the same kernel (``prebuild``)."""
    la = cache.get(key)
    if la is None:
        la = cache[key] = Launcher(factory, *args)
    return la


# planning mode (prebuild.plan): this thread's Launchers record (launcher, signature) instead of
# launching; ``jobs`` is the list they append to
import threading as _threading  # noqa: E402
_COLLECT = _threading.local()


@contextlib.contextmanager
def collecting():
    """Within: this thread's Launcher calls record ``(launcher, numba signature)`` into the
    yielded list and launch nothing (outputs stay unwritten)."""
    prev = getattr(_COLLECT, "jobs", None)
    jobs = _COLLECT.jobs = []
    try:
        yield jobs
    finally:
        _COLLECT.jobs = prev


def planning() -> bool:
    """True inside ``collecting()`` on this thread (answers such as occupancy are not final)."""
    return getattr(_COLLECT, "jobs", None) is not None


def _no_gate(launcher=None):
    return None


compile_gate = _no_gate  # prebuild installs its wait here: a kernel being built elsewhere is not compiled twice


def signature(args):
    """numba argument types of a launch: layout-'A' arrays for tensors (16-bit floats as int16 bit
    views), int64 for ints, float32 for numpy.float32."""
    from numba import types as nt
    dts = {torch.int16: nt.int16, torch.bfloat16: nt.int16, torch.float16: nt.int16, torch.int64: nt.int64,
           torch.float32: nt.float32, torch.int32: nt.int32, torch.uint8: nt.uint8}
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append(nt.Array(dts[a.dtype], a.dim(), "A"))
        elif type(a) is int:
            sig.append(nt.int64)
        elif isinstance(a, _np.float32):
            sig.append(nt.float32)
        else:
            raise TypeError(f"kernel argument of type {type(a).__name__}")
    return tuple(sig)


def _arg(a):
    if isinstance(a, torch.Tensor):
        a = runtime.arr(a)
    if SIMULATOR and isinstance(a, _np.ndarray):
        # wrap without the simulator's copy-in/copy-out (which refuses strided views):
        # kernels then write straight into the torch tensor's memory
        a = _FakeCUDAArray(a)
    return a


def arr(t):
    """``runtime.arr`` plus the simulator wrapping (for arrays cached by the launchers)."""
    return _arg(t)


if SIMULATOR and NUMBA_OK:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as _FakeCUDAArray

    def _patch_sim_shared():
        """numba-cuda 0.30.4's simulator creates ``cuda.shared.array`` lazily per block WITHOUT a
        lock: two threads entering together can each get a private array, so a reduction then
        sums stale memory (seen as rare wrong rows in the first block, timing dependent).  Same
        lookup (caller file + line) under a lock; also avoids a full traceback per call."""
        import sys
        import threading

        from numba.core import types as _types
        from numba.np import numpy_support as _nps
        from numba.cuda.simulator import kernelapi as _ka
        if getattr(_ka.FakeCUDAShared.array, "_flux_locked", False):
            return
        orig = _ka.FakeCUDAShared.array
        lock = threading.Lock()

        def array(self, shape, dtype, alignment=None):
            if alignment is not None or shape == 0:
                return orig(self, shape, dtype, alignment)
            if isinstance(dtype, _types.Type):
                dtype = _nps.as_dtype(dtype)
            f = sys._getframe(1)
            caller = (f.f_code.co_filename, f.f_lineno)
            with lock:
                res = self._allocations.get(caller)
                if res is None:
                    res = self._allocations[caller] = _np.empty(shape, dtype)
            return res
        array._flux_locked = True
        _ka.FakeCUDAShared.array = array

    try:
        _patch_sim_shared()
    except Exception:  # pragma: no cover - simulator internals moved: keep the original
        pass

# Prepared launches (GPU): each (kernel, argument pattern) packs its parameters into one preallocated
# buffer with a precompiled ``struct`` layout and calls ``cuLaunchKernel`` (cuda.bindings) with a fixed
# ``void**`` array -- no per-launch argument objects.  Benchmarks compare it with cuda.core's launch by
# setting ``PREPARED`` (bench/gpu_launch_cost.py).
PREPARED = True
_DRV = None
_get_ident = _threading.get_ident


def _param_values(args, as_float):
    """A launch's kernel parameters in numba's ABI: per tensor (meminfo 0, parent 0, nitems, itemsize,
    data pointer, shape..., byte strides...), ints as int64 (intptr-sized, as numba passes shapes),
    anything else as a float32 through ``as_float``."""
    vals = []
    for a in args:
        if isinstance(a, torch.Tensor):
            es = a.element_size()
            vals += (0, 0, a.numel(), es, a.data_ptr())
            vals += a.shape
            vals += [st * es for st in a.stride()]
        elif type(a) is int:
            vals.append(a)
        else:
            vals.append(as_float(a))
    return vals


class _Prepared:
    """A compiled kernel's prepared launch for one argument pattern (tensors by dtype / ndim, ints,
    float32 scalars), used by the thread that made it (another thread takes cuda.core's launch: the
    buffer is never shared between threads)."""

    __slots__ = ("kernel", "fn", "st", "buf", "ptrs", "addr", "owner", "dims")

    def __init__(self, cufunc, args):
        import ctypes
        import struct
        self.kernel = cufunc.kernel  # cuda.core's launch handle (other threads)
        h = cufunc.handle
        if isinstance(h, _DRV.CUkernel):  # context-independent kernel: this context's function
            err, h = _DRV.cuKernelGetFunction(h)
            if err != _DRV.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuKernelGetFunction: {err}")
        self.fn = h
        fmt = []
        for a in args:
            if isinstance(a, torch.Tensor):
                fmt.append("q" * (5 + 2 * a.dim()))  # numba's array ABI: meminfo, parent, nitems, itemsize, data, shape, strides
            elif type(a) is int:
                fmt.append("q")
            else:
                fmt.append("f4x")  # float32, in its own 8-byte slot
        self.st = struct.Struct("<" + "".join(fmt))
        n = self.st.size // 8
        self.buf = ctypes.create_string_buffer(self.st.size)
        base = ctypes.addressof(self.buf)
        self.ptrs = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        self.addr = ctypes.addressof(self.ptrs)
        self.owner = _get_ident()
        self.dims = {}

    def launch(self, grid, block, args):
        d = self.dims.get((grid, block))
        if d is None:
            g = tuple(grid) + (1, 1) if isinstance(grid, tuple) else (grid, 1, 1)
            b = tuple(block) + (1, 1) if isinstance(block, tuple) else (block, 1, 1)
            if len(self.dims) > 256:
                self.dims.clear()
            d = self.dims[(grid, block)] = g[:3] + b[:3]
        self.st.pack_into(self.buf, 0, *_param_values(args, float))
        err, = _DRV.cuLaunchKernel(self.fn, d[0], d[1], d[2], d[3], d[4], d[5], 0,
                                   _DRV.CUstream(runtime._raw_stream()), self.addr, 0)
        if err != _DRV.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel: {err}")


_FAST_OK = False
if NUMBA_OK and not SIMULATOR:
    try:  # cuda.bindings' driver module, as numba-cuda itself imports it (no dependency of our own)
        from numba.cuda.cudadrv.driver import binding as _DRV
    except Exception:  # pragma: no cover - numba-cuda moved it: cuda.core's launch
        _DRV = None
    try:
        from ctypes import c_float as _c_float

        from numba.cuda.dispatcher import launch as _cuda_launch, LaunchConfig as _LaunchConfig
        from numba.cuda._compat import CUDA_CORE_GE_1_0 as _GE10

        def _launch_config(grid, block):
            if _GE10:
                return _LaunchConfig(grid=grid, block=block, shmem_size=0, is_cooperative=False)
            return _LaunchConfig(grid=grid, block=block, shmem_size=0, cooperative_launch=False)

        _FAST_OK = True
    except Exception:  # pragma: no cover - numba-cuda internals moved: ordinary launches
        _FAST_OK = False


@functools.lru_cache(maxsize=1024)
def grid3(nx: int, ny: int, nz: int):
    """3-D grid for kernels that grid-stride in x, y and z (y, z capped at 65535; 2x2x2 in the
    simulator so tests stay fast but still exercise the strides)."""
    if SIMULATOR:
        return (min(nx, 2), min(ny, 2), min(nz, 2))
    return (max(1, min(nx, 2 ** 31 - 1)), max(1, min(ny, 65535)), max(1, min(nz, 65535)))


def common_check(*tensors, bf16_only=True):
    """device / dtype reason shared by every backend's check (None when fine)."""
    why = runtime.device_ok(*tensors)
    if why:
        return why
    if not NUMBA_OK:
        return "numba not importable"
    if bf16_only:
        for t in tensors:
            if t is not None and t.dtype != torch.bfloat16:
                return f"numba kernels take bf16 tensors (got {t.dtype})"
    return None
