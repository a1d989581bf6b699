"""8-bit attention kernel on mma.sync: S = Q8 K8^T on m16n8k32 s8 (exact int32), P V on bf16.

The bf16_mma structure (4 warps x 16 query rows, 64-key tiles, double-buffered cp.async, padded
rows) with int8 Q / K rows (the padded pre-pass buffers or qk_norm_rope's pack: always in range)
and the caller's bf16 V read in place.  S x scales -> fp32 in log2 units; softmax.py's pieces."""
from .launch import cuda, int32, float32, _mma
from .launch import SMEM_ALIGN, _BN, Kernel
from .fragments import (thread_ids, zero, start_state, make_load_rows, make_q_frags, make_qk_mma, make_rescale,
                        make_pv_mma, make_store)
from .softmax import make_parts


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
    NS = NT * 4
    NACC = DT * 4
    QF = KT * 4
    T8 = BN * RW8
    TV = BN * RW
    SCRW = _mma.SCR_WORDS
    SCRF = _mma.SCRF_WORDS
    HAS_MASK = has_mask
    cp_async16, cp_commit, cp_wait0, cp_wait1 = _mma.cp_async16, _mma.cp_commit, _mma.cp_wait0, _mma.cp_wait1
    assert BM == BN and D % 32 == 0 and (BN * CH8) % NTH == 0 and (BN * CH) % NTH == 0
    load16 = make_load_rows(NTH, CH, RW)
    load_q, qk = make_q_frags(KT, 32), make_qk_mma(KT, NP, RW8, _mma.mma_s8)
    (mask_ragged, update), rescale = make_parts(BN, HAS_MASK), make_rescale(D, False)
    pv, store = make_pv_mma(D, BN, RW), make_store(D)
    ONE = float32(1)

    @cuda.jit(device=True, inline=True)
    def load8(sbase, sm, g, gbase, r0, tid):   # int8 rows, padded tensor: always in range
        for i in range(L8):
            c = i * NTH + tid
            r = c // CH8
            cc = c - r * CH8
            cp_async16(sm, sbase + (r * RW8 + cc * 4) * 4, g, gbase + (r0 + r) * (D // 4) + cc * 4, 16)

    @cuda.jit(fastmath=True)
    def kern(q, k, v, qsc, ksc, o, mask, vs0, vs1, vs2, os0, os1, ms0, ms1, ms2, L, Lp, H, sl2):
        sK = cuda.shared.array(T8, int32, alignment=SMEM_ALIGN)
        sV = cuda.shared.array(TV, int32, alignment=SMEM_ALIGN)
        sKS = cuda.shared.array(KSW, float32, alignment=SMEM_ALIGN)
        scr = cuda.shared.array(SCRW, int32)
        scrf = cuda.shared.array(SCRF, float32)
        tid, warp, lane, g, t, l8, j8, bh, b, h = thread_ids(H)
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
            iq0 = ONE / mq0
            iq1 = ONE / mq1
        else:
            qscale = qsc[bh * (Lp // 16) + (m0 // 16) + warp] * sl
            mq0 = ONE
            mq1 = ONE
            iq0 = ONE
            iq1 = ONE

        load8(kb, sK, q, base8, m0, tid)
        cp_commit()
        cp_wait0()
        cuda.syncthreads()
        qf = cuda.local.array(QF, int32)
        load_q(qf, sK, qaddr, scr)
        cuda.syncthreads()
        load8(kb, sK, k, base8, 0, tid)
        if PER_TOK and tid < BN // 4:  # the tile's 64 K scales (buffer 0)
            cp_async16(sKS, ksb + tid * 16, ksc, bh * Lp + tid * 4, 16)
        cp_commit()

        acc = cuda.local.array(NACC, float32)
        zero(acc, NACC)
        si = cuda.local.array(NS, int32)
        s = cuda.local.array(NS, float32)
        st = cuda.local.array(6, float32)
        start_state(st)
        row0 = m0 + warp * 16 + g
        ntiles = (L + BN - 1) // BN
        for j in range(ntiles):
            n0 = j * BN
            load16(sV, vb, v, vbase, vs2, n0, L, tid, LV)
            cp_commit()
            cp_wait1()
            cuda.syncthreads()
            for i in range(NS):
                si[i] = 0
            qk(si, qf, sK, kaddr, scr)          # S = Q8 K8^T, exact int32
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
            # S is in log2 units up to the row factor mq (1 per block); the mask is scaled by 1 / mq
            mask_ragged(s, mask, b, h, ms0, ms1, ms2, n0, row0, L, t, ONE, iq0, iq1)
            update(s, st, mq0, mq1, scrf)
            rescale(acc, st[4], st[5])
            cp_wait1()
            cuda.syncthreads()
            pv(acc, s, sV, vaddr, scr)          # O += P V (the caller's bf16 V)
            cuda.syncthreads()

        store(o, acc, st[2], st[3], b * os0 + h * DW, os1, row0, L, t, scrf)

    return Kernel(kern, rows=BM, threads=NTH)
