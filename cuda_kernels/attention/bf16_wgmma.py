"""bf16 attention kernel on wgmma (Hopper, head dim 128 on the GPU)."""
from .. import runtime as _rt
from .launch import cuda, int32, int64, float32, _mma
from .launch import SMEM_ALIGN_WG, Kernel
from .softmax import _make_softmax
from .tile_kv import _make_issue


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
    DT = D // 8
    NACC = D // 2
    PT = BN // 16
    PR = PT * 4
    QF = KT * 4
    SCRW = _mma.SCR_WORDS if _rt.SIMULATOR else 0
    SCRF = _mma.SCRF_WORDS if _rt.SIMULATOR else 0
    NEG = float32(-3e38)
    HAS_MASK = has_mask
    DK_HI = ((128 >> 4) << 16) | ((GB >> 4) << 32)
    DV_HI = ((GB >> 4) << 16) | ((128 >> 4) << 32)
    wg_qk = _mma.wgmma_op(BN, 0)
    wg_pv = _mma.wgmma_op(D, 1)
    wg_fence, wg_commit, wg_wait0, wg_wait1 = _mma.wg_fence, _mma.wg_commit, _mma.wg_wait0, _mma.wg_wait1
    fence_async = _mma.fence_proxy_async
    ldsm_x4 = _mma.ldsm_x4
    cp_async16, cp_commit, cp_wait0 = _mma.cp_async16, _mma.cp_commit, _mma.cp_wait0
    quad_sum, pack_bf16 = _mma.quad_sum, _mma.pack_bf16
    assert (BM * CH) % NTH == 0 and D % 16 == 0
    DYN = STAGES * SB > 48 * 1024 and not _rt.SIMULATOR      # ring in dynamic shared memory
    RINGS = 0 if DYN else RINGW
    RALIGN = None if DYN else SMEM_ALIGN_WG
    assert BM * D * 2 <= STAGES * SB and STAGES * SB <= 227 * 1024
    MBW = 2 * STAGES
    MBALIGN = None if _rt.SIMULATOR else 8
    mbar_init, mbar_wait = _mma.mbar_init, _mma.mbar_wait
    fence_mbar_init = _mma.fence_mbar_init
    issue = _make_issue(TB, TB)

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
        for kk in range(KT):
            a0, a1, a2, a3 = ldsm_x4(sm, qaddr + kk * 256, scr)
            qf[kk * 4 + 0] = a0
            qf[kk * 4 + 1] = a1
            qf[kk * 4 + 2] = a2
            qf[kk * 4 + 3] = a3
        fence_async()                   # these generic reads of stage 0 before its bulk writes
        cuda.syncthreads()
        ntiles = (L + BN - 1) // BN
        mb = _mma.smem_base(mbs)
        if tid == 0:
            for i in range(STAGES):
                mbar_init(mbs, mb + 8 * i, 1)
            fence_mbar_init()
            for i in range(STAGES - 1):
                if i < ntiles:
                    issue(sm, mbs, kb, mb, k, v, kbase, vbase, i, i)

        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0)
        s = cuda.local.array(NS, float32)
        pr = cuda.local.array(PR, int32)
        st = cuda.local.array(6, float32)
        st[0] = NEG
        st[1] = NEG
        st[2] = float32(0)
        st[3] = float32(0)
        row0 = m0 + warp * 16 + g
        row1 = row0 + 8

        # ---- tile 0: S, softmax, P
        cuda.syncthreads()              # mbarriers initialised (and the simulator's copies done)
        mbar_wait(mbs, mb, 0)
        dk = DK_HI | (int64(kb) >> 4)
        wg_fence()
        for kk in range(KT):
            wg_qk(s, qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3], dk + kk * 16, kk, sm, scr)
        wg_commit()
        wg_wait0()
        softmax(s, st, mask, b, h, ms0, ms1, ms2, 0, row0, L, t, sl, es, scrf)
        for i in range(PR):
            pr[i] = pack_bf16(s[2 * i], s[2 * i + 1])

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
            wg_fence()
            dk = DK_HI | (int64(kb + ((j + 1) % STAGES) * SB) >> 4)
            for kk in range(KT):
                wg_qk(s, qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3],
                      dk + kk * 16, kk, sm, scr)
            wg_commit()
            dv = DV_HI | (int64(kb + (j % STAGES) * SB + TB) >> 4)
            for kk in range(PT):
                wg_pv(acc, pr[kk * 4], pr[kk * 4 + 1], pr[kk * 4 + 2], pr[kk * 4 + 3],
                      dv + kk * (2 * GB // 16), 1, sm, scr)
            wg_commit()
            wg_wait1()                  # S(j+1) done; P(j) V(j) may still run
            softmax(s, st, mask, b, h, ms0, ms1, ms2, (j + 1) * BN, row0, L, t, sl, es, scrf)
            wg_wait0()
            al0 = st[4]
            al1 = st[5]
            if al0 < float32(1):
                for nt in range(DT):
                    acc[nt * 4 + 0] *= al0
                    acc[nt * 4 + 1] *= al0
            if al1 < float32(1):
                for nt in range(DT):
                    acc[nt * 4 + 2] *= al1
                    acc[nt * 4 + 3] *= al1
            for i in range(PR):
                pr[i] = pack_bf16(s[2 * i], s[2 * i + 1])

        lr0 = quad_sum(st[2], scrf)
        lr1 = quad_sum(st[3], scrf)
        inv0 = float32(1) / lr0
        inv1 = float32(1) / lr1
        obase = b * os0 + h * (D // 2) + t
        if row0 < L:
            for nt in range(DT):
                o[obase + row0 * os1 + nt * 4] = pack_bf16(acc[nt * 4 + 0] * inv0, acc[nt * 4 + 1] * inv0)
        if row1 < L:
            for nt in range(DT):
                o[obase + row1 * os1 + nt * 4] = pack_bf16(acc[nt * 4 + 2] * inv1, acc[nt * 4 + 3] * inv1)

    return Kernel(kern, rows=BM, threads=NTH, tile_kv=BN, dyn_smem=STAGES * SB if DYN else 0)
