"""Register-fragment pieces every attention kernel shares (inline device functions).

The kernels hold S and O in the mma / wgmma accumulator layout: thread (warp, lane) owns rows
row0 = m0 + 16 warp + g and row0 + 8 (g = lane / 4) and, per 8-column n-tile, columns
2 t, 2 t + 1 (t = lane % 4): 4 values per n-tile, [nt * 4 + e], e = 2 * (row half) + column.
  thread_ids   the ids every kernel derives from threadIdx / blockIdx;
  zero         clear an accumulator;
  make_rescale O *= alpha per row after a running-max move (lazy: only when alpha < 1, exact);
  make_store   final 1 / row sum (summed over the 4 lanes of a row) and the bf16 store of O;
  make_pv_mma  O += P V on mma.sync m16n8k16 from P in registers and a padded V tile (ldmatrix.trans);
  start_state  the online-softmax state before the first tile;
  make_q_frags Q's A fragments from shared memory into registers (ldmatrix.x4);
  make_qk_mma  S += Q K^T on mma.sync (bf16 m16n8k16 or int8 m16n8k32) from a padded K tile;
  make_wg_mma  the wgmma kernels' S / P V issue groups and the P packing;
  make_load_rows  cp.async of 16-bit rows into padded shared rows (the mma kernels' K / V tiles).
"""
from .launch import cuda, float32, _mma


@cuda.jit(device=True, inline=True)
def thread_ids(H):
    """(tid, warp, lane, g, t, l8, j8, bh, b, h) of this thread / block (grid y = b * H + h)."""
    tid = cuda.threadIdx.x
    warp = tid // 32
    lane = tid % 32
    bh = cuda.blockIdx.y
    b = bh // H
    return tid, warp, lane, lane // 4, lane % 4, lane % 8, lane // 8, bh, b, bh - b * H


@cuda.jit(device=True, inline=True)
def zero(acc, n):
    for i in range(n):
        acc[i] = float32(0)


def make_rescale(D, LAZY):
    """rescale(acc, al0, al1): O rows g / g + 8 times their alpha (LAZY: skipped when alpha is 1,
    i.e. the running max did not move)."""
    DT = D // 8
    ONE = float32(1)

    @cuda.jit(device=True, inline=True)
    def rescale(acc, al0, al1):
        if not LAZY or al0 < ONE:
            for nt in range(DT):
                acc[nt * 4 + 0] *= al0
                acc[nt * 4 + 1] *= al0
        if not LAZY or al1 < ONE:
            for nt in range(DT):
                acc[nt * 4 + 2] *= al1
                acc[nt * 4 + 3] *= al1

    return rescale


def make_store(D, QUAD=True):
    """store(o, acc, l0, l1, obase, os1, row0, L, t, scrf): O / row sum as bf16 pairs into o (int32
    words; obase = the (b, h) offset, os1 = the row stride), rows >= L not stored.  QUAD: l0 / l1
    are this lane's partial sums (summed over the row's 4 lanes here); else the whole row's."""
    DT = D // 8
    quad_sum, pack_bf16 = _mma.quad_sum, _mma.pack_bf16

    @cuda.jit(device=True, inline=True)
    def store(o, acc, l0, l1, obase, os1, row0, L, t, scrf):
        if QUAD:
            l0 = quad_sum(l0, scrf)
            l1 = quad_sum(l1, scrf)
        inv0 = float32(1) / l0
        inv1 = float32(1) / l1
        ob = obase + t
        if row0 < L:
            for nt in range(DT):
                o[ob + row0 * os1 + nt * 4] = pack_bf16(acc[nt * 4 + 0] * inv0, acc[nt * 4 + 1] * inv0)
        if row0 + 8 < L:
            for nt in range(DT):
                o[ob + (row0 + 8) * os1 + nt * 4] = pack_bf16(acc[nt * 4 + 2] * inv1, acc[nt * 4 + 3] * inv1)

    return store


def make_pv_mma(D, BN, RW):
    """pv(acc, s, sV, vaddr, scr): O += P V for one BN-key tile -- P (fp32 in s, S's layout) packed
    to bf16 A fragments, V from shared memory rows of RW words through ldmatrix.x4.trans."""
    PT = BN // 16
    DP = D // 16
    mma_bf16, ldsm_x4_t, pack_bf16 = _mma.mma_bf16, _mma.ldsm_x4_t, _mma.pack_bf16

    @cuda.jit(device=True, inline=True)
    def pv(acc, s, sV, vaddr, scr):
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

    return pv


@cuda.jit(device=True, inline=True)
def start_state(st):
    """Online-softmax state before the first tile (see softmax.py): max -3e38, sums 0."""
    st[0] = float32(-3e38)
    st[1] = float32(-3e38)
    st[2] = float32(0)
    st[3] = float32(0)


def make_q_frags(KT, STEP):
    """load_q(qf, sm, qaddr, scr): Q's A fragments for KT k-steps from shared memory (ldmatrix.x4
    at qaddr + kk * STEP bytes) into registers."""
    ldsm_x4 = _mma.ldsm_x4

    @cuda.jit(device=True, inline=True)
    def load_q(qf, sm, qaddr, scr):
        for kk in range(KT):
            a0, a1, a2, a3 = ldsm_x4(sm, qaddr + kk * STEP, scr)
            qf[kk * 4 + 0] = a0
            qf[kk * 4 + 1] = a1
            qf[kk * 4 + 2] = a2
            qf[kk * 4 + 3] = a3

    return load_q


def make_qk_mma(KT, NP, RW, op):
    """qk(s, qf, sK, kaddr, scr): S += Q K^T for one key tile on mma.sync (``op``: _mma.mma_bf16
    or mma_s8), K rows of RW words through ldmatrix.x4; NP pairs of 8-key n-tiles."""
    ldsm_x4 = _mma.ldsm_x4

    @cuda.jit(device=True, inline=True)
    def qk(s, qf, sK, kaddr, scr):
        for kk in range(KT):
            for npi in range(NP):
                b0, b1, b2, b3 = ldsm_x4(sK, kaddr + (npi * 16 * RW + kk * 8) * 4, scr)
                n = npi * 8
                s[n + 0], s[n + 1], s[n + 2], s[n + 3] = op(
                    qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3], b0, b1,
                    s[n + 0], s[n + 1], s[n + 2], s[n + 3], scr)
                s[n + 4], s[n + 5], s[n + 6], s[n + 7] = op(
                    qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3], b2, b3,
                    s[n + 4], s[n + 5], s[n + 6], s[n + 7], scr)

    return qk


def make_wg_mma(KT, PT, GB, wg_qk, wg_pv, QK_ACC=False):
    """(qk, pv, pack_p) of the wgmma kernels: ``qk(s, qf, dk, sm, scr)`` issues S = Q K^T (KT
    k-steps; fence + commit; QK_ACC: S += Q K^T onto what s holds), ``pv(acc, pr, dv, sm, scr)``
    issues O += P V (PT k-steps; commit), ``pack_p(pr, s)`` packs P (fp32) into the bf16 A
    fragments of the next P V.  dk / dv: the K / V tiles' shared-memory descriptors (V: MN-major,
    GB bytes between the 8-row groups of keys)."""
    wg_fence, wg_commit, pack_bf16 = _mma.wg_fence, _mma.wg_commit, _mma.pack_bf16
    PR = PT * 4
    VSTEP = 2 * GB // 16

    @cuda.jit(device=True, inline=True)
    def qk(s, qf, dk, sm, scr):
        wg_fence()
        for kk in range(KT):
            wg_qk(s, qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3], dk + kk * 16,
                  1 if QK_ACC else kk, sm, scr)
        wg_commit()

    @cuda.jit(device=True, inline=True)
    def pv(acc, pr, dv, sm, scr):
        for kk in range(PT):
            wg_pv(acc, pr[kk * 4], pr[kk * 4 + 1], pr[kk * 4 + 2], pr[kk * 4 + 3], dv + kk * VSTEP, 1, sm, scr)
        wg_commit()

    @cuda.jit(device=True, inline=True)
    def pack_p(pr, s):
        for i in range(PR):
            pr[i] = pack_bf16(s[2 * i], s[2 * i + 1])

    return qk, pv, pack_p


def make_load_rows(NTH, CH, RW):
    """load(sm, sbase, g, gbase, gstride, r0, L, tid, NLOAD): rows r0 .. of a 16-bit tensor (global
    word offset gbase, row stride gstride words) -> shared rows of RW words (padded: conflict-free
    ldmatrix), CH 16-byte chunks per row, NLOAD cp.async per thread; rows >= L zero-filled."""
    cp_async16 = _mma.cp_async16

    @cuda.jit(device=True, inline=True)
    def load(sm, sbase, g, gbase, gstride, r0, L, tid, NLOAD):
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

    return load
