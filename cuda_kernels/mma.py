"""Warp-level tensor-core helpers for Numba-CUDA (mma.sync, ldmatrix, cp.async, quad shuffles).

Real path (a GPU, sm_80+): ``@intrinsic`` functions emitting llvmlite inline PTX; under LTO they
inline into the kernel.  Simulator path (``NUMBA_ENABLE_CUDASIM=1``): plain-Python device
functions with the SAME fragment layout, so a kernel's indexing / softmax logic runs unchanged on
tiny shapes in CI.  In the simulator every thread is a Python thread, so a warp-collective op
(mma, ldmatrix, shuffle) is emulated by each lane writing its operands into a per-block shared
scratch ``scr`` (int32, ``SCR_WORDS`` words; ``scrf`` float32, ``SCRF_WORDS``), a
``syncthreads``, each lane reading what it needs, and another ``syncthreads``.  That is only
faithful when the whole block calls the helper uniformly (which a ``.sync.aligned`` op requires
of a warp anyway): kernels using these helpers must keep mma/ldmatrix/quad_* in block-uniform
control flow.  On the GPU ``scr``/``scrf`` are ignored: kernels allocate them with the size
constants below (1 word on the GPU, so they cost nothing).

Layouts (m16n8k16, g = lane // 4, t = lane % 4; a 32-bit register holds two 16-bit values,
the lower index in the low half):
  A (16x16, row): a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10]
  B (16x8, col) : b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]
  C/D (16x8 f32): d0, d1 = D[g, 2t:2t+2], d2, d3 = D[g+8, 2t:2t+2]
m16n8k32 s8 (4 bytes per register, lowest index in the lowest byte; C/D s32 as above):
  a0 = A[g, 4t:4t+4], a1 = A[g+8, 4t:4t+4], a2 = A[g, 4t+16:4t+20], a3 = A[g+8, 4t+16:4t+20]
  b0 = B[4t:4t+4, g], b1 = B[4t+16:4t+20, g]
  (ldmatrix on int8 rows viewed as 16-bit pairs yields exactly these A / B registers.)
ldmatrix.x4: lane l gives the address of row l % 8 of matrix l // 8 (16 bytes, 16-byte aligned);
register j of lane l = matrix j, row l // 4, 16-bit columns 2(l%4), 2(l%4)+1.  With .trans,
register j = matrix j, column l // 4, rows 2(l%4), 2(l%4)+1.
Shared arrays are 1-D int32 (word) arrays; shared addresses are 32-bit byte addresses.

Helpers (same signatures on both paths):
  mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr) -> (d0, d1, d2, d3)   m16n8k16, fp32 acc
  mma_f16(...)  same with fp16 operands;  mma_s8(...) m16n8k32 int8 operands, int32 accumulators
  smem_base(sm) -> int32                     shared-window byte address of sm[0] (0 in the simulator);
                                             helpers below take ``smem_base(sm) + 4 * word``
  ldsm_x4(sm, addr, scr) / ldsm_x4_t(sm, addr, scr) -> (r0, r1, r2, r3)      int32 registers
  cp_async16(sm, saddr, gm, gword, nbytes)   16-byte global->shared copy, zero-filled past nbytes
                                             (0 or 16); gm: 1-D int32 global array
  cp_commit(), cp_wait0(), cp_wait1()         cp.async group control (cp_wait_n(n): any depth)
  quad_max(x, scrf) / quad_sum(x, scrf)       reduce over the 4 lanes of a quad (xor 1, 2)
  pack_bf16(lo, hi) / pack_f16(lo, hi) -> int32   two fp32 -> bf16x2 / f16x2, round to nearest even
  bf16_lo(w) / bf16_hi(w) -> float32          unpack
Hopper (sm_90a) warpgroup MMA -- the whole 128-thread warpgroup calls uniformly:
  wgmma_op(N, transb, kind="bf16") -> wg(acc, a0, a1, a2, a3, desc, scale_d, sm, scr)
      m64nNk16 bf16 (m64nNk32 s8 with kind="s8"; u8 A x s8 B with kind="u8s8"), A from registers (each warp: its 16 rows in the
      mma.m16n8k16 / k32 A layout above), B from shared memory through a 64-bit descriptor:
      (addr >> 4) | (LBO >> 4) << 16 | (SBO >> 4) << 32, swizzle 0 ("interleave": each 8 x 16-byte
      core matrix is 128 contiguous bytes).  LBO = byte distance between core matrices along K,
      SBO = along M/N (K-major B: transb=0; MN-major B: transb=1, bf16 only).  acc: local array of
      N/2 f32 (s32) in the C/D layout above, repeated per 8 columns; accumulates when scale_d.
      Integer kinds take N = 8, 16, 24, 32, 48, 64, ... 256 (multiples of 16 above 32; PTX ISA).
      The simulator emulates it from the descriptor (no-swizzle only).
  wg_fence() / wg_commit() / wg_wait0()      wgmma.fence / commit_group / wait_group 0
  fence_proxy_async()                         fence.proxy.async.shared::cta (cp.async -> wgmma)
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from . import runtime

SIMULATOR = runtime.SIMULATOR

# scratch sizes a kernel must allocate (per block) for the simulator fallbacks
MAX_THREADS = 288           # 2 warpgroups + a producer warp
SCR_WORDS = 2 * MAX_THREADS * 6 if SIMULATOR else 1
SCRF_WORDS = 2 * MAX_THREADS if SIMULATOR else 1
_WG_KINDS = ("bf16", "s8", "u8s8")     # wgmma_op's operand kinds

if not SIMULATOR:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _i32 = ir.IntType(32)
    _i64 = ir.IntType(64)
    _f32 = ir.FloatType()

    def _ptr(context, builder, aryty, ary, idxty, idx):
        """Generic pointer to element ``idx`` of a 1-D array."""
        a = context.make_array(aryty)(context, builder, value=ary)
        idx = context.cast(builder, idx, idxty, types.intp)
        return cgutils.get_item_pointer(context, builder, aryty, a, [idx], wraparound=False)

    def _smem_addr(context, builder, aryty, ary, idxty, idx):
        """32-bit shared-window address of element ``idx`` of a shared 1-D array."""
        p = _ptr(context, builder, aryty, ary, idxty, idx)
        g = builder.ptrtoint(p, _i64)
        cvta = ir.InlineAsm(ir.FunctionType(_i64, [_i64]), "cvta.to.shared.u64 $0, $1;", "=l,l")
        return builder.trunc(builder.call(cvta, [g]), _i32)

    def _mma(shape_types, acc):
        """mma.sync intrinsic: 4 A regs, 2 B regs (int32), 4 accumulators (f32 or s32)."""
        nty, lty, cons = (types.float32, _f32, "f") if acc == "f32" else (types.int32, _i32, "r")
        text = ("mma.sync.aligned." + shape_types +
                " {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

        @intrinsic
        def _impl(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            sig = types.UniTuple(nty, 4)(types.int32, types.int32, types.int32, types.int32,
                                         types.int32, types.int32, nty, nty, nty, nty)

            def codegen(context, builder, s, args):
                args = [context.cast(builder, v, t, st) for v, t, st in zip(args, s.args, sig.args)]
                rty = ir.LiteralStructType([lty] * 4)
                fnty = ir.FunctionType(rty, [_i32] * 6 + [lty] * 4)
                asm = ir.InlineAsm(fnty, text, ",".join(["=" + cons] * 4 + ["r"] * 6 + [cons] * 4))
                r = builder.call(asm, args)
                return context.make_tuple(builder, s.return_type, [builder.extract_value(r, i) for i in range(4)])

            return sig, codegen
        return _impl

    _mma_bf16 = _mma("m16n8k16.row.col.f32.bf16.bf16.f32", "f32")
    _mma_f16 = _mma("m16n8k16.row.col.f32.f16.f16.f32", "f32")
    _mma_s8 = _mma("m16n8k32.row.col.s32.s8.s8.s32", "s32")

    def _ldsm(trans):
        inst = "ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") + ".shared.b16"

        @intrinsic
        def _impl(typingctx, addr):
            sig = types.UniTuple(types.int32, 4)(addr)

            def codegen(context, builder, s, args):
                addr = context.cast(builder, args[0], s.args[0], types.int32)
                rty = ir.LiteralStructType([_i32] * 4)
                asm = ir.InlineAsm(ir.FunctionType(rty, [_i32]), inst + " {$0, $1, $2, $3}, [$4];",
                                   "=r,=r,=r,=r,r,~{memory}", side_effect=True)
                r = builder.call(asm, [addr])
                return context.make_tuple(builder, s.return_type,
                                          [builder.extract_value(r, i) for i in range(4)])

            return sig, codegen
        return _impl

    _ldsm_n = _ldsm(False)
    _ldsm_t = _ldsm(True)

    @intrinsic
    def _smem_base(typingctx, sm):
        sig = types.int32(sm)

        def codegen(context, builder, s, args):
            return _smem_addr(context, builder, s.args[0], args[0], types.intp, context.get_constant(types.intp, 0))

        return sig, codegen

    @intrinsic
    def _cp_async16(typingctx, saddr, gm, gword, nbytes):
        sig = types.void(saddr, gm, gword, nbytes)

        def codegen(context, builder, s, args):
            saddr = context.cast(builder, args[0], s.args[0], types.int32)
            gp = builder.ptrtoint(_ptr(context, builder, s.args[1], args[1], s.args[2], args[2]), _i64)
            n = context.cast(builder, args[3], s.args[3], types.int32)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32, _i64, _i32]),
                               "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                               side_effect=True)
            builder.call(asm, [saddr, gp, n])
            return context.get_dummy_value()

        return sig, codegen

    def _asm_void(text):
        @intrinsic
        def _impl(typingctx):
            sig = types.void()

            def codegen(context, builder, s, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return sig, codegen
        return _impl

    _cp_commit = _asm_void("cp.async.commit_group;")
    _cp_wait0 = _asm_void("cp.async.wait_group 0;")
    _cp_wait1 = _asm_void("cp.async.wait_group 1;")

    def _pack2(fmt):
        @intrinsic
        def _impl(typingctx, lo, hi):
            def codegen(context, builder, s, args):
                lo_ = context.cast(builder, args[0], s.args[0], types.float32)
                hi_ = context.cast(builder, args[1], s.args[1], types.float32)
                asm = ir.InlineAsm(ir.FunctionType(_i32, [_f32, _f32]), f"cvt.rn.{fmt}.f32 $0, $2, $1;", "=r,f,f")
                return builder.call(asm, [lo_, hi_])

            return types.int32(lo, hi), codegen
        return _impl

    _pack_bf16 = _pack2("bf16x2")
    _pack_f16 = _pack2("f16x2")

    def _bitcast(src, dst, dst_ir):
        """An intrinsic reinterpreting a 32-bit value (cast to ``src`` first) as ``dst``."""
        @intrinsic
        def _impl(typingctx, x):
            sig = dst(x)

            def codegen(context, builder, s, args):
                return builder.bitcast(context.cast(builder, args[0], s.args[0], src), dst_ir)

            return sig, codegen
        return _impl

    _bits_f32 = _bitcast(types.int32, types.float32, _f32)
    _f32_bits = _bitcast(types.float32, types.int32, _i32)


    # ---- Hopper warpgroup MMA (wgmma, sm_90a): bf16 x bf16 -> f32, B from a shared-memory descriptor,
    # A from registers (same per-warp fragment as mma.m16n8k16), accumulators in a local array that
    # LLVM keeps in registers (constant indices only).
    def _wgmma(N, transb, kind="bf16"):
        NA = N // 2
        s8 = kind in ("s8", "u8s8")     # integer kinds: s32 accumulators, no scale / transpose immediates
        tail = ", p;\n}" if s8 else ", p, 1, 1, " + str(int(transb)) + ";\n}"
        shape = {"s8": "k32.s32.s8.s8 {", "u8s8": "k32.s32.u8.s8 {"}.get(kind, "k16.f32.bf16.bf16 {")
        text = ("{\n.reg .pred p;\nsetp.ne.b32 p, $" + str(NA + 5) + ", 0;\n"
                "wgmma.mma_async.sync.aligned.m64n" + str(N) + shape +
                ", ".join("$" + str(i) for i in range(NA)) + "}, {$" + str(NA) + ", $" + str(NA + 1) +
                ", $" + str(NA + 2) + ", $" + str(NA + 3) + "}, $" + str(NA + 4) + tail)
        ac, at = ("r", _i32) if s8 else ("f", _f32)
        cons = ",".join(["=" + ac] * NA + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(NA)] + ["~{memory}"])

        @intrinsic
        def _impl(typingctx, acc, a0, a1, a2, a3, desc, scale_d):
            sig = types.void(acc, a0, a1, a2, a3, desc, scale_d)

            def codegen(context, builder, s, args):
                aryty, ary = s.args[0], args[0]
                ptrs = [_ptr(context, builder, aryty, ary, types.intp, context.get_constant(types.intp, i))
                        for i in range(NA)]
                accs = [builder.load(p) for p in ptrs]
                regs = [context.cast(builder, v, t, types.int32) for v, t in zip(args[1:5], s.args[1:5])]
                d = context.cast(builder, args[5], s.args[5], types.int64)
                sc = context.cast(builder, args[6], s.args[6], types.int32)
                rty = ir.LiteralStructType([at] * NA)
                fnty = ir.FunctionType(rty, [_i32] * 4 + [_i64, _i32] + [at] * NA)
                asm = ir.InlineAsm(fnty, text, cons, side_effect=True)
                r = builder.call(asm, regs + [d, sc] + accs)
                for i in range(NA):
                    builder.store(builder.extract_value(r, i), ptrs[i])
                return context.get_dummy_value()

            return sig, codegen
        return _impl

    _wg_cache = {}

    def wgmma_op(N, transb, kind="bf16"):
        """Device function wg(acc, a0, a1, a2, a3, desc, scale_d, sm, scr): acc (N/2 f32, local array)
        = A (64x16, registers) @ B (16xN, descriptor) + (acc if scale_d else 0).  B is K-major
        (transb=0) or MN-major (transb=1).  kind="s8": m64nNk32 int8 x int8 -> int32 (acc int32,
        K-major B only); kind="u8s8": the same with A unsigned (uint8 A x int8 B).  Issue only:
        wg_commit() + wg_wait0() before reading acc."""
        assert kind in _WG_KINDS and not (transb and kind != "bf16"), (kind, transb)
        assert kind == "bf16" or N <= 32 and N % 8 == 0 or N % 16 == 0, (kind, N)
        key = (N, bool(transb), kind)
        f = _wg_cache.get(key)
        if f is None:
            raw = _wgmma(N, transb, kind)

            @cuda.jit(device=True, inline=True)
            def f(acc, a0, a1, a2, a3, desc, scale_d, sm, scr):
                raw(acc, a0, a1, a2, a3, desc, scale_d)
            _wg_cache[key] = f
        return f

    _wg_fence = _asm_void("wgmma.fence.sync.aligned;")
    _wg_commit = _asm_void("wgmma.commit_group.sync.aligned;")
    _wg_wait0 = _asm_void("wgmma.wait_group.sync.aligned 0;")
    _fence_async = _asm_void("fence.proxy.async.shared::cta;")

    @cuda.jit(device=True, inline=True)
    def wg_fence():
        _wg_fence()

    @cuda.jit(device=True, inline=True)
    def wg_commit():
        _wg_commit()

    @cuda.jit(device=True, inline=True)
    def wg_wait0():
        _wg_wait0()

    @cuda.jit(device=True, inline=True)
    def fence_proxy_async():
        _fence_async()

    @cuda.jit(device=True, inline=True)
    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr):
        return _mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    @cuda.jit(device=True, inline=True)
    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr):
        return _mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    @cuda.jit(device=True, inline=True)
    def mma_s8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr):
        return _mma_s8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    @cuda.jit(device=True, inline=True)
    def smem_base(sm):
        return _smem_base(sm)

    @cuda.jit(device=True, inline=True)
    def ldsm_x4(sm, addr, scr):
        return _ldsm_n(addr)

    @cuda.jit(device=True, inline=True)
    def ldsm_x4_t(sm, addr, scr):
        return _ldsm_t(addr)

    @cuda.jit(device=True, inline=True)
    def cp_async16(sm, saddr, gm, gword, nbytes):
        _cp_async16(saddr, gm, gword, nbytes)

    @cuda.jit(device=True, inline=True)
    def cp_commit():
        _cp_commit()

    @cuda.jit(device=True, inline=True)
    def cp_wait0():
        _cp_wait0()

    @cuda.jit(device=True, inline=True)
    def cp_wait1():
        _cp_wait1()

    @cuda.jit(device=True, inline=True)
    def quad_max(x, scrf):
        x = max(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, 1))
        return max(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, 2))

    @cuda.jit(device=True, inline=True)
    def quad_sum(x, scrf):
        x = x + cuda.shfl_xor_sync(0xFFFFFFFF, x, 1)
        return x + cuda.shfl_xor_sync(0xFFFFFFFF, x, 2)

    @cuda.jit(device=True, inline=True)
    def pack_bf16(lo, hi):
        return _pack_bf16(lo, hi)

    @cuda.jit(device=True, inline=True)
    def pack_f16(lo, hi):
        return _pack_f16(lo, hi)

    @cuda.jit(device=True, inline=True)
    def bf16_lo(w):
        return _bits_f32(w << 16)

    @cuda.jit(device=True, inline=True)
    def bf16_hi(w):
        return _bits_f32(w & int32(-65536))

    @cuda.jit(device=True, inline=True)
    def bits_f32(w):
        """The float32 whose bits are the int32 w (a register move, no conversion)."""
        return _bits_f32(w)

    @cuda.jit(device=True, inline=True)
    def f32_bits(x):
        """The int32 bits of the float32 x (a register move, no conversion)."""
        return _f32_bits(x)

    @intrinsic
    def _fadd_rn(typingctx, a, b):
        sig = types.float32(a, b)

        def codegen(context, builder, s, args):
            x = context.cast(builder, args[0], s.args[0], types.float32)
            y = context.cast(builder, args[1], s.args[1], types.float32)
            asm = ir.InlineAsm(ir.FunctionType(_f32, [_f32, _f32]), "add.rn.f32 $0, $1, $2;", "=f,f,f")
            return builder.call(asm, [x, y])

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def fadd_rn(a, b):
        """a + b rounded to nearest, opaque to fast-math reassociation (a rounding step that
        ``(a + b) - b`` must not fold away)."""
        return _fadd_rn(a, b)

else:
    # ------------------------------------------------------------------ simulator fallbacks
    def _f32_to_bf16_bits(x):
        u = int(np.array(x, dtype=np.float32).view(np.uint32))
        if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN
            return 0x7FC0
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

    def _bits_to_f32(u16):
        return float(np.array((int(u16) & 0xFFFF) << 16, dtype=np.uint32).view(np.float32))

    def _s32(u):
        u &= 0xFFFFFFFF
        return u - (1 << 32) if u >= (1 << 31) else u

    def _half(w, i):
        return (int(w) >> (16 * i)) & 0xFFFF

    def _tid():
        return cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)

    import threading

    _gbar = {}
    _gbar_lock = threading.Lock()

    def _group_sync(size):
        """Barrier of the ``size`` threads (a warp: 32, a warpgroup: 128) holding this thread: the
        hardware ops emulated here synchronise only those, and a warp-specialised kernel's
        producer warp never calls them (a block-wide syncthreads would deadlock on it)."""
        tid = _tid()
        key = (cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z, tid // size, size)
        with _gbar_lock:
            b = _gbar.get(key)
            if b is None:
                b = _gbar[key] = threading.Barrier(size)
        b.wait()

    # where each element of a warp's A (16 x K) / B (K x 8) lives: word = lane * 6 + register,
    # shift = which bits (the fragment layouts in the module docstring); E = elements per register
    def _tables(E):
        K = 8 * E  # 16 for 16-bit types, 32 for 8-bit
        m, k = np.meshgrid(np.arange(16), np.arange(K), indexing="ij")
        aw = ((m % 8) * 4 + (k % (K // 2)) // E) * 6 + (m // 8) + 2 * (k // (K // 2))
        ash = ((32 // E) * (k % E)).astype(np.uint32)
        k, n = np.meshgrid(np.arange(K), np.arange(8), indexing="ij")
        bw = (n * 4 + (k % (K // 2)) // E) * 6 + 4 + k // (K // 2)
        bsh = ((32 // E) * (k % E)).astype(np.uint32)
        return aw, ash, bw, bsh

    _T16 = _tables(2)
    _T8 = _tables(4)

    def _slot(words_per_block):
        """Alternate between two scratch halves: a helper call needs one barrier, not two (the
        next call's barrier orders this call's reads before the half is written again)."""
        th = threading.current_thread()
        p = getattr(th, "_mma_par", 0)
        th._mma_par = p ^ 1
        return p * words_per_block

    def _decode(words, idx, shift, kind):
        u = (words[idx] >> shift)
        if kind == "bf16":
            return ((u & np.uint32(0xFFFF)) << np.uint32(16)).view(np.float32).astype(np.float64)
        if kind == "f16":
            return (u & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)
        return (u & np.uint32(0xFF)).astype(np.uint8).view(np.int8).astype(np.int64)

    def _mma_sim(regs, cs, scr, kind):
        tid = _tid()
        lane = tid % 32
        base = _slot(MAX_THREADS * 6) + (tid - lane) * 6
        w = base + lane * 6
        for i in range(6):
            scr[w + i] = regs[i]
        _group_sync(32)
        words = np.asarray(scr[base:base + 192]).astype(np.int64).astype(np.uint32)
        aw, ash, bw, bsh = _T8 if kind == "s8" else _T16
        a = _decode(words, aw, ash, kind)
        b = _decode(words, bw, bsh, kind)
        g, t = lane // 4, lane % 4
        r0 = a[g] @ b[:, 2 * t:2 * t + 2]
        r1 = a[g + 8] @ b[:, 2 * t:2 * t + 2]
        r = (cs[0] + r0[0], cs[1] + r0[1], cs[2] + r1[0], cs[3] + r1[1])
        if kind == "s8":
            return tuple(_s32(int(x)) for x in r)
        return tuple(np.float32(x) for x in r)

    @cuda.jit(device=True)
    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr):
        return _mma_sim((a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3), scr, "bf16")

    @cuda.jit(device=True)
    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr):
        return _mma_sim((a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3), scr, "f16")

    @cuda.jit(device=True)
    def mma_s8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr):
        return _mma_sim((a0, a1, a2, a3, b0, b1), (int(c0), int(c1), int(c2), int(c3)), scr, "s8")

    def _ldsm_sim(sm, addr, scr, trans):
        tid = _tid()
        lane = tid % 32
        base = _slot(MAX_THREADS * 6) + (tid - lane) * 6     # inside this warp's 192 words
        assert addr % 16 == 0, "ldmatrix row address must be 16-byte aligned"
        scr[base + lane] = addr // 4
        _group_sync(32)
        g, t = lane // 4, lane % 4
        out = []
        for j in range(4):
            if not trans:
                out.append(_s32(int(sm[scr[base + j * 8 + g] + t])))
            else:  # column g of matrix j, rows 2t and 2t+1
                r0 = sm[scr[base + j * 8 + 2 * t] + g // 2]
                r1 = sm[scr[base + j * 8 + 2 * t + 1] + g // 2]
                out.append(_s32(_half(r0, g % 2) | (_half(r1, g % 2) << 16)))
        return out[0], out[1], out[2], out[3]

    @cuda.jit(device=True)
    def smem_base(sm):
        return 0

    @cuda.jit(device=True)
    def ldsm_x4(sm, addr, scr):
        return _ldsm_sim(sm, addr, scr, False)

    @cuda.jit(device=True)
    def ldsm_x4_t(sm, addr, scr):
        return _ldsm_sim(sm, addr, scr, True)

    @cuda.jit(device=True)
    def cp_async16(sm, saddr, gm, gword, nbytes):
        assert saddr % 16 == 0 and gword % 4 == 0, "cp.async 16 needs 16-byte alignment"
        for i in range(4):
            sm[saddr // 4 + i] = gm[gword + i] if nbytes > 0 else 0

    @cuda.jit(device=True)
    def cp_commit():
        pass

    @cuda.jit(device=True)
    def cp_wait0():
        pass

    @cuda.jit(device=True)
    def cp_wait1():
        pass

    def _quad(x, scrf, op):
        tid = _tid()
        lane = tid % 32
        base = _slot(MAX_THREADS) + tid - lane
        scrf[base + lane] = x
        _group_sync(32)
        q = base + (lane // 4) * 4
        vals = [scrf[q + i] for i in range(4)]
        # same association as the xor-1 then xor-2 butterfly
        return np.float32(op(op(vals[0], vals[1]), op(vals[2], vals[3])))

    @cuda.jit(device=True)
    def quad_max(x, scrf):
        return _quad(x, scrf, max)

    @cuda.jit(device=True)
    def quad_sum(x, scrf):
        return _quad(x, scrf, lambda a, b: np.float32(a) + np.float32(b))

    @cuda.jit(device=True)
    def pack_bf16(lo, hi):
        return _s32(_f32_to_bf16_bits(lo) | (_f32_to_bf16_bits(hi) << 16))

    def _f16_bits(x):
        return int(np.array(np.float32(x)).astype(np.float16).view(np.uint16))

    @cuda.jit(device=True)
    def pack_f16(lo, hi):
        return _s32(_f16_bits(lo) | (_f16_bits(hi) << 16))

    @cuda.jit(device=True)
    def bf16_lo(w):
        return np.float32(_bits_to_f32(_half(w, 0)))

    @cuda.jit(device=True)
    def bits_f32(w):
        return np.array([w], dtype=np.int64).astype(np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def f32_bits(x):
        return int(np.array([x], dtype=np.float32).view(np.int32)[0])

    @cuda.jit(device=True)
    def fadd_rn(a, b):
        return np.float32(np.float32(a) + np.float32(b))

    @cuda.jit(device=True)
    def bf16_hi(w):
        return np.float32(_bits_to_f32(_half(w, 1)))


    # ---- wgmma emulation: the 128 threads of a warpgroup post their A registers, each thread then
    # decodes A and B (from shared memory through the descriptor, same layout rules as the GPU) and
    # computes its own accumulator fragment.
    def _desc_fields(desc):
        desc = int(desc)
        return ((desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4, (desc >> 62) & 3)

    _wg_memo = {}
    _wg_lock = threading.Lock()

    def _wg_sim(acc, regs, desc, scale_d, sm, scr, N, transb, kind="bf16"):
        tid = _tid()
        wt = tid % 128
        base = _slot(MAX_THREADS * 6) + (tid - wt) * 6       # inside this warpgroup's 4 x 192 words
        for i in range(4):
            scr[base + wt * 4 + i] = regs[i]
        th = threading.current_thread()
        n = getattr(th, "_wg_n", 0)
        th._wg_n = n + 1
        _group_sync(128)
        # the product is computed once per warpgroup call (by whichever thread comes first)
        key = (id(scr), cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z, tid - wt, n)
        with _wg_lock:
            ent = _wg_memo.get(key)
            if ent is None:
                ent = _wg_memo[key] = [_wg_product(scr, base, desc, sm, N, transb, kind), 0]
            ent[1] += 1
            if ent[1] == 128:
                del _wg_memo[key]
        D = ent[0]
        s8 = kind in ("s8", "u8s8")
        w, ln = wt // 32, wt % 32
        g, t = ln // 4, ln % 4
        r0, r1 = D[16 * w + g], D[16 * w + g + 8]
        for j in range(N // 8):
            vals = (r0[8 * j + 2 * t], r0[8 * j + 2 * t + 1], r1[8 * j + 2 * t], r1[8 * j + 2 * t + 1])
            for e in range(4):
                if s8:
                    old = int(acc[4 * j + e]) if scale_d else 0
                    acc[4 * j + e] = _s32(old + int(round(vals[e])))
                else:
                    old = float(acc[4 * j + e]) if scale_d else 0.0
                    acc[4 * j + e] = np.float32(old + vals[e])

    def _wg_product(scr, base, desc, sm, N, transb, kind):
        words = np.asarray(scr[base:base + 512]).astype(np.int64).astype(np.uint32).reshape(4, 32, 4)
        u8a = kind == "u8s8"        # A unsigned, B signed
        s8 = kind == "s8" or u8a
        E = 4 if s8 else 2          # elements per 32-bit register
        K = 8 * E                   # 32 (int8) or 16 (bf16)
        A = np.zeros((64, K))
        for w in range(4):
            for ln in range(32):
                g, t = ln // 4, ln % 4
                for r in range(4):
                    row = 16 * w + g + 8 * (r % 2)
                    col = E * t + (K // 2) * (r // 2)
                    u = int(words[w, ln, r])
                    for e in range(E):
                        if s8:
                            A[row, col + e] = ((u >> (8 * e)) & 0xFF) - (256 if (u >> (8 * e)) & 0x80 and not u8a else 0)
                        else:
                            A[row, col + e] = _bits_to_f32((u >> (16 * e)) & 0xFFFF)
        start, lbo, sbo, swz = _desc_fields(desc)
        assert swz == 0, "emulation covers the no-swizzle layout only"
        B = np.zeros((K, N))
        EB = 4 // E                 # bytes per element
        CE = 16 // EB               # elements per 16-byte core-matrix row
        for k in range(K):
            for n in range(N):
                if not transb:   # K-major: core matrix = 8 N-rows x 16 bytes of K
                    addr = start + (n // 8) * sbo + (k // CE) * lbo + (n % 8) * 16 + (k % CE) * EB
                else:            # MN-major: core matrix = 8 K-rows x 16 bytes of N
                    addr = start + (k // 8) * lbo + (n // CE) * sbo + (k % 8) * 16 + (n % CE) * EB
                wd = int(sm[addr // 4]) & 0xFFFFFFFF
                if s8:
                    bt = (wd >> (8 * (addr % 4))) & 0xFF
                    B[k, n] = bt - 256 if bt & 0x80 else bt
                else:
                    B[k, n] = _bits_to_f32(_half(wd, (addr % 4) // 2))
        return A @ B

    def wgmma_op(N, transb, kind="bf16"):
        assert kind in _WG_KINDS and not (transb and kind != "bf16"), (kind, transb)
        assert kind == "bf16" or N <= 32 and N % 8 == 0 or N % 16 == 0, (kind, N)

        @cuda.jit(device=True)
        def f(acc, a0, a1, a2, a3, desc, scale_d, sm, scr):
            _wg_sim(acc, (a0, a1, a2, a3), desc, scale_d, sm, scr, N, transb, kind)
        return f

    @cuda.jit(device=True)
    def wg_fence():
        pass

    @cuda.jit(device=True)
    def wg_commit():
        pass

    @cuda.jit(device=True)
    def wg_wait0():
        pass

    @cuda.jit(device=True)
    def fence_proxy_async():
        pass


# ---- wgmma.wait_group 1 (added for the pipelined bf16 kernel ``wgpp``: wait for all but the
# newest committed wgmma group, e.g. S(j+1) done while P(j) V(j) still runs)
if not SIMULATOR:
    _wg_wait1 = _asm_void("wgmma.wait_group.sync.aligned 1;")

    @cuda.jit(device=True, inline=True)
    def wg_wait1():
        _wg_wait1()
else:
    @cuda.jit(device=True)
    def wg_wait1():
        pass


# ---- cp.async.wait_group N for deeper cp.async rings (N = groups allowed to stay in flight)
_cp_waits = {}


def cp_wait_n(n):
    """Device function waiting until at most ``n`` committed cp.async groups are pending
    (``cp_wait_n(0)`` is ``cp_wait0``).  The simulator's copies are synchronous: a no-op there."""
    f = _cp_waits.get(n)
    if f is None:
        if SIMULATOR:
            @cuda.jit(device=True)
            def f():
                pass
        else:
            _w = _asm_void(f"cp.async.wait_group {int(n)};")

            @cuda.jit(device=True, inline=True)
            def f():
                _w()
        _cp_waits[n] = f
    return f


# ---- Hopper bulk copies (cp.async.bulk: one instruction moves a contiguous block, written
# through the async proxy, completion counted on an mbarrier), mbarriers and named barriers.
#   mbar_init(mbs, addr, count)        mbarrier.init (one thread), then fence_mbar_init() + barrier
#   mbar_expect_tx(mbs, addr, nbytes)  arrive (count 1) and expect nbytes of bulk-copy data
#   mbar_arrive(mbs, addr)             plain arrive
#   mbar_wait(mbs, addr, parity)       spin until the phase of that parity has completed
#   bulk_g2s(sm, saddr, gm, gword, nbytes, mbar)   global word gword.. -> shared byte address
#                                      saddr, nbytes (multiple of 16, 16-byte aligned both sides)
#   named_sync(id, nthreads)           bar.sync id, nthreads (a barrier for a subset of warps)
#   named_arrive(id, nthreads)         bar.arrive id, nthreads (count this thread, do not wait: the
#                                      producer side of a named barrier, e.g. the ping-pong turns)
# mbs: the int32 shared array holding the mbarriers (8 bytes each); addr / saddr: 32-bit
# shared-window byte addresses (smem_base(array) + offset).  In the simulator the copies are
# synchronous and an mbarrier is emulated in its two words (pending count; phase << 16 | count),
# with waits that yield to the other simulated threads -- so ``issue`` must arrive AFTER its
# copies there (``BULK_ARRIVE_LAST``); on the GPU the expect-tx arrive goes first.
BULK_ARRIVE_LAST = SIMULATOR
if not SIMULATOR:
    def _asm_2i(text):
        @intrinsic
        def _impl(typingctx, a0, a1):
            sig = types.void(a0, a1)

            def codegen(context, builder, s, args):
                a = [context.cast(builder, v, t, types.int32) for v, t in zip(args, s.args)]
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32, _i32]), text, "r,r,~{memory}",
                                   side_effect=True)
                builder.call(asm, a)
                return context.get_dummy_value()

            return sig, codegen
        return _impl

    _mbar_init = _asm_2i("mbarrier.init.shared::cta.b64 [$0], $1;")
    _mbar_expect_tx = _asm_2i("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;")
    _named_sync = _asm_2i("bar.sync $0, $1;")
    _named_arrive = _asm_2i("bar.arrive $0, $1;")

    @intrinsic
    def _mbar_arrive(typingctx, addr):
        sig = types.void(addr)

        def codegen(context, builder, s, args):
            a = context.cast(builder, args[0], s.args[0], types.int32)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32]),
                               "mbarrier.arrive.shared::cta.b64 _, [$0];", "r,~{memory}", side_effect=True)
            builder.call(asm, [a])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def _mbar_try_wait(typingctx, addr, parity):
        sig = types.int32(addr, parity)

        def codegen(context, builder, s, args):
            a = [context.cast(builder, v, t, types.int32) for v, t in zip(args, s.args)]
            asm = ir.InlineAsm(ir.FunctionType(_i32, [_i32, _i32]),
                               "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
                               "selp.u32 $0, 1, 0, p; }", "=r,r,r,~{memory}", side_effect=True)
            return builder.call(asm, a)

        return sig, codegen

    @intrinsic
    def _bulk_g2s(typingctx, saddr, gm, gword, nbytes, mbar):
        sig = types.void(saddr, gm, gword, nbytes, mbar)

        def codegen(context, builder, s, args):
            sa = context.cast(builder, args[0], s.args[0], types.int32)
            gp = builder.ptrtoint(_ptr(context, builder, s.args[1], args[1], s.args[2], args[2]), _i64)
            n = context.cast(builder, args[3], s.args[3], types.int32)
            mb = context.cast(builder, args[4], s.args[4], types.int32)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32, _i64, _i32, _i32]),
                               "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                               "[$0], [$1], $2, [$3];", "r,l,r,r,~{memory}", side_effect=True)
            builder.call(asm, [sa, gp, n, mb])
            return context.get_dummy_value()

        return sig, codegen

    _fence_mbar_init = _asm_void("fence.mbarrier_init.release.cluster;")

    @cuda.jit(device=True, inline=True)
    def mbar_init(mbs, addr, count):
        _mbar_init(addr, count)

    @cuda.jit(device=True, inline=True)
    def fence_mbar_init():
        _fence_mbar_init()

    @cuda.jit(device=True, inline=True)
    def mbar_expect_tx(mbs, addr, nbytes):
        _mbar_expect_tx(addr, nbytes)

    @cuda.jit(device=True, inline=True)
    def mbar_arrive(mbs, addr):
        _mbar_arrive(addr)

    @cuda.jit(device=True, inline=True)
    def mbar_wait(mbs, addr, parity):
        while _mbar_try_wait(addr, parity) == 0:
            pass

    @cuda.jit(device=True, inline=True)
    def bulk_g2s(sm, saddr, gm, gword, nbytes, mbar):
        _bulk_g2s(saddr, gm, gword, nbytes, mbar)

    @cuda.jit(device=True, inline=True)
    def named_sync(bar_id, nthreads):
        _named_sync(bar_id, nthreads)

    @cuda.jit(device=True, inline=True)
    def named_arrive(bar_id, nthreads):
        _named_arrive(bar_id, nthreads)
else:
    import threading as _threading
    import time as _time

    _named = {}

    @cuda.jit(device=True)
    def mbar_init(mbs, addr, count):
        mbs[addr // 4] = count
        mbs[addr // 4 + 1] = count

    @cuda.jit(device=True)
    def fence_mbar_init():
        pass

    @cuda.jit(device=True)
    def mbar_arrive(mbs, addr):
        w = addr // 4
        if cuda.atomic.sub(mbs, w, 1) == 1:         # last arrival: reset the count, flip the phase
            mbs[w] = mbs[w + 1] & 0xFFFF
            cuda.atomic.add(mbs, w + 1, 1 << 16)

    @cuda.jit(device=True)
    def mbar_expect_tx(mbs, addr, nbytes):
        mbar_arrive(mbs, addr)                      # the copies already happened (synchronous)

    @cuda.jit(device=True)
    def mbar_wait(mbs, addr, parity):
        while ((mbs[addr // 4 + 1] >> 16) & 1) == parity:
            _time.sleep(1e-4)

    @cuda.jit(device=True)
    def bulk_g2s(sm, saddr, gm, gword, nbytes, mbar):
        assert saddr % 16 == 0 and gword % 4 == 0 and nbytes % 16 == 0, "bulk copy needs 16-byte alignment"
        for i in range(nbytes // 4):
            sm[saddr // 4 + i] = gm[gword + i]

    _named_cv = _threading.Condition()

    def _named_hit(bar_id, nthreads, wait):
        # per (block, id): [arrivals in the current phase, phase]; the nthreads-th arrival (a sync or
        # an arrive) completes the phase and releases the waiting syncs of that phase
        key = (tuple(cuda.blockIdx), bar_id)
        with _named_cv:
            st = _named.setdefault(key, [0, 0])
            ph = st[1]
            st[0] += 1
            if st[0] == nthreads:
                st[0] = 0
                st[1] += 1
                _named_cv.notify_all()
            elif wait:
                while st[1] == ph:
                    _named_cv.wait(0.05)

    @cuda.jit(device=True)
    def named_sync(bar_id, nthreads):
        _named_hit(bar_id, nthreads, True)

    @cuda.jit(device=True)
    def named_arrive(bar_id, nthreads):
        _named_hit(bar_id, nthreads, False)
