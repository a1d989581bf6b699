"""8-bit attention kernel on mma.sync (int8 Q K^T, bf16 P V)."""
from .launch import cuda, int32, float32, _mma, _math
from .launch import SMEM_ALIGN, _BN, _LOG2E, Kernel


def make(cfg, D, has_mask, per_tok=False):
    """per_tok: qsc / ksc are per-token scales [B*H*Lp] (qk_norm_rope's Quant8): K's of a tile are
    staged in shared memory with the K tile (double-buffered), S' = int32 * k_scale[col] and the
    row scale rides in the exp2 argument: exp2(S' * qr - max' * qr) (one FFMA, as many FMULs as the
    per-block path).  Else Q per 16 rows / K per 64-token tile (the pre-pass's scales).
    cfg: an Int8Config of kind "mma" -> ``Kernel``."""
    BM, BN, NW = cfg.rows, cfg.keys, cfg.rows // 16
    assert BN == _BN, "the pre-pass's K scales are per 64 keys"
    PER_TOK = per_tok
    KSW = 2 * BN if per_tok else 4
    NTH = NW * 32
    RW8 = D // 4 + 4       # padded int8 row (words)
    CH8 = D // 16          # 16-byte chunks per int8 row
    DW = D // 2
    RW = DW + 4            # padded bf16 row (words)
    CH = DW // 4
    L8 = BN * CH8 // NTH
    LV = BN * CH // NTH
    KT = D // 32           # k-steps of the int8 Q K^T
    NT = BN // 8
    NP = NT // 2
    DT = D // 8
    DP = DT // 2
    PT = BN // 16
    NS = NT * 4
    NACC = DT * 4
    QF = KT * 4
    T8 = BN * RW8
    TV = BN * RW
    SCRW = _mma.SCR_WORDS
    SCRF = _mma.SCRF_WORDS
    LOG2E = float32(_LOG2E)
    MASK_FLOOR = float32(-1e30)
    NEG = float32(-3e38)
    HAS_MASK = has_mask
    mma_s8, mma_bf16, ldsm_x4, ldsm_x4_t = _mma.mma_s8, _mma.mma_bf16, _mma.ldsm_x4, _mma.ldsm_x4_t
    cp_async16, cp_commit, cp_wait0, cp_wait1 = _mma.cp_async16, _mma.cp_commit, _mma.cp_wait0, _mma.cp_wait1
    quad_max, quad_sum, pack_bf16 = _mma.quad_max, _mma.quad_sum, _mma.pack_bf16
    assert BM == BN and D % 32 == 0 and (BN * CH8) % NTH == 0 and (BN * CH) % NTH == 0

    @cuda.jit(device=True, inline=True)
    def load8(sbase, sm, g, gbase, r0, tid):   # int8 rows, padded tensor: always in range
        for i in range(L8):
            c = i * NTH + tid
            r = c // CH8
            cc = c - r * CH8
            cp_async16(sm, sbase + (r * RW8 + cc * 4) * 4, g, gbase + (r0 + r) * (D // 4) + cc * 4, 16)

    @cuda.jit(device=True, inline=True)
    def load16(sbase, sm, g, gbase, gstride, r0, L, tid):  # caller's bf16 rows (strided), zero past L
        for i in range(LV):
            c = i * NTH + tid
            r = c // CH
            cc = c - r * CH
            row = r0 + r
            nb = 16
            if row >= L:
                row = L - 1
                nb = 0
            cp_async16(sm, sbase + (r * RW + cc * 4) * 4, g, gbase + row * gstride + cc * 4, nb)

    @cuda.jit(fastmath=True)
    def kern(q, k, v, qsc, ksc, o, mask, vs0, vs1, vs2, os0, os1, ms0, ms1, ms2, L, Lp, H, sl2):
        sK = cuda.shared.array(T8, int32, alignment=SMEM_ALIGN)
        sV = cuda.shared.array(TV, int32, alignment=SMEM_ALIGN)
        sKS = cuda.shared.array(KSW, float32, alignment=SMEM_ALIGN)
        scr = cuda.shared.array(SCRW, int32)
        scrf = cuda.shared.array(SCRF, float32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        l8 = lane % 8
        j8 = lane // 8
        bh = cuda.blockIdx.y
        b = bh // H
        h = bh - b * H
        m0 = cuda.blockIdx.x * BM
        sl = float32(sl2)
        kb = _mma.smem_base(sK)
        vb = _mma.smem_base(sV)
        ksb = _mma.smem_base(sKS)
        qaddr = kb + ((warp * 16 + l8 + 8 * (j8 % 2)) * RW8 + 4 * (j8 // 2)) * 4
        kaddr = kb + ((l8 + 8 * (j8 // 2)) * RW8 + 4 * (j8 % 2)) * 4
        vaddr = vb + ((l8 + 8 * (j8 % 2)) * RW + 4 * (j8 // 2)) * 4
        base8 = bh * Lp * (D // 4)
        vbase = b * vs0 + h * vs1
        nkt = Lp // BN
        if PER_TOK:  # exp2 multipliers of rows g, g + 8 (the per-block path: 1, folded in qscale)
            qscale = float32(0)
            mq0 = qsc[bh * Lp + m0 + warp * 16 + g] * sl
            mq1 = qsc[bh * Lp + m0 + warp * 16 + g + 8] * sl
            iq0 = float32(1) / mq0
            iq1 = float32(1) / mq1
        else:
            qscale = qsc[bh * (Lp // 16) + (m0 // 16) + warp] * sl
            mq0 = float32(1)
            mq1 = float32(1)
            iq0 = float32(1)
            iq1 = float32(1)

        load8(kb, sK, q, base8, m0, tid)
        cp_commit()
        cp_wait0()
        cuda.syncthreads()
        qf = cuda.local.array(QF, int32)
        for kk in range(KT):
            a0, a1, a2, a3 = ldsm_x4(sK, qaddr + kk * 32, scr)
            qf[kk * 4 + 0] = a0
            qf[kk * 4 + 1] = a1
            qf[kk * 4 + 2] = a2
            qf[kk * 4 + 3] = a3
        cuda.syncthreads()
        load8(kb, sK, k, base8, 0, tid)
        if PER_TOK and tid < BN // 4:  # the tile's 64 K scales (buffer 0)
            cp_async16(sKS, ksb + tid * 16, ksc, bh * Lp + tid * 4, 16)
        cp_commit()

        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0)
        si = cuda.local.array(NS, int32)
        s = cuda.local.array(NS, float32)
        mr0 = NEG
        mr1 = NEG
        lr0 = float32(0)
        lr1 = float32(0)
        row0 = m0 + warp * 16 + g
        row1 = row0 + 8
        ntiles = (L + BN - 1) // BN
        for j in range(ntiles):
            n0 = j * BN
            load16(vb, sV, v, vbase, vs2, n0, L, tid)
            cp_commit()
            cp_wait1()
            cuda.syncthreads()
            for i in range(NS):
                si[i] = 0
            for kk in range(KT):
                for npi in range(NP):
                    b0, b1, b2, b3 = ldsm_x4(sK, kaddr + (npi * 16 * RW8 + kk * 8) * 4, scr)
                    n = npi * 8
                    si[n + 0], si[n + 1], si[n + 2], si[n + 3] = mma_s8(
                        qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3], b0, b1,
                        si[n + 0], si[n + 1], si[n + 2], si[n + 3], scr)
                    si[n + 4], si[n + 5], si[n + 6], si[n + 7] = mma_s8(
                        qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3], b2, b3,
                        si[n + 4], si[n + 5], si[n + 6], si[n + 7], scr)
            cuda.syncthreads()
            if j + 1 < ntiles:
                load8(kb, sK, k, base8, n0 + BN, tid)
                if PER_TOK and tid < BN // 4:  # K scales of tile j + 1 -> buffer (j + 1) % 2
                    cp_async16(sKS, ksb + (((j + 1) % 2) * BN + tid * 4) * 4, ksc, bh * Lp + n0 + BN + tid * 4, 16)
            cp_commit()

            if PER_TOK:  # S' = S / row scale: int32 x k_scale[col]
                kso = (j % 2) * BN + 2 * t
                for nt in range(NT):
                    kc0 = sKS[kso + nt * 8]
                    kc1 = sKS[kso + nt * 8 + 1]
                    s[nt * 4 + 0] = float32(si[nt * 4 + 0]) * kc0
                    s[nt * 4 + 1] = float32(si[nt * 4 + 1]) * kc1
                    s[nt * 4 + 2] = float32(si[nt * 4 + 2]) * kc0
                    s[nt * 4 + 3] = float32(si[nt * 4 + 3]) * kc1
            else:
                f = qscale * ksc[bh * nkt + j]
                for i in range(NS):
                    s[i] = float32(si[i]) * f
            if HAS_MASK:
                for nt in range(NT):
                    for e in range(4):
                        col = n0 + nt * 8 + 2 * t + (e % 2)
                        row = row0 + 8 * (e // 2)
                        if row < L and col < L:
                            mv = mask[b * ms0 + h * ms1 + row * ms2 + col] * LOG2E
                            if PER_TOK:
                                s[nt * 4 + e] += max(mv * (iq0 if e < 2 else iq1), MASK_FLOOR)
                            else:
                                s[nt * 4 + e] += max(mv, MASK_FLOOR)
            if n0 + BN > L:
                for nt in range(NT):
                    for e in range(4):
                        if n0 + nt * 8 + 2 * t + (e % 2) >= L:
                            s[nt * 4 + e] = NEG
            x0 = NEG
            x1 = NEG
            for nt in range(NT):
                x0 = max(x0, max(s[nt * 4 + 0], s[nt * 4 + 1]))
                x1 = max(x1, max(s[nt * 4 + 2], s[nt * 4 + 3]))
            x0 = quad_max(x0, scrf)
            x1 = quad_max(x1, scrf)
            x0 = max(x0, mr0)
            x1 = max(x1, mr1)
            al0 = _math.exp2((mr0 - x0) * mq0)
            al1 = _math.exp2((mr1 - x1) * mq1)
            mr0 = x0
            mr1 = x1
            nx0 = -x0 * mq0
            nx1 = -x1 * mq1
            ps0 = float32(0)
            ps1 = float32(0)
            for nt in range(NT):
                p = _math.exp2(s[nt * 4 + 0] * mq0 + nx0)
                s[nt * 4 + 0] = p
                ps0 += p
                p = _math.exp2(s[nt * 4 + 1] * mq0 + nx0)
                s[nt * 4 + 1] = p
                ps0 += p
                p = _math.exp2(s[nt * 4 + 2] * mq1 + nx1)
                s[nt * 4 + 2] = p
                ps1 += p
                p = _math.exp2(s[nt * 4 + 3] * mq1 + nx1)
                s[nt * 4 + 3] = p
                ps1 += p
            lr0 = lr0 * al0 + ps0
            lr1 = lr1 * al1 + ps1
            for nt in range(DT):
                acc[nt * 4 + 0] *= al0
                acc[nt * 4 + 1] *= al0
                acc[nt * 4 + 2] *= al1
                acc[nt * 4 + 3] *= al1

            cp_wait1()
            cuda.syncthreads()
            for kk in range(PT):
                c = kk * 8
                p0 = pack_bf16(s[c + 0], s[c + 1])
                p1 = pack_bf16(s[c + 2], s[c + 3])
                p2 = pack_bf16(s[c + 4], s[c + 5])
                p3 = pack_bf16(s[c + 6], s[c + 7])
                for dp in range(DP):
                    b0, b1, b2, b3 = ldsm_x4_t(sV, vaddr + (kk * 16 * RW + dp * 8) * 4, scr)
                    n = dp * 8
                    acc[n + 0], acc[n + 1], acc[n + 2], acc[n + 3] = mma_bf16(
                        p0, p1, p2, p3, b0, b1, acc[n + 0], acc[n + 1], acc[n + 2], acc[n + 3], scr)
                    acc[n + 4], acc[n + 5], acc[n + 6], acc[n + 7] = mma_bf16(
                        p0, p1, p2, p3, b2, b3, acc[n + 4], acc[n + 5], acc[n + 6], acc[n + 7], scr)
            cuda.syncthreads()

        lr0 = quad_sum(lr0, scrf)
        lr1 = quad_sum(lr1, scrf)
        inv0 = float32(1) / lr0
        inv1 = float32(1) / lr1
        obase = b * os0 + h * DW + t
        if row0 < L:
            for nt in range(DT):
                o[obase + row0 * os1 + nt * 4] = pack_bf16(acc[nt * 4 + 0] * inv0, acc[nt * 4 + 1] * inv0)
        if row1 < L:
            for nt in range(DT):
                o[obase + row1 * os1 + nt * 4] = pack_bf16(acc[nt * 4 + 2] * inv1, acc[nt * 4 + 3] * inv1)

    return Kernel(kern, rows=BM, threads=NTH)
