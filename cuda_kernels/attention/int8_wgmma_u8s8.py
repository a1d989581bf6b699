"""8-bit attention with an integer P V on wgmma (Hopper; Int8Config pv="u8s8", issue #38).

int8_wgmma's kernel (2 ping-pong warpgroups x 64 query rows, 128-key tiles in a bulk-copy ring,
S = Q8 K8^T on wgmma s8) with P V on integers too, the arithmetic of ``int8_pv_ref``:
  P    u8 per (row, 64-key group): rni(exp2(x - mt) * 255), mt the group's row max (the max key -> 255);
  V    s8 per channel (``vt8.pack_vt8``: V^T tile images, keys permuted so that S's accumulator layout
       is the u8 A fragment, the channel scales after each head's tiles in the same buffer);
  P V  wgmma m64nDk32 .s32.u8.s8, one int32 accumulator per 64-key group (exact: |acc| < 2^21),
       added into the fp32 O as O += float(acc) * exp2(mt - m) (m: the running max after the tile);
  l    row sums of the quantised P (integer sums in registers, scaled by the same weight);
  out  O / l x v_scale[channel] at the store.
The 1/255 of P's scale is common to O and l and cancels.  The row sums come from registers, not a
ones column: integer wgmma takes N = D + 16 at the least (N a multiple of 16 above 32), 8 more
accumulator registers than D + 8.

Loop (warpgroup turns as int8_wgmma): the turn issues S(j+1) and P(j) V(j) of group 0 (int32
accumulator, committed separately); then S(j+1)'s softmax (group maxima, running max, u8 P(j+1),
row sums) runs while group 0's product does; group 0 is added into O, group 1's product issued
(outside the turn) and added, the stage released, O rescaled by tile j+1's alpha and P(j+1) packed.
One int32 accumulator: group 1's product waits for group 0's conversion (the issue's producer /
consumer split with setmaxnreg would hold a second one and overlap them).
BIASACC: both int32 accumulators start at the bits of 1.5 x 2^23 (S as in int8_wgmma; P V's groups
likewise, |acc| < 2^21), so their conversion is one float subtraction, no I2F.
Dynamic shared memory: STAGES x (BN D of K8 + BN D of V8) (128 KB at D = 128, 4 stages)."""
from .. import runtime as _rt
from .launch import cuda, int32, int64, float32, _mma, _math
from .launch import SMEM_ALIGN_WG, Kernel
from .fragments import thread_ids, zero, start_state, make_rescale, make_q_frags, make_wg_mma
from .softmax import make_parts
from .tile_kv import _make_ring

P_MAX = 255


def make(cfg, D, has_mask, QTOK=False):
    """The integer-P V kernel of ``cfg`` (an Int8Config of kind "wgmma", pv "u8s8", ones off) at head
    dim D -> ``Kernel`` (tile_kv = BN, v_s8: V as ``vt8.pack_vt8(v, BN)``).  Arguments as int8_wgmma's
    kernel, with v the packed V buffer (int32 words; vs0 / vs1 its b / h strides in words)."""
    from ..device import wrap_i32
    from .int8_wgmma import exp2_fma
    BN, STAGES = cfg.keys, cfg.stages
    TAU, BIASACC, EXP_POLY = cfg.tau, cfg.biasacc, cfg.exp_poly
    NWG = 2
    assert cfg.pv == "u8s8" and not cfg.ones and cfg.warpgroups == NWG and cfg.ping_pong and cfg.bulk
    assert BN == 128, "two 64-key groups per tile"
    BM = 64 * NWG
    NTH = 128 * NWG
    CH8 = D // 16
    GB8 = CH8 * 128
    TB8 = BN * D                        # K8 tile
    TBV = BN * D                        # s8 V^T tile
    SB = TB8 + TBV
    KT = D // 32
    NT = BN // 8
    HT = NT // 2                        # 8-key n-tiles per 64-key group
    NS = NT * 4
    NACC = D // 2
    DT = D // 8
    KG = 2                              # 32-key k-steps per group
    PR = BN // 32 * 4                   # u8 A fragments of the tile's P
    QF = KT * 4
    QLOADS = BM * CH8 // NTH
    SCRW = _mma.SCR_WORDS if _rt.SIMULATOR else 0
    SCRF = _mma.SCRF_WORDS if _rt.SIMULATOR else 0
    DK_HI = ((128 >> 4) << 16) | ((GB8 >> 4) << 32)
    # V^T K-major: LBO = 128 bytes between 16-key chunks, SBO = BN x 8 between 8-channel groups
    DV_HI = ((128 >> 4) << 16) | (((BN * 8) >> 4) << 32)
    wg_qk = _mma.wgmma_op(BN, 0, "s8")
    wg_pv = _mma.wgmma_op(D, 0, "u8s8")
    wg_fence, wg_commit = _mma.wg_fence, _mma.wg_commit
    wg_wait0, wg_wait1, fence_async = _mma.wg_wait0, _mma.wg_wait1, _mma.fence_proxy_async
    cp_async16, cp_commit, cp_wait0, mbar_wait = _mma.cp_async16, _mma.cp_commit, _mma.cp_wait0, _mma.mbar_wait
    issue, ring_start = _make_ring(TB8, TBV, STAGES, RELEASE=4 * NWG, SB=SB)
    mask_ragged, _ = make_parts(BN, has_mask)
    rescale, load_q = make_rescale(D, True), make_q_frags(KT, 256)
    issue_qk, _, _ = make_wg_mma(KT, 1, 128, wg_qk, wg_qk, QK_ACC=BIASACC)
    DYN = STAGES * SB > 48 * 1024 and not _rt.SIMULATOR
    RINGS = 0 if DYN else STAGES * SB // 4
    RALIGN = None if DYN else SMEM_ALIGN_WG
    MBALIGN = None if _rt.SIMULATOR else 8
    MBW = 4 * STAGES
    EMPTY = 8 * STAGES
    ISSUER = 128
    named_sync, named_arrive, mbar_arrive = _mma.named_sync, _mma.named_arrive, _mma.mbar_arrive
    bits_f32, f32_bits, fadd_rn = _mma.bits_f32, _mma.f32_bits, _mma.fadd_rn
    quad_max, quad_sum, pack_bf16, exp2 = _mma.quad_max, _mma.quad_sum, _mma.pack_bf16, _math.exp2
    assert D % 32 == 0 and BM * D <= SB and (BM * CH8) % NTH == 0
    assert SB % 16 == 0 and STAGES * SB <= 227 * 1024
    BIASW = int32(0x4B400000)           # the bits of 1.5 * 2^23
    FB = float32(12582912.0 if BIASACC else 0.0)
    M32 = float32(12582912.0)
    SBD = SB >> 4
    I0, I1 = int32(0), int32(1)
    I255 = int32(P_MAX)
    KSTEP = int32(BN // 64)
    NSTAGE = int32(STAGES)
    TAUF = float32(TAU)
    P255 = float32(P_MAX)
    NEG = float32(-3e38)
    ONE = float32(1)
    ZERO = float32(0)
    FOLD = not has_mask

    @cuda.jit(device=True, inline=True)
    def s_raw(si, i):
        if BIASACC:
            return bits_f32(si[i])
        return float32(si[i])

    @cuda.jit(device=True, inline=True)
    def bias(a, n):
        if BIASACC:
            for i in range(n):
                a[i] = BIASW

    @cuda.jit(device=True, inline=True)
    def scaled(si, s, f00, f01, f10, f11):
        """int32 S -> fp32 x with the factor of each row (g / g + 8) and 64-key group."""
        for nt in range(NT):
            fa = f00 if nt < HT else f01
            fb = f10 if nt < HT else f11
            s[nt * 4 + 0] = (s_raw(si, nt * 4 + 0) - FB) * fa
            s[nt * 4 + 1] = (s_raw(si, nt * 4 + 1) - FB) * fa
            s[nt * 4 + 2] = (s_raw(si, nt * 4 + 2) - FB) * fb
            s[nt * 4 + 3] = (s_raw(si, nt * 4 + 3) - FB) * fb

    @cuda.jit(device=True, inline=True)
    def moved(xn, old):
        if TAU > 0:
            return xn if xn > old + TAUF else old
        return xn

    @cuda.jit(device=True, inline=True)
    def y_of(s, nt, e, f00, f01, f10, f11, c00, c01, c10, c11):
        """exp2 argument of element (nt, e): s f - (fb f + mt) for its row and group."""
        if e < 2:
            return s[nt * 4 + e] * (f00 if nt < HT else f01) - (c00 if nt < HT else c01)
        return s[nt * 4 + e] * (f10 if nt < HT else f11) - (c10 if nt < HT else c11)

    @cuda.jit(device=True, inline=True)
    def to_u8(p):
        """rni(p) as an integer (the 1.5 * 2^23 add rounds half to even), at most 255 (p >= 0)."""
        return min(f32_bits(fadd_rn(p, M32)) - BIASW, I255)

    @cuda.jit(device=True, inline=True)
    def soft_u8(si, s, st, wn, f00, f01, f10, f11, fb, scrf):
        """The online softmax of one tile into u8 P.  s: the tile as x = (s - fb) f per row and group
        (the folded path: s = S + FB, f the factors; else s = x, f = 1, fb = 0).  Group row maxima mt
        (4 quad maxima), the running max (moved past TAU only) and alpha into st, wn = exp2(mt - m)
        for (row g, group 0 / 1, row g + 8, group 0 / 1), si = u8 P, st's row sums l = l alpha +
        sum over groups of (sum P_u8) w (this lane's part)."""
        m00 = NEG
        m01 = NEG
        m10 = NEG
        m11 = NEG
        for nt in range(NT):
            a0 = max(s[nt * 4 + 0], s[nt * 4 + 1])
            a1 = max(s[nt * 4 + 2], s[nt * 4 + 3])
            if nt < HT:
                m00 = max(m00, a0)
                m10 = max(m10, a1)
            else:
                m01 = max(m01, a0)
                m11 = max(m11, a1)
        g00 = quad_max((m00 - fb) * f00, scrf)
        g01 = quad_max((m01 - fb) * f01, scrf)
        g10 = quad_max((m10 - fb) * f10, scrf)
        g11 = quad_max((m11 - fb) * f11, scrf)
        x0 = moved(max(max(g00, g01), st[0]), st[0])
        x1 = moved(max(max(g10, g11), st[1]), st[1])
        st[4] = exp2(st[0] - x0) if x0 != st[0] else ONE
        st[5] = exp2(st[1] - x1) if x1 != st[1] else ONE
        st[0] = x0
        st[1] = x1
        wn[0] = exp2(g00 - x0)
        wn[1] = exp2(g01 - x0)
        wn[2] = exp2(g10 - x1)
        wn[3] = exp2(g11 - x1)
        c00 = fb * f00 + g00
        c01 = fb * f01 + g01
        c10 = fb * f10 + g10
        c11 = fb * f11 + g11
        for nt in range(NT):
            if EXP_POLY and nt % EXP_POLY == 0:
                continue
            for e in range(4):
                si[nt * 4 + e] = to_u8(exp2(y_of(s, nt, e, f00, f01, f10, f11, c00, c01, c10, c11)) * P255)
        if EXP_POLY:
            for ntp in range(NT // max(EXP_POLY, 1)):   # the FMA pipe's share
                for e in range(4):
                    nt = ntp * EXP_POLY
                    si[nt * 4 + e] = to_u8(exp2_fma(y_of(s, nt, e, f00, f01, f10, f11, c00, c01, c10, c11)) * P255)
        r00 = I0
        r01 = I0
        r10 = I0
        r11 = I0
        for nt in range(NT):
            if nt < HT:
                r00 += si[nt * 4] + si[nt * 4 + 1]
                r10 += si[nt * 4 + 2] + si[nt * 4 + 3]
            else:
                r01 += si[nt * 4] + si[nt * 4 + 1]
                r11 += si[nt * 4 + 2] + si[nt * 4 + 3]
        st[2] = st[2] * st[4] + float32(r00) * wn[0] + float32(r01) * wn[1]
        st[3] = st[3] * st[5] + float32(r10) * wn[2] + float32(r11) * wn[3]

    @cuda.jit(device=True, inline=True)
    def pack_g(pr, si, grp):
        """u8 P of 64-key group ``grp`` (si) into its A fragments: register a0 of k-step kk takes
        n-tiles 4 kk, 4 kk + 1 of row g (keys 2t, 2t+1, 8+2t, 9+2t: vt8.VT8_PERM), a1 row g + 8,
        a2 / a3 n-tiles 4 kk + 2, 4 kk + 3."""
        for kq in range(KG):
            kk = grp * KG + kq
            c = kk * 16
            pr[kk * 4 + 0] = wrap_i32(si[c + 0] | (si[c + 1] << 8) | (si[c + 4] << 16) | (si[c + 5] << 24))
            pr[kk * 4 + 1] = wrap_i32(si[c + 2] | (si[c + 3] << 8) | (si[c + 6] << 16) | (si[c + 7] << 24))
            pr[kk * 4 + 2] = wrap_i32(si[c + 8] | (si[c + 9] << 8) | (si[c + 12] << 16) | (si[c + 13] << 24))
            pr[kk * 4 + 3] = wrap_i32(si[c + 10] | (si[c + 11] << 8) | (si[c + 14] << 16) | (si[c + 15] << 24))

    @cuda.jit(device=True, inline=True)
    def issue_pv(acci, pr, dv, grp, sm, scr):
        """acci = P V of group ``grp`` (2 k-steps of m64nDk32 u8 x s8; onto the bias with BIASACC); commit."""
        for kq in range(KG):
            kk = grp * KG + kq
            wg_pv(acci, pr[kk * 4], pr[kk * 4 + 1], pr[kk * 4 + 2], pr[kk * 4 + 3], dv + kk * 16,
                  1 if BIASACC else kq, sm, scr)
        wg_commit()

    @cuda.jit(device=True, inline=True)
    def add_group(acc, acci, w0, w1):
        """O += float(acc_int32) * w (row g: w0, row g + 8: w1)."""
        for nt in range(DT):
            acc[nt * 4 + 0] += (s_raw(acci, nt * 4 + 0) - FB) * w0
            acc[nt * 4 + 1] += (s_raw(acci, nt * 4 + 1) - FB) * w0
            acc[nt * 4 + 2] += (s_raw(acci, nt * 4 + 2) - FB) * w1
            acc[nt * 4 + 3] += (s_raw(acci, nt * 4 + 3) - FB) * w1

    @cuda.jit(device=True, inline=True)
    def store(o, acc, l0, l1, obase, os1, row0, L, t, scrf, v, vsb):
        """O / l x v_scale[channel] as bf16 pairs (l0 / l1: this lane's parts; the scales: fp32 bits
        at words vsb + channel of v)."""
        inv0 = ONE / quad_sum(l0, scrf)
        inv1 = ONE / quad_sum(l1, scrf)
        ob = obase + t
        for nt in range(DT):
            c0 = bits_f32(v[vsb + nt * 8 + 2 * t])
            c1 = bits_f32(v[vsb + nt * 8 + 2 * t + 1])
            if row0 < L:
                o[ob + row0 * os1 + nt * 4] = pack_bf16(acc[nt * 4 + 0] * inv0 * c0, acc[nt * 4 + 1] * inv0 * c1)
            if row0 + 8 < L:
                o[ob + (row0 + 8) * os1 + nt * 4] = pack_bf16(acc[nt * 4 + 2] * inv1 * c0,
                                                              acc[nt * 4 + 3] * inv1 * c1)

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
        ntiles = (L + BN - 1) // BN
        kbase = bh * ntiles * (TB8 // 4)           # the tiled K8: ntiles x BN rows per head
        vbase = b * vs0 + h * vs1
        vsb = vbase + ntiles * (TBV // 4)           # the head's V channel scales, after its tiles
        nkt = Lp // 64
        if QTOK:
            q0 = qsc[bh * Lp + min(m0 + warp * 16 + g, Lp - 1)] * float32(sl2)
            q1 = qsc[bh * Lp + min(m0 + warp * 16 + g + 8, Lp - 1)] * float32(sl2)
        else:
            q0 = qsc[bh * (Lp // 16) + min(m0 // 16 + warp, Lp // 16 - 1)] * float32(sl2)
            q1 = q0
        for i in range(QLOADS):
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
        fence_async()                           # Q's generic reads before the bulk copies reuse stage 0
        cuda.syncthreads()
        nfull = L // BN
        wg = warp // 4
        if tid == 0:
            ring_start(sm, mbs, kb, mb, k, v, kbase, vbase, ntiles)
        acc = cuda.local.array(NACC, float32)
        zero(acc, NACC)
        acci = cuda.local.array(NACC, int32)
        si = cuda.local.array(NS, int32)
        s = cuda.local.array(NS, float32)
        pr = cuda.local.array(PR, int32)
        st = cuda.local.array(6, float32)
        wc = cuda.local.array(4, float32)       # group weights of tile j (its P V is in flight)
        wn = cuda.local.array(4, float32)       # of tile j + 1
        start_state(st)
        row0 = m0 + warp * 16 + g
        one = float32(1)
        dk0 = DK_HI | (int64(kb) >> 4)
        dv0 = DV_HI | (int64(kb + TB8) >> 4)
        kfirst = int32(bh * nkt)
        klast = int32(bh * nkt + nkt - 1)

        if wg == 1:
            named_arrive(1, NTH)
        cuda.syncthreads()
        mbar_wait(mbs, mb, 0)
        bias(si, NS)
        named_sync(1 + wg, NTH)
        issue_qk(si, qf, dk0, sm, scr)
        named_arrive(2 - wg, NTH)
        wg_wait0()
        ka = ksc[kfirst]
        kb2 = ksc[min(kfirst + I1, klast)]
        scaled(si, s, q0 * ka, q0 * kb2, q1 * ka, q1 * kb2)
        mask_ragged(s, mask, b, h, ms0, ms1, ms2, 0, row0, L, t, one, one, one)
        soft_u8(si, s, st, wc, one, one, one, one, ZERO, scrf)
        pack_g(pr, si, 0)
        pack_g(pr, si, 1)

        sp = int32(STAGES - 1)
        pp = I0
        sc = I0
        pc = I0
        sn = I1
        pn = I0
        kn = int32(kfirst + KSTEP)
        for j in range(ntiles):
            ka = ksc[min(kn, klast)]
            kb2 = ksc[min(int32(kn + I1), klast)]
            if tid == ISSUER and j + STAGES - 1 < ntiles:
                if j >= 1:
                    mbar_wait(mbs, mb + EMPTY + 8 * sp, pp)
                issue(sm, mbs, kb, mb, k, v, kbase, vbase, j + STAGES - 1, sp)
            if j + 1 < ntiles:
                mbar_wait(mbs, mb + 8 * sn, pn)
            dk = dk0 + sn * SBD
            dv = dv0 + sc * SBD
            bias(si, NS)
            bias(acci, NACC)
            named_sync(1 + wg, NTH)             # this warpgroup's turn: S(j+1), P(j) V(j) group 0
            issue_qk(si, qf, dk, sm, scr)
            issue_pv(acci, pr, dv, 0, sm, scr)
            named_arrive(2 - wg, NTH)
            wg_wait1()                          # S(j+1) done; group 0 may still run
            if FOLD and j + 2 <= nfull:         # a full, unmasked tile: the factors ride in the exp2 argument
                for i in range(NS):
                    s[i] = s_raw(si, i)
                soft_u8(si, s, st, wn, q0 * ka, q0 * kb2, q1 * ka, q1 * kb2, FB, scrf)
            else:
                scaled(si, s, q0 * ka, q0 * kb2, q1 * ka, q1 * kb2)
                mask_ragged(s, mask, b, h, ms0, ms1, ms2, (j + 1) * BN, row0, L, t, one, one, one)
                soft_u8(si, s, st, wn, one, one, one, one, ZERO, scrf)
            wg_wait0()                          # group 0's int32 P V
            add_group(acc, acci, wc[0], wc[2])
            bias(acci, NACC)
            wg_fence()
            issue_pv(acci, pr, dv, 1, sm, scr)
            pack_g(pr, si, 0)                   # (group 0's fragments are free)
            wg_wait0()
            if lane == 0:
                mbar_arrive(mbs, mb + EMPTY + 8 * sc)    # this warp is done with tile j
            add_group(acc, acci, wc[1], wc[3])
            rescale(acc, st[4], st[5])
            pack_g(pr, si, 1)
            for i in range(4):
                wc[i] = wn[i]
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
            named_sync(1, NTH)
        store(o, acc, st[2], st[3], b * os0 + h * (D // 2), os1, row0, L, t, scrf, v, vsb)

    return Kernel(kern, rows=BM, threads=NTH, tile_kv=BN, dyn_smem=STAGES * SB if DYN else 0, v_s8=True)
