"""bf16 attention kernel on mma.sync (every GPU with sm_80+, any head dim <= 128)."""
from .launch import cuda, int32, float32, _mma, _math
from .launch import SMEM_ALIGN, _LOG2E, Kernel


def make(cfg, D, has_mask):
    """The kernel for ``cfg`` (a Bf16Config of kind "mma"), head dim D -> ``Kernel``."""
    BN = cfg.keys
    NW = cfg.rows // 16
    BM = 16 * NW           # one warp per 16 query rows
    NTH = NW * 32
    DW = D // 2            # 32-bit words per row
    RW = DW + 4            # padded shared row (words)
    CH = DW // 4           # 16-byte chunks per row
    LOADS = BN * CH // NTH  # cp.async per thread per K/V tile
    QLOADS = BM * CH // NTH  # ... per Q tile
    KT = D // 16           # k-steps of Q K^T
    NT = BN // 8           # n-tiles of S
    NP = NT // 2
    DT = D // 8            # n-tiles of O
    DP = DT // 2
    PT = BN // 16          # k-steps of P V
    TILE = BN * RW
    TILE2 = 2 * TILE
    QF = KT * 4
    NACC = DT * 4
    NS = NT * 4
    SCRW = _mma.SCR_WORDS
    SCRF = _mma.SCRF_WORDS
    LOG2E = float32(_LOG2E)
    MASK_FLOOR = float32(-1e30)
    NEG = float32(-3e38)
    HAS_MASK = has_mask
    mma_bf16, ldsm_x4, ldsm_x4_t = _mma.mma_bf16, _mma.ldsm_x4, _mma.ldsm_x4_t
    cp_async16, cp_commit, cp_wait0, cp_wait1 = _mma.cp_async16, _mma.cp_commit, _mma.cp_wait0, _mma.cp_wait1
    quad_max, quad_sum, pack_bf16 = _mma.quad_max, _mma.quad_sum, _mma.pack_bf16
    assert BM <= 2 * BN and (BN * CH) % NTH == 0 and (BM * CH) % NTH == 0 and D % 16 == 0

    @cuda.jit(device=True, inline=True)
    def load_tile(sm, sbase, g, gbase, gstride, r0, L, tid, NLOAD):
        for i in range(NLOAD):
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
    def kern(q, k, v, o, mask, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1,
             ms0, ms1, ms2, L, H, sl2):
        sK = cuda.shared.array(TILE2, int32, alignment=SMEM_ALIGN)  # K tile | V tile (Q is staged across both)
        sV = sK
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
        es = float32(1) if HAS_MASK else sl   # scale applied inside exp2 (one FFMA per element)
        kb = _mma.smem_base(sK)
        vb = kb + TILE * 4
        # per-lane ldmatrix row addresses (bytes); loops add compile-time offsets
        qaddr = kb + ((warp * 16 + l8 + 8 * (j8 % 2)) * RW + 4 * (j8 // 2)) * 4
        kaddr = kb + ((l8 + 8 * (j8 // 2)) * RW + 4 * (j8 % 2)) * 4
        vaddr = vb + ((l8 + 8 * (j8 % 2)) * RW + 4 * (j8 // 2)) * 4
        qbase = b * qs0 + h * qs1
        kbase = b * ks0 + h * ks1
        vbase = b * vs0 + h * vs1

        # ---- Q tile -> sK -> A fragments in registers
        load_tile(sK, kb, q, qbase, qs2, m0, L, tid, QLOADS)
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
        load_tile(sK, kb, k, kbase, ks2, 0, L, tid, LOADS)
        cp_commit()

        acc = cuda.local.array(NACC, float32)
        for i in range(DT * 4):
            acc[i] = float32(0)
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
            load_tile(sV, vb, v, vbase, vs2, n0, L, tid, LOADS)
            cp_commit()
            cp_wait1()
            cuda.syncthreads()
            # ---- S = Q K^T (16 x 64 per warp)
            for i in range(NT * 4):
                s[i] = float32(0)
            for kk in range(KT):
                for npi in range(NP):
                    b0, b1, b2, b3 = ldsm_x4(sK, kaddr + (npi * 16 * RW + kk * 8) * 4, scr)
                    n = npi * 8
                    s[n + 0], s[n + 1], s[n + 2], s[n + 3] = mma_bf16(
                        qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3], b0, b1,
                        s[n + 0], s[n + 1], s[n + 2], s[n + 3], scr)
                    s[n + 4], s[n + 5], s[n + 6], s[n + 7] = mma_bf16(
                        qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3], b2, b3,
                        s[n + 4], s[n + 5], s[n + 6], s[n + 7], scr)
            cuda.syncthreads()
            if j + 1 < ntiles:
                load_tile(sK, kb, k, kbase, ks2, n0 + BN, L, tid, LOADS)
            cp_commit()

            # ---- online softmax (base 2)
            if HAS_MASK:  # mask in log2 units: scale S first (else the scale rides in exp2's FFMA)
                for i in range(NS):
                    s[i] = s[i] * sl
                for nt in range(NT):
                    for e in range(4):
                        col = n0 + nt * 8 + 2 * t + (e % 2)
                        row = row0 + 8 * (e // 2)
                        if row < L and col < L:
                            mv = mask[b * ms0 + h * ms1 + row * ms2 + col] * LOG2E
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
            al0 = _math.exp2((mr0 - x0) * es)
            al1 = _math.exp2((mr1 - x1) * es)
            mr0 = x0
            mr1 = x1
            y0 = x0 * es
            y1 = x1 * es
            ps0 = float32(0)
            ps1 = float32(0)
            for nt in range(NT):
                p = _math.exp2(s[nt * 4 + 0] * es - y0)
                s[nt * 4 + 0] = p
                ps0 += p
                p = _math.exp2(s[nt * 4 + 1] * es - y0)
                s[nt * 4 + 1] = p
                ps0 += p
                p = _math.exp2(s[nt * 4 + 2] * es - y1)
                s[nt * 4 + 2] = p
                ps1 += p
                p = _math.exp2(s[nt * 4 + 3] * es - y1)
                s[nt * 4 + 3] = p
                ps1 += p
            lr0 = lr0 * al0 + ps0
            lr1 = lr1 * al1 + ps1
            for nt in range(DT):
                acc[nt * 4 + 0] *= al0
                acc[nt * 4 + 1] *= al0
                acc[nt * 4 + 2] *= al1
                acc[nt * 4 + 3] *= al1

            # ---- O += P V
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
