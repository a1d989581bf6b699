"""K / V tile layout of the wgmma kernels: ``tile_kv`` re-lays a [B, H, L, D] tensor out as the byte
image of the kernels' shared-memory tiles; ``_make_issue`` moves one tile with bulk copies."""
import torch

from .. import runtime as _rt
from .launch import cuda, int64, _mma
from .launch import _dwords


def _make_issue(TBK, TBV, SB=0):
    """One thread's tile move for the bulk-copy wgmma kernels: K tile t (TBK bytes) and V tile t
    (TBV bytes) of the tiled buffers -> ring stage ``stage`` (stride SB, default TBK + TBV),
    counted on the stage's mbarrier (expect-tx arrive first on the GPU; after the copies in the
    simulator, whose copies are synchronous and whose arrive completes the phase)."""
    NB = TBK + TBV
    SB = SB or NB
    ARRIVE_LAST = _mma.BULK_ARRIVE_LAST
    mbar_expect_tx, bulk_g2s = _mma.mbar_expect_tx, _mma.bulk_g2s

    @cuda.jit(device=True, inline=True)
    def issue(sm, mbs, kb, mb, k, v, kbase, vbase, t, stage):
        if not ARRIVE_LAST:
            mbar_expect_tx(mbs, mb + 8 * stage, NB)
        bulk_g2s(sm, kb + stage * SB, k, kbase + t * (TBK // 4), TBK, mb + 8 * stage)
        bulk_g2s(sm, kb + stage * SB + TBK, v, vbase + t * (TBV // 4), TBV, mb + 8 * stage)
        if ARRIVE_LAST:
            mbar_expect_tx(mbs, mb + 8 * stage, NB)

    return issue


def _make_ring(TBK, TBV, STAGES, RELEASE=0, SB=0):
    """(issue, start) of a STAGES-deep bulk-copy ring (stage stride SB, default TBK + TBV):
    ``start(sm, mbs, kb, mb, k, v, kbase, vbase, ntiles)`` (one thread) initialises the stages'
    "full" mbarriers (and RELEASE > 0: their "empty" ones, at byte offset 8 * STAGES, completed by
    RELEASE arrivals) and issues tiles 0 .. S-2."""
    issue = _make_issue(TBK, TBV, SB)
    EMPTY = 8 * STAGES
    mbar_init, fence_mbar_init = _mma.mbar_init, _mma.fence_mbar_init

    @cuda.jit(device=True, inline=True)
    def start(sm, mbs, kb, mb, k, v, kbase, vbase, ntiles):
        for i in range(STAGES):
            mbar_init(mbs, mb + 8 * i, 1)
            if RELEASE:
                mbar_init(mbs, mb + EMPTY + 8 * i, RELEASE)
        fence_mbar_init()
        for i in range(STAGES - 1):
            if i < ntiles:
                issue(sm, mbs, kb, mb, k, v, kbase, vbase, i, i)

    return issue, start


def tile_kv_reference(x, BN, chunk_major=False):
    """[B, H, L, D] (last dim contiguous) -> [B, H, NT * BN, D] view of a new buffer in which every
    BN-row tile is the byte image of its shared-memory layout in the wgmma kernels: 8-row x
    16-byte core matrices ordered (row group, 16-byte column chunk, row, 8 values), rows past L
    zero.  One bulk copy then moves a whole tile (the wgmma kernels: bf16_wgmma, int8_wgmma).
    chunk_major: the core matrices of a tile ordered (column chunk, row group, row, 8 values)
    instead -- int8_wgmma's V, whose P V reads a 17th column chunk (ones) placed right after the
    tile.  (The group-major layout does not depend on BN beyond the zero padding to NT * BN rows.)
    torch version: two permuting copies, ~1.5 TB/s on the H200; ``tile_kv`` is the one-launch
    Numba kernel."""
    B, H, L, D = x.shape
    NT = -(-L // BN)
    shape = (B, H, NT, D // 8, BN // 8, 8, 8) if chunk_major else (B, H, NT, BN // 8, D // 8, 8, 8)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    perm = (0, 1, 2, 5, 3, 4, 6) if chunk_major else (0, 1, 2, 3, 5, 4, 6)
    full = L // BN
    if full:
        src = x[:, :, :full * BN].unflatten(2, (full, BN // 8, 8)).unflatten(-1, (D // 8, 8))
        out[:, :, :full].copy_(src.permute(*perm))
    if full < NT:
        last = x.new_zeros(B, H, 1, BN, D)
        last[:, :, 0, :L - full * BN] = x[:, :, full * BN:]
        out[:, :, full:].copy_(last.unflatten(3, (BN // 8, 8)).unflatten(-1, (D // 8, 8)).permute(*perm))
    return out.view(B, H, NT * BN, D)


_tile_kern = None


def _tile_kernel():
    """One launch re-lays out K and V (grid y = 2): a thread moves 16-byte chunks as two 8-byte
    words; lanes walk the 8 rows of a core matrix first, then its 16-byte columns, so a warp
    reads 8 rows x 64 bytes and writes 512 contiguous bytes (GPT > 0, chunk-major tiles of GPT row
    groups: 4 runs of 128 bytes)."""
    global _tile_kern
    if _tile_kern is None:
        @cuda.jit(fastmath=True)
        def kern(k, v, kt, vt, ks0, ks1, ks2, vs0, vs1, vs2, L, H, CH, G, total, GPT):
            src = k if cuda.blockIdx.y == 0 else v
            dst = kt if cuda.blockIdx.y == 0 else vt
            s0 = ks0 if cuda.blockIdx.y == 0 else vs0
            s1 = ks1 if cuda.blockIdx.y == 0 else vs1
            s2 = ks2 if cuda.blockIdx.y == 0 else vs2
            c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
            step = cuda.gridDim.x * cuda.blockDim.x
            while c < total:               # c = ((bh * G + grp) * CH + cc) * 8 + r8
                r8 = c % 8
                rest = c // 8
                cc = rest % CH
                rest //= CH
                grp = rest % G
                bh = rest // G
                row = grp * 8 + r8
                b = bh // H
                o = c * 2                  # 8-byte words: the destination is the chunk order
                if GPT:                    # chunk-major tiles: (tile, chunk, group in tile, row)
                    tl = grp // GPT
                    o = ((((bh * (G // GPT) + tl) * CH + cc) * GPT + grp - tl * GPT) * 8 + r8) * 2
                if row < L:
                    i = (b * s0 + (bh - b * H) * s1 + row * s2) + cc * 2
                    dst[o] = src[i]
                    dst[o + 1] = src[i + 1]
                else:
                    dst[o] = int64(0)
                    dst[o + 1] = int64(0)
                c += step

        _tile_kern = kern
    return _tile_kern


_stand_ins = {}


def _stand_in(dev):
    """A 4-element 16-bit buffer per device (tile_kv's unused second output)."""
    t = _stand_ins.get(str(dev))
    if t is None:
        t = _stand_ins[str(dev)] = torch.zeros(4, dtype=torch.int16, device=dev)
    return t


def tile_kv(k, v, BN, chunk_major=False):
    """``tile_kv_reference`` of k and v (same shape; v may be None) in one Numba launch -> (kt, vt)."""
    B, H, L, D = k.shape
    NT = -(-L // BN)
    xs = [k] if v is None else [k, v]
    outs = [torch.empty((B, H, NT * BN, D), dtype=k.dtype, device=k.device) for _ in xs]
    xs = [x if x.stride(-1) == 1 and all(st % 4 == 0 for st in x.stride()[:-1]) and x.storage_offset() % 4 == 0
          else x.contiguous() for x in xs]
    k, v = xs[0], xs[-1]
    CH = D // 8
    G = NT * BN // 8
    total = B * H * G * CH * 8
    grid = (_rt.grid_for(total, 256, 8), len(xs))
    # without v: a stand-in second output (grid y = 1 never writes it; the simulator copies every
    # array argument back after the launch, so passing outs[0] twice would undo its writes)
    second = outs[1] if len(outs) > 1 else _stand_in(k.device)
    _tile_kernel()[grid, 256, _rt.stream()](
        _dwords(k), _dwords(v), _dwords(outs[0]), _dwords(second),
        k.stride(0) // 4, k.stride(1) // 4, k.stride(2) // 4, v.stride(0) // 4, v.stride(1) // 4,
        v.stride(2) // 4, L, H, CH, G, total, BN // 8 if chunk_major else 0)
    return outs[0], (outs[1] if len(outs) > 1 else None)
