"""bf16 attention kernel on wgmma (Hopper; head dim 128 on the GPU).

Q in registers (A fragments), K / V from shared memory through no-swizzle descriptors; K and V
re-laid out once per call by ``tile_kv`` and moved one tile per bulk copy (the per-thread cp.async
loads were the limiter: BENCHMARKS.md, attention ablations); S(j+1) issued with P(j) V(j); a phantom S
after the last tile keeps every wgmma group outside a branch (ptxas serializes them otherwise)."""
from .. import runtime as _rt
from .launch import cuda, int32, int64, float32, _mma
from .launch import SMEM_ALIGN_WG, Kernel
from .fragments import thread_ids, zero, start_state, make_rescale, make_store, make_q_frags, make_wg_mma
from .softmax import _make_softmax
from .tile_kv import _make_ring


def make(cfg, D, has_mask):
    """The bf16 wgmma kernel (Hopper): NWG warpgroups x 64 query rows share each BN-key K / V
    tile; S(j+1) = Q K(j+1)^T and O += P(j) V(j) are issued back to back (FA3's intra-warpgroup
    overlap), the softmax of tile j+1 runs after wgmma.wait_group 1 (S done) while P V still
    runs, then wait_group 0, rescale O, pack P(j+1).  k and v are the TILED buffers of
    ``tile_kv`` (each BN-key tile = the TB bytes of its shared-memory image, zero past L): thread
    0 moves a tile with two cp.async.bulk copies into a STAGES-deep ring; they complete on the
    stage's mbarrier, which every thread waits on (no per-thread K/V loads).  A ring over 48 KB
    lives in dynamic shared memory (the launcher opts in first).  cfg: a Bf16Config of kind "wgmma"
    (warpgroups, keys = BN, stages) -> ``Kernel`` (tile_kv = BN: k / v come as tile images)."""
    NWG, BN, STAGES = cfg.warpgroups, cfg.keys, cfg.stages
    assert STAGES >= 3
    BM = 64 * NWG
    NTH = 128 * NWG
    CH = D // 8
    GB = CH * 128
    TB = BN * D * 2
    SB = 2 * TB
    RINGW = STAGES * SB // 4
    QLOADS = BM * CH // NTH
    KT = D // 16
    NT = BN // 8
    NS = NT * 4
    NACC = D // 2
    PT = BN // 16
    PR = PT * 4
    QF = KT * 4
    SCRW = _mma.SCR_WORDS if _rt.SIMULATOR else 0
    SCRF = _mma.SCRF_WORDS if _rt.SIMULATOR else 0
    HAS_MASK = has_mask
    DK_HI = ((128 >> 4) << 16) | ((GB >> 4) << 32)
    DV_HI = ((GB >> 4) << 16) | ((128 >> 4) << 32)
    wg_qk = _mma.wgmma_op(BN, 0)
    wg_pv = _mma.wgmma_op(D, 1)
    wg_wait0, wg_wait1, fence_async = _mma.wg_wait0, _mma.wg_wait1, _mma.fence_proxy_async
    cp_async16, cp_commit, cp_wait0 = _mma.cp_async16, _mma.cp_commit, _mma.cp_wait0
    assert (BM * CH) % NTH == 0 and D % 16 == 0
    DYN = STAGES * SB > 48 * 1024 and not _rt.SIMULATOR      # ring in dynamic shared memory
    RINGS = 0 if DYN else RINGW
    RALIGN = None if DYN else SMEM_ALIGN_WG
    assert BM * D * 2 <= STAGES * SB and STAGES * SB <= 227 * 1024
    MBW = 2 * STAGES
    MBALIGN = None if _rt.SIMULATOR else 8
    mbar_wait = _mma.mbar_wait
    issue, ring_start = _make_ring(TB, TB, STAGES)
    rescale, store, load_q = make_rescale(D, True), make_store(D), make_q_frags(KT, 256)
    issue_qk, issue_pv, pack_p = make_wg_mma(KT, PT, GB, wg_qk, wg_pv)

    @cuda.jit(device=True, inline=True)
    def load_tile(sm, sbase, g, gbase, gstride, r0, L, tid, NLOAD):
        for i in range(NLOAD):
            c = i * NTH + tid
            r8 = c % 8
            rest = c // 8
            cc = rest % CH
            grp = rest // CH
            row = r0 + grp * 8 + r8
            nb = 16 if row < L else 0
            row = min(row, L - 1)
            cp_async16(sm, sbase + grp * GB + cc * 128 + r8 * 16, g, gbase + row * gstride + cc * 4, nb)

    softmax = _make_softmax(BN, HAS_MASK)

    @cuda.jit(fastmath=True)
    def kern(q, k, v, o, mask, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1,
             ms0, ms1, ms2, L, H, sl2):
        sm = cuda.shared.array(RINGS, int32, alignment=RALIGN)   # 0: dynamic (DYN)
        scr = cuda.shared.array(SCRW, int32)
        scrf = cuda.shared.array(SCRF, float32)
        mbs = cuda.shared.array(MBW, int32, alignment=MBALIGN)
        tid, warp, lane, g, t, l8, j8, bh, b, h = thread_ids(H)
        m0 = cuda.blockIdx.x * BM
        sl = float32(sl2)
        es = float32(1) if HAS_MASK else sl
        kb = _mma.smem_base(sm)
        # (min / tid < NTH: kept from the retired producer-warp variant -- the PTX stays the tag's)
        qaddr = kb + (min(warp, 4 * NWG - 1) * 2 + j8 % 2) * GB + (j8 // 2) * 128 + l8 * 16
        qbase = b * qs0 + h * qs1
        kbase = b * ks0 + h * ks1
        vbase = b * vs0 + h * vs1

        if tid < NTH:
            load_tile(sm, kb, q, qbase, qs2, m0, L, tid, QLOADS)
        cp_commit()
        cp_wait0()
        cuda.syncthreads()
        qf = cuda.local.array(QF, int32)
        load_q(qf, sm, qaddr, scr)
        fence_async()                   # these generic reads of stage 0 before its bulk writes
        cuda.syncthreads()
        ntiles = (L + BN - 1) // BN
        mb = _mma.smem_base(mbs)
        if tid == 0:
            ring_start(sm, mbs, kb, mb, k, v, kbase, vbase, ntiles)

        acc = cuda.local.array(NACC, float32)
        zero(acc, NACC)
        s = cuda.local.array(NS, float32)
        pr = cuda.local.array(PR, int32)
        st = cuda.local.array(6, float32)
        start_state(st)
        row0 = m0 + warp * 16 + g

        # ---- tile 0: S, softmax, P
        cuda.syncthreads()              # mbarriers initialised (and the simulator's copies done)
        mbar_wait(mbs, mb, 0)
        issue_qk(s, qf, DK_HI | (int64(kb) >> 4), sm, scr)
        wg_wait0()
        softmax(s, st, mask, b, h, ms0, ms1, ms2, 0, row0, L, t, sl, es, scrf)
        pack_p(pr, s)

        for j in range(ntiles):
            cuda.syncthreads()          # every warp is past P(j-1) V(j-1): stage (j-1) % S is free
            t0 = (j + STAGES - 1) * BN
            if tid == 0 and t0 < L:
                issue(sm, mbs, kb, mb, k, v, kbase, vbase, j + STAGES - 1, (j + STAGES - 1) % STAGES)
            if j + 1 < ntiles:          # tile j+1 landed (waited for after the issue above)
                mbar_wait(mbs, mb + 8 * ((j + 1) % STAGES), ((j + 1) // STAGES) & 1)
            # No branches around the wgmma groups (ptxas serializes every wgmma of the kernel when
            # it cannot count the groups): the last iteration computes a phantom S(ntiles) from a
            # stale stage; its columns are all >= L, so they become -3e38 before the max (NaN-proof),
            # the max does not move (al = 1) and p = 0: the state is unchanged.
            dk = DK_HI | (int64(kb + ((j + 1) % STAGES) * SB) >> 4)
            dv = DV_HI | (int64(kb + (j % STAGES) * SB + TB) >> 4)
            issue_qk(s, qf, dk, sm, scr)
            issue_pv(acc, pr, dv, sm, scr)
            wg_wait1()                  # S(j+1) done; P(j) V(j) may still run
            softmax(s, st, mask, b, h, ms0, ms1, ms2, (j + 1) * BN, row0, L, t, sl, es, scrf)
            wg_wait0()
            rescale(acc, st[4], st[5])
            pack_p(pr, s)

        store(o, acc, st[2], st[3], b * os0 + h * (D // 2), os1, row0, L, t, scrf)

    return Kernel(kern, rows=BM, threads=NTH, tile_kv=BN, dyn_smem=STAGES * SB if DYN else 0)
