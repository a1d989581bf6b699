"""8-bit attention kernel on wgmma (Hopper; head dim 128 on the GPU): int8 S, ping-pong warpgroups.

bf16_wgmma's structure (2 warpgroups x 64 query rows, 128-key tiles in a bulk-copy ring, S(j+1)
issued with P(j) V(j)) with S = Q8 K8^T on wgmma s8 and the two warpgroups taking turns on the
tensor cores (FA3's ping-pong: named barriers 1 / 2), so one's softmax overlaps the other's
matrix products; stages are released on "empty" mbarriers instead of a block barrier, and the
lagging warpgroup's first thread issues the copies.  4 stages (192 KB of dynamic shared memory)."""
from .. import runtime as _rt
from .launch import cuda, int32, int64, float32, _mma, _math
from .launch import SMEM_ALIGN_WG, Kernel
from .fragments import thread_ids, zero, start_state, make_rescale, make_store, make_q_frags, make_wg_mma
from .softmax import _make_softmax
from .tile_kv import _make_ring


# Measured choices ([1,24,4608,128], kernel alone, bench/ops/gpu_attn_ab.py: every variant in one process,
# interleaved rounds; numbers in BENCHMARKS.md "Attention"):
#   the loop's ring bookkeeping on incremented 32-bit counters (no int64 division / modulo): ~9% faster
#   ONES + TAU + BIASACC: neutral alone and together, but the polynomial exp2 share gains on top of them
#   only: EXP_POLY = 4 kept; EXP_POLY = 2 is slower (more issue slots and 255 registers than the XU time it saves)
# The switches are fields of the kernel's Int8Config (config.py; defaults = the kept kernel), read by make():
#   ONES = cfg.ones           row sums from a ones column of V: P V on m64n136 (the FADD chains of the softmax gone)
#   TAU = cfg.tau             rescale threshold in log2 units: the running max moves only when a tile's max exceeds
#                             it by more than TAU (P <= 2^TAU; bf16 P and fp32 O keep their relative precision)
#   BIASACC = cfg.biasacc     S accumulates onto the bits of 1.5 * 2^23: S + 1.5 * 2^23 as fp32 with no I2F (the
#                             offset FB f + max rounds to fp32: ulp(FB f) / 2 in log2 units per (row, 64 keys) --
#                             ~3e-5 at f ~ 1e-4, random / FLUX-like scales; ~0.03 at f ~ 0.06, 30x outlier channels)
#   EXP_POLY = cfg.exp_poly   every EXP_POLY-th 8-key n-tile's exp2 by a polynomial on the FMA pipe (0: all MUFU):
#                             the MUFU (XU, 16 per clock per SM) is the softmax's long pole (ncu: XU-bound waits)
# 2^f on [-0.5, 0.5], degree 3 (relative error 7.5e-5; bf16 P rounds at 2^-9)
_EC = (0.9999281167984009, 0.6932609677314758, 0.24261054396629333, 0.05517132207751274)
_MAGIC = 12582912.0     # 1.5 * 2^23
_XLO = -126.0


def exp2_fma_reference(x):
    """torch reference of ``exp2_fma`` (fp32 steps, same rounding): 2^x for x >= -126 (clamped)."""
    import torch
    x = x.float().clamp(min=_XLO)
    t = x + _MAGIC
    f = x - (t - _MAGIC)
    c0, c1, c2, c3 = (torch.tensor(c, dtype=torch.float32) for c in _EC)
    p = ((c3 * f + c2) * f + c1) * f + c0
    bits = (p.view(torch.int32).long() + (t.view(torch.int32).long() << 23)) & 0xFFFFFFFF
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)


if cuda is not None:
    _C0, _C1, _C2, _C3 = (float32(c) for c in _EC)
    _M32, _XLO32 = float32(_MAGIC), float32(_XLO)

    @cuda.jit(device=True, inline=True)
    def exp2_fma(x):
        """2^x on the FMA / ALU pipes: round x to an integer r by the 1.5 * 2^23 magic add (an
        opaque add: fast-math must not fold (x + M) - M), 2^(x - r) by a cubic, r added to the
        exponent bits (the magic's own bits shift out of the 32-bit word).  x >= -126 (clamped;
        from -126 down the result is a denormal that the bf16 P flushes to zero)."""
        x = max(x, _XLO32)
        t = _mma.fadd_rn(x, _M32)
        f = x - (t - _M32)
        p = ((_C3 * f + _C2) * f + _C1) * f + _C0
        return _mma.bits_f32(_mma.f32_bits(p) + (_mma.f32_bits(t) << 23))


def make(cfg, D, has_mask, QTOK=False):
    """Hopper 8-bit kernel on the bf16 wgmma kernel's structure: 2 warpgroups x 64
    query rows, BN-key tiles in a STAGES ring fed by bulk copies (mbarriers), S(j+1)
    issued with P(j) V(j).  S = Q8 K8^T on wgmma m64nBNk32 s8 (exact int32) x (per-16-row Q scale
    x per-64-key K scale, the pre-pass's); P V on bf16 wgmma.  k: the int8 K in tile_kv's image
    (viewed as 16-bit pairs: the same core-matrix layout, 16 values per 16-byte chunk), written so
    by the pre-pass (_make_prepass TK); v: tile_kv(v, chunk_major=ONES); q: the padded int8 Q
    (cp.async once).
    FA3's ping-pong -- the two warpgroups take turns issuing their wgmma
    (named barriers 1 and 2: a warpgroup waits for its turn, issues S(j+1) and P(j) V(j), hands
    the turn over), so one warpgroup's softmax runs while the other's matrix products use the
    tensor cores; no block barrier in the loop: each warp releases a stage on its "empty"
    mbarrier after P(j) V(j), and the issuing thread (thread 128: the second warpgroup, which
    runs half a turn behind) waits for that release before it reuses the stage.
    The loop's ring bookkeeping runs on incremented 32-bit counters (stage / phase of tiles j - 1,
    j, j + 1; the K-scale index; the descriptors): no division or modulo in the loop.
    ONES: each stage holds, after its V tile, a 16-byte-wide column chunk of bf16 ones (written
    once); V is chunk-major (column chunk stride BN x 16 bytes), so P V on N = D + 8 reads it as
    V's 17th chunk and accumulates the row sums of the bf16 P into acc[D/2 ..] -- the denominator
    of exactly the P that multiplies V.
    BIASACC: S's accumulators start at the int32 bits of 1.5 x 2^23 (wgmma accumulating from the
    first k-step); |S| < 2^21, so the bits of S + 1.5 x 2^23 are that fp32 value exactly and S's
    conversion is a subtraction folded into the exp2 FFMA.
    QTOK: per-token Q scales (qsc [B*H*Lp]: qk_norm_rope's fused Quant8, whose Q8 is q), K8 and
    its per-64-key scales from the K-only pre-pass (the per-token K scales would cost a scale per
    column: measured 0.80 ms against 0.49 with them read from L1): each thread's two rows get
    their own factors, f(row, half) = q_scale[row] x k_scale[half].
    cfg: an Int8Config of kind "wgmma" (keys = BN, stages; the switches ones / tau / biasacc / exp_poly)
    -> ``Kernel`` (tile_kv = BN)."""
    BN, STAGES = cfg.keys, cfg.stages
    ONES, TAU, BIASACC, EXP_POLY = cfg.ones, cfg.tau, cfg.biasacc, cfg.exp_poly
    NWG = 2
    assert cfg.warpgroups == NWG and cfg.ping_pong and cfg.bulk
    BM = 64 * NWG
    NTH = 128 * NWG
    CH8 = D // 16
    GB8 = CH8 * 128
    CH = D // 8
    GB = CH * 128
    TB8 = BN * D
    TBV = BN * D * 2
    ONESB = BN * 16 if ONES else 0      # the ones chunk after each V tile
    SB = TB8 + TBV + ONESB
    DN = D + 8 if ONES else D           # P V's N
    KT = D // 32
    NT = BN // 8
    NS = NT * 4
    NACC = DN // 2
    PT = BN // 16
    PR = PT * 4
    QF = KT * 4
    QLOADS = BM * CH8 // NTH
    SCRW = _mma.SCR_WORDS if _rt.SIMULATOR else 0
    SCRF = _mma.SCRF_WORDS if _rt.SIMULATOR else 0
    DK_HI = ((128 >> 4) << 16) | ((GB8 >> 4) << 32)
    # V MN-major: LBO = the stride between 8-key groups, SBO = between 8-column chunks
    DV_HI = (((128 >> 4) << 16) | (((BN * 16) >> 4) << 32)) if ONES else (((GB >> 4) << 16) | ((128 >> 4) << 32))
    wg_qk = _mma.wgmma_op(BN, 0, "s8")
    wg_pv = _mma.wgmma_op(DN, 1)
    wg_wait0, wg_wait1, fence_async = _mma.wg_wait0, _mma.wg_wait1, _mma.fence_proxy_async
    cp_async16, cp_commit, cp_wait0, mbar_wait = _mma.cp_async16, _mma.cp_commit, _mma.cp_wait0, _mma.mbar_wait
    issue, ring_start = _make_ring(TB8, TBV, STAGES, RELEASE=4 * NWG, SB=SB)
    softmax = _make_softmax(BN, has_mask)
    rescale, store, load_q = make_rescale(DN, True), make_store(D, QUAD=not ONES), make_q_frags(KT, 256)
    issue_qk, issue_pv, pack_p = make_wg_mma(KT, PT, 128 if ONES else GB, wg_qk, wg_pv, QK_ACC=BIASACC)
    DYN = STAGES * SB > 48 * 1024 and not _rt.SIMULATOR
    RINGS = 0 if DYN else STAGES * SB // 4
    RALIGN = None if DYN else SMEM_ALIGN_WG
    MBALIGN = None if _rt.SIMULATOR else 8
    MBW = 4 * STAGES
    EMPTY = 8 * STAGES                  # byte offset of the empty mbarriers
    ISSUER = 128                        # the lagging warpgroup's first thread issues the loop's tiles
    named_sync, named_arrive, mbar_arrive = _mma.named_sync, _mma.named_arrive, _mma.mbar_arrive
    bits_f32 = _mma.bits_f32
    assert D % 32 == 0 and BN % 64 == 0 and BM * D <= SB and (BM * CH8) % NTH == 0
    assert SB % 16 == 0 and STAGES * SB <= 227 * 1024 and (STAGES * ONESB // 4) % NTH == 0
    ONESW = int32(0x3F803F80)           # two bf16 ones
    NONES = STAGES * ONESB // 4         # words of ones, all stages
    BIASW = int32(0x4B400000)           # the bits of 1.5 * 2^23
    FB = float32(12582912.0 if BIASACC else 0.0)
    SBD = SB >> 4                       # a stage in descriptor units
    I0, I1 = int32(0), int32(1)
    KSTEP = int32(BN // 64)
    NSTAGE = int32(STAGES)
    TAUF = float32(TAU)

    @cuda.jit(device=True, inline=True)
    def s_raw(si, i):
        """S element i as fp32: S + FB (BIASACC: the accumulator's bits) or S."""
        if BIASACC:
            return bits_f32(si[i])
        return float32(si[i])

    @cuda.jit(device=True, inline=True)
    def bias_s(si):
        if BIASACC:
            for i in range(NS):
                si[i] = BIASW

    @cuda.jit(device=True, inline=True)
    def scaled(si, s, f00, f01, f10, f11):
        """int32 S -> fp32 with the factor of each row (this thread's g / g+8) and 64-key half."""
        for nt in range(NT):
            fa = f00 if nt < 8 else f01
            fb = f10 if nt < 8 else f11
            s[nt * 4 + 0] = (s_raw(si, nt * 4 + 0) - FB) * fa
            s[nt * 4 + 1] = (s_raw(si, nt * 4 + 1) - FB) * fa
            s[nt * 4 + 2] = (s_raw(si, nt * 4 + 2) - FB) * fb
            s[nt * 4 + 3] = (s_raw(si, nt * 4 + 3) - FB) * fb

    FOLD = not has_mask
    NEG = float32(-3e38)
    ONE = float32(1)
    quad_max, exp2 = _mma.quad_max, _math.exp2
    @cuda.jit(device=True, inline=True)
    def moved(xn, old):
        """The running max after a tile whose max (with the old one) is xn: xn when it exceeds
        the old max by more than TAU (or TAU is 0 and it moved at all), else the old one."""
        if TAU > 0:
            return xn if xn > old + TAUF else old
        return xn

    @cuda.jit(device=True, inline=True)
    def y_of(s, nt, e, f00, f01, f10, f11, c00, c01, c10, c11):
        """The exp2 argument of S element (nt, e): (S + FB) f - (FB f + max) for its row and 64-key half."""
        if e < 2:
            return s[nt * 4 + e] * (f00 if nt < 8 else f01) - (c00 if nt < 8 else c01)
        return s[nt * 4 + e] * (f10 if nt < 8 else f11) - (c10 if nt < 8 else c11)

    @cuda.jit(device=True, inline=True)
    def folded(si, s, st, f00, f01, f10, f11, scrf):
        """``scaled`` + the online softmax of a full, unmasked tile with the factors folded in: the
        running max from the raw S per row and 64-key half times that half's factor (factors are
        positive: the max commutes with them), then P = exp2((S + FB) f - (FB f + max)) as one
        FFMA per element.  Row sums: ONES (the P V's ones column) or summed here."""
        m00 = NEG
        m01 = NEG
        m10 = NEG
        m11 = NEG
        for nt in range(NT):
            a0 = s_raw(si, nt * 4 + 0)
            a1 = s_raw(si, nt * 4 + 1)
            a2 = s_raw(si, nt * 4 + 2)
            a3 = s_raw(si, nt * 4 + 3)
            s[nt * 4 + 0] = a0
            s[nt * 4 + 1] = a1
            s[nt * 4 + 2] = a2
            s[nt * 4 + 3] = a3
            if nt < 8:
                m00 = max(m00, max(a0, a1))
                m10 = max(m10, max(a2, a3))
            else:
                m01 = max(m01, max(a0, a1))
                m11 = max(m11, max(a2, a3))
        x0 = moved(max(quad_max(max((m00 - FB) * f00, (m01 - FB) * f01), scrf), st[0]), st[0])
        x1 = moved(max(quad_max(max((m10 - FB) * f10, (m11 - FB) * f11), scrf), st[1]), st[1])
        st[4] = exp2(st[0] - x0) if x0 != st[0] else ONE
        st[5] = exp2(st[1] - x1) if x1 != st[1] else ONE
        st[0] = x0
        st[1] = x1
        c00 = FB * f00 + x0
        c01 = FB * f01 + x0
        c10 = FB * f10 + x1
        c11 = FB * f11 + x1
        for nt in range(NT):            # (LLVM unrolls both loops fully: constant trip counts, small
            if EXP_POLY and nt % EXP_POLY == 0:     # bodies -- the local arrays stay in registers)
                continue
            for e in range(4):          # e < 2: row g, else row g + 8
                s[nt * 4 + e] = exp2(y_of(s, nt, e, f00, f01, f10, f11, c00, c01, c10, c11))
        if EXP_POLY:
            for ntp in range(NT // max(EXP_POLY, 1)):   # the FMA pipe's share
                for e in range(4):
                    nt = ntp * EXP_POLY
                    s[nt * 4 + e] = exp2_fma(y_of(s, nt, e, f00, f01, f10, f11, c00, c01, c10, c11))
        if not ONES:
            ps0 = float32(0)
            ps1 = float32(0)
            for nt in range(NT):
                ps0 += s[nt * 4] + s[nt * 4 + 1]
                ps1 += s[nt * 4 + 2] + s[nt * 4 + 3]
            st[2] = st[2] * st[4] + ps0
            st[3] = st[3] * st[5] + ps1

    @cuda.jit(fastmath=True)
    def kern(q, k, v, qsc, ksc, o, mask, vs0, vs1, vs2, os0, os1, ms0, ms1, ms2, L, Lp, H, sl2):
        sm = cuda.shared.array(RINGS, int32, alignment=RALIGN)
        scr = cuda.shared.array(SCRW, int32)
        scrf = cuda.shared.array(SCRF, float32)
        mbs = cuda.shared.array(MBW, int32, alignment=MBALIGN)
        tid, warp, lane, g, t, l8, j8, bh, b, h = thread_ids(H)
        m0 = cuda.blockIdx.x * BM
        kb = _mma.smem_base(sm)
        mb = _mma.smem_base(mbs)
        qaddr = kb + (warp * 2 + j8 % 2) * GB8 + (j8 // 2) * 128 + l8 * 16
        base8 = bh * Lp * (D // 4)
        kbase = b * vs0 // 2 + h * vs1 // 2        # tiled K8: half the words of tiled V per row
        vbase = b * vs0 + h * vs1
        nkt = Lp // 64
        if QTOK:        # this thread's rows g, g + 8
            q0 = qsc[bh * Lp + min(m0 + warp * 16 + g, Lp - 1)] * float32(sl2)
            q1 = qsc[bh * Lp + min(m0 + warp * 16 + g + 8, Lp - 1)] * float32(sl2)
        else:           # this warp's 16 rows
            q0 = qsc[bh * (Lp // 16) + min(m0 // 16 + warp, Lp // 16 - 1)] * float32(sl2)
            q1 = q0
        for i in range(QLOADS):                 # Q8 rows (zero past the padded length)
            c = i * NTH + tid
            r8 = c % 8
            cc = (c // 8) % CH8
            grp = (c // 8) // CH8
            row = m0 + grp * 8 + r8
            cp_async16(sm, kb + grp * GB8 + cc * 128 + r8 * 16, q,
                       base8 + min(row, Lp - 1) * (D // 4) + cc * 4, 16 if row < Lp else 0)
        cp_commit()
        cp_wait0()
        cuda.syncthreads()
        qf = cuda.local.array(QF, int32)
        load_q(qf, sm, qaddr, scr)
        for i in range(NONES // NTH):           # every stage's ones chunk (never overwritten)
            w = i * NTH + tid
            st8 = w // (ONESB // 4)
            sm[(st8 * SB + TB8 + TBV) // 4 + w - st8 * (ONESB // 4)] = ONESW
        fence_async()                           # generic smem writes before the async proxy's
        cuda.syncthreads()
        ntiles = (L + BN - 1) // BN
        nfull = L // BN                         # tiles whose keys are all < L
        wg = warp // 4
        if tid == 0:
            ring_start(sm, mbs, kb, mb, k, v, kbase, vbase, ntiles)
        acc = cuda.local.array(NACC, float32)
        zero(acc, NACC)
        si = cuda.local.array(NS, int32)
        s = cuda.local.array(NS, float32)
        pr = cuda.local.array(PR, int32)
        st = cuda.local.array(6, float32)
        start_state(st)
        row0 = m0 + warp * 16 + g
        one = float32(1)
        dk0 = DK_HI | (int64(kb) >> 4)
        dv0 = DV_HI | (int64(kb + TB8) >> 4)
        kfirst = int32(bh * nkt)
        klast = int32(bh * nkt + nkt - 1)

        if wg == 1:
            named_arrive(1, NTH)                # the first turn is warpgroup 0's
        cuda.syncthreads()
        mbar_wait(mbs, mb, 0)
        bias_s(si)
        named_sync(1 + wg, NTH)
        issue_qk(si, qf, dk0, sm, scr)
        named_arrive(2 - wg, NTH)
        wg_wait0()
        ka = ksc[kfirst]
        kb2 = ksc[min(kfirst + I1, klast)]
        scaled(si, s, q0 * ka, q0 * kb2, q1 * ka, q1 * kb2)
        softmax(s, st, mask, b, h, ms0, ms1, ms2, 0, row0, L, t, one, one, scrf)
        pack_p(pr, s)

        # ring counters: stage / phase of tile j - 1 (sp, pp: the stage tile j + STAGES - 1 reuses),
        # j (sc) and j + 1 (sn, pn); kn: the K-scale index of tile j + 1
        sp = int32(STAGES - 1)
        pp = I0
        sc = I0
        pc = I0
        sn = I1
        pn = I0
        kn = int32(kfirst + KSTEP)
        for j in range(ntiles):
            # the next tile's K scales (global, L1-resident) load first: their latency stays out of
            # the turn below
            ka = ksc[min(kn, klast)]
            kb2 = ksc[min(int32(kn + I1), klast)]
            # the next tile's copies go out before this iteration's wait for tile j+1 (a late
            # tile must not delay the issue of the one after it)
            if tid == ISSUER and j + STAGES - 1 < ntiles:
                if j >= 1:                      # tile j-1 (this stage's last tile) released by every warp
                    mbar_wait(mbs, mb + EMPTY + 8 * sp, pp)
                issue(sm, mbs, kb, mb, k, v, kbase, vbase, j + STAGES - 1, sp)
            if j + 1 < ntiles:
                mbar_wait(mbs, mb + 8 * sn, pn)
            # descriptors and S's start value before the turn: the turn (the other warpgroup
            # waits for its hand-over) holds the wgmma issue only
            # (phantom S(ntiles) in the last iteration, as in the bf16 kernel: all its columns >= L)
            dk = dk0 + sn * SBD
            dv = dv0 + sc * SBD
            bias_s(si)
            named_sync(1 + wg, NTH)             # this warpgroup's turn on the tensor cores
            issue_qk(si, qf, dk, sm, scr)
            issue_pv(acc, pr, dv, sm, scr)
            named_arrive(2 - wg, NTH)           # the other warpgroup's turn
            wg_wait1()                          # S(j+1) done; P(j) V(j) may still run
            if FOLD and j + 2 <= nfull:         # a full, unmasked tile: the factors ride in the FFMA
                folded(si, s, st, q0 * ka, q0 * kb2, q1 * ka, q1 * kb2, scrf)
            else:                               # masked or ragged: scale, then mask / -inf, then softmax
                scaled(si, s, q0 * ka, q0 * kb2, q1 * ka, q1 * kb2)
                softmax(s, st, mask, b, h, ms0, ms1, ms2, (j + 1) * BN, row0, L, t, one, one, scrf)
            wg_wait0()
            if lane == 0:
                mbar_arrive(mbs, mb + EMPTY + 8 * sc)    # this warp is done with tile j
            rescale(acc, st[4], st[5])
            pack_p(pr, s)
            sp = sc
            pp = pc
            sc = sn
            pc = pn
            sn = int32(sn + I1)
            if sn == NSTAGE:
                sn = I0
                pn = int32(pn ^ I1)
            kn = int32(kn + KSTEP)

        if wg == 0:
            named_sync(1, NTH)                  # warpgroup 1's last hand-over (no pending arrivals at exit)
        if ONES:
            store(o, acc, acc[D // 2], acc[D // 2 + 2], b * os0 + h * (D // 2), os1, row0, L, t, scrf)
        else:
            store(o, acc, st[2], st[3], b * os0 + h * (D // 2), os1, row0, L, t, scrf)

    return Kernel(kern, rows=BM, threads=NTH, tile_kv=BN, dyn_smem=STAGES * SB if DYN else 0, v_chunk_major=ONES)
