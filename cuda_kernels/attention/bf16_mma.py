"""bf16 attention kernel on mma.sync m16n8k16 (every sm_80+ GPU, head dims 16 .. 128).

One block = rows / 16 warps x 16 query rows of one (b, h); K / V tiles of ``keys`` tokens in a
shared K | V buffer of padded rows (D + 8 bf16: conflict-free ldmatrix; 34.8 KB at D=128, under
the 48 KB static limit), moved by 16-byte cp.async (zero-filled past L).  Q is staged once
through that buffer and kept in registers as A fragments (ptxas at D=128: 254 registers, no
spills).  V of tile j loads while S = Q K^T of tile j runs, K of tile j+1 while P V of tile j
runs; online softmax in fp32 (softmax.py), P rounded to bf16 for P V, O rescaled every tile."""
from .launch import cuda, int32, float32, _mma
from .launch import SMEM_ALIGN, Kernel
from .fragments import (thread_ids, zero, start_state, make_load_rows, make_q_frags, make_qk_mma, make_rescale,
                        make_pv_mma, make_store)
from .softmax import _make_softmax


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
    TILE = BN * RW
    TILE2 = 2 * TILE
    QF = KT * 4
    NACC = DT * 4
    NS = NT * 4
    SCRW = _mma.SCR_WORDS
    SCRF = _mma.SCRF_WORDS
    HAS_MASK = has_mask
    cp_commit, cp_wait0, cp_wait1 = _mma.cp_commit, _mma.cp_wait0, _mma.cp_wait1
    assert BM <= 2 * BN and (BN * CH) % NTH == 0 and (BM * CH) % NTH == 0 and D % 16 == 0
    load_tile = make_load_rows(NTH, CH, RW)
    load_q, qk = make_q_frags(KT, 32), make_qk_mma(KT, NP, RW, _mma.mma_bf16)
    softmax, rescale = _make_softmax(BN, HAS_MASK), make_rescale(D, False)
    pv, store = make_pv_mma(D, BN, RW), make_store(D)

    @cuda.jit(fastmath=True)
    def kern(q, k, v, o, mask, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1,
             ms0, ms1, ms2, L, H, sl2):
        sK = cuda.shared.array(TILE2, int32, alignment=SMEM_ALIGN)  # K tile | V tile (Q is staged across both)
        sV = sK
        scr = cuda.shared.array(SCRW, int32)
        scrf = cuda.shared.array(SCRF, float32)
        tid, warp, lane, g, t, l8, j8, bh, b, h = thread_ids(H)
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
        load_q(qf, sK, qaddr, scr)
        cuda.syncthreads()
        load_tile(sK, kb, k, kbase, ks2, 0, L, tid, LOADS)
        cp_commit()

        acc = cuda.local.array(NACC, float32)
        zero(acc, NACC)
        s = cuda.local.array(NS, float32)
        st = cuda.local.array(6, float32)
        start_state(st)
        row0 = m0 + warp * 16 + g
        ntiles = (L + BN - 1) // BN
        for j in range(ntiles):
            # V of tile j loads while S = Q K^T of tile j runs, K of tile j+1 while P V of tile j runs
            n0 = j * BN
            load_tile(sV, vb, v, vbase, vs2, n0, L, tid, LOADS)
            cp_commit()
            cp_wait1()
            cuda.syncthreads()
            zero(s, NS)
            qk(s, qf, sK, kaddr, scr)           # S = Q K^T (16 x BN per warp)
            cuda.syncthreads()
            if j + 1 < ntiles:
                load_tile(sK, kb, k, kbase, ks2, n0 + BN, L, tid, LOADS)
            cp_commit()
            softmax(s, st, mask, b, h, ms0, ms1, ms2, n0, row0, L, t, sl, es, scrf)
            rescale(acc, st[4], st[5])
            cp_wait1()
            cuda.syncthreads()
            pv(acc, s, sV, vaddr, scr)          # O += P V
            cuda.syncthreads()

        store(o, acc, st[2], st[3], b * os0 + h * DW, os1, row0, L, t, scrf)

    return Kernel(kern, rows=BM, threads=NTH)
