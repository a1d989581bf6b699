"""K / V tile layout of the wgmma kernels: ``tile_kv`` re-lays a [B, H, L, D] tensor out as the byte
image of the kernels' shared-memory tiles; ``_make_issue`` moves one tile with bulk copies."""
import torch

from .. import runtime as _rt
from .launch import cuda, int32, int64, _mma
from .launch import _dwords


def _make_issue(TBK, TBV):
    """One thread's tile move for the bulk-copy wgmma kernels: K tile t (TBK bytes) and V tile t
    (TBV bytes) of the tiled buffers -> ring stage ``stage`` (stride TBK + TBV), counted on the
    stage's mbarrier (expect-tx arrive first on the GPU; after the copies in the simulator, whose
    copies are synchronous and whose arrive completes the phase)."""
    SB = TBK + TBV
    ARRIVE_LAST = _mma.BULK_ARRIVE_LAST
    mbar_expect_tx, bulk_g2s = _mma.mbar_expect_tx, _mma.bulk_g2s

    @cuda.jit(device=True, inline=True)
    def issue(sm, mbs, kb, mb, k, v, kbase, vbase, t, stage):
        if not ARRIVE_LAST:
            mbar_expect_tx(mbs, mb + 8 * stage, SB)
        bulk_g2s(sm, kb + stage * SB, k, kbase + t * (TBK // 4), TBK, mb + 8 * stage)
        bulk_g2s(sm, kb + stage * SB + TBK, v, vbase + t * (TBV // 4), TBV, mb + 8 * stage)
        if ARRIVE_LAST:
            mbar_expect_tx(mbs, mb + 8 * stage, SB)

    return issue


def _make_ring(TBK, TBV, STAGES, RELEASE=0):
    """(issue, start) of a STAGES-deep bulk-copy ring: ``start(sm, mbs, kb, mb, k, v, kbase, vbase,
    ntiles)`` (one thread) initialises the stages' "full" mbarriers (and RELEASE > 0: their "empty"
    ones, at byte offset 8 * STAGES, completed by RELEASE arrivals) and issues tiles 0 .. S-2."""
    issue = _make_issue(TBK, TBV)
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


def tile_kv_reference(x, BN):
    """[B, H, L, D] (last dim contiguous) -> [B, H, NT * BN, D] view of a new buffer in which every
    BN-row tile is the byte image of its shared-memory layout in the wgmma kernels: 8-row x
    16-byte core matrices ordered (row group, 16-byte column chunk, row, 8 values), rows past L
    zero.  One bulk copy then moves a whole tile (the wgmma kernels: bf16_wgmma, int8_wgmma).
    (The layout does not depend on BN beyond the zero padding to NT * BN rows.)  torch version:
    two permuting copies, ~1.5 TB/s on the H200; ``tile_kv`` is the one-launch Numba kernel."""
    B, H, L, D = x.shape
    NT = -(-L // BN)
    out = torch.empty((B, H, NT, BN // 8, D // 8, 8, 8), dtype=x.dtype, device=x.device)
    full = L // BN
    if full:
        src = x[:, :, :full * BN].unflatten(2, (full, BN // 8, 8)).unflatten(-1, (D // 8, 8))
        out[:, :, :full].copy_(src.permute(0, 1, 2, 3, 5, 4, 6))
    if full < NT:
        last = x.new_zeros(B, H, BN, D)
        last[:, :, :L - full * BN] = x[:, :, full * BN:]
        out[:, :, full].copy_(last.view(B, H, BN // 8, 8, D // 8, 8).permute(0, 1, 2, 4, 3, 5))
    return out.view(B, H, NT * BN, D)


_tile_kern = None


def _tile_kernel():
    """One launch re-lays out K and V (grid y = 2): a thread moves 16-byte chunks as two 8-byte
    words; lanes walk the 8 rows of a core matrix first, then its 16-byte columns, so a warp
    reads 8 rows x 64 bytes and writes 512 contiguous bytes."""
    global _tile_kern
    if _tile_kern is None:
        @cuda.jit(fastmath=True)
        def kern(k, v, kt, vt, ks0, ks1, ks2, vs0, vs1, vs2, L, H, CH, G, total):
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


def tile_kv(k, v, BN):
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
        v.stride(2) // 4, L, H, CH, G, total)
    return outs[0], (outs[1] if len(outs) > 1 else None)


# ----------------------------------------------------------------------------- e4m3 V^T tiles
# k-position p of every 16 in a tile_v8t row holds key V8_PERM[p] of those 16 (fragments.make_wg_pv8)
V8_PERM = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)


def v8_scales(v):
    """Per-(b, h, channel) scales of the e4m3 V: (inv [B, H, D] = 448 / amax, scale = amax / 448),
    fp32, amax over the sequence floored at fp8_format.AMAX_FLOOR (a channel of zeros stays finite).
    Per channel, not per token: the channel is the P V product's output column, so its factor is
    applied once at the store; a per-key factor would sit inside the sum over keys."""
    from ..fp8_format import AMAX_FLOOR, E4M3_MAX
    amax = v.float().abs().amax(dim=2).clamp_min(AMAX_FLOOR)
    c = torch.full_like(amax, E4M3_MAX)
    return c / amax, amax / c


def tile_v8t_reference(v, BN, inv):
    """e4m3(v x inv) laid out as the 8-bit wgmma kernel's V tiles: [B, H, NT * BN * D] uint8, per
    BN-key tile the K-major image of V^T (core matrices 8 channels x 16 keys, ordered (channel
    group, 16-key chunk, channel, key)), the 16 keys of a chunk in V8_PERM order, keys past L zero."""
    from ..fp8_format import E4M3_MAX, FP8
    B, H, L, D = v.shape
    NT = -(-L // BN)
    x = (v.float() * inv[:, :, None, :]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8).view(torch.uint8)
    xp = torch.zeros((B, H, NT * BN, D), dtype=torch.uint8, device=v.device)
    xp[:, :, :L] = x
    perm = torch.tensor(V8_PERM, device=v.device)
    xp = xp.view(B, H, NT, BN // 16, 16, D)[:, :, :, :, perm]
    img = xp.view(B, H, NT, BN // 16, 16, D // 8, 8).permute(0, 1, 2, 5, 3, 6, 4)
    return img.contiguous().view(B, H, NT * BN * D)


_v8_kerns = {}


def _v8_kernel(BN, D):
    """One block per (tile, b * h): the tile's BN x D values scaled and converted to e4m3 into
    shared memory (row-major, coalesced 4-byte reads of bf16 pairs), then written as 16-byte
    chunks of the image (four 32-bit words, contiguous per warp)."""
    kern = _v8_kerns.get((BN, D))
    if kern is not None:
        return kern
    from numba import uint8
    from ..fp8_format import e4m3_1
    from ..intrinsics import wrap_i32
    NW = BN * D // 2
    NC = BN * D // 16
    KC = BN // 16
    HD = D // 2
    SMB = BN * D                # shared bytes (a plain constant: numba needs a literal shape)
    bf16_lo, bf16_hi = _mma.bf16_lo, _mma.bf16_hi

    @cuda.jit(fastmath=True)
    def kern(v, inv, img, vs0, vs1, vs2, is0, L, H):
        sm = cuda.shared.array(SMB, uint8)
        tid = cuda.threadIdx.x
        nt = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        b = bh // H
        h = bh - b * H
        for i in range(tid, NW, cuda.blockDim.x):
            key = i // HD
            c = i - key * HD
            row = nt * BN + key
            e0 = 0
            e1 = 0
            if row < L:
                w = v[b * vs0 + h * vs1 + row * vs2 + c]
                e0 = e4m3_1(bf16_lo(w) * inv[bh * D + 2 * c])
                e1 = e4m3_1(bf16_hi(w) * inv[bh * D + 2 * c + 1])
            sm[key * D + 2 * c] = e0
            sm[key * D + 2 * c + 1] = e1
        cuda.syncthreads()
        base = bh * is0 + nt * (BN * D // 4)
        for ch in range(tid, NC, cuda.blockDim.x):
            d8 = ch % 8
            rest = ch // 8
            kc = rest % KC
            d = (rest // KC) * 8 + d8
            r = kc * 16 * D + d
            for j in range(4):          # word j: k-positions 4j..4j+3 = keys 2j, 2j+1, 8+2j, 9+2j
                w = (int32(sm[r + (2 * j) * D]) | (int32(sm[r + (2 * j + 1) * D]) << 8)
                     | (int32(sm[r + (8 + 2 * j) * D]) << 16) | (int32(sm[r + (9 + 2 * j) * D]) << 24))
                img[base + ch * 4 + j] = wrap_i32(w)

    _v8_kerns[(BN, D)] = kern
    return kern


def tile_v8t(v, BN, inv):
    """``tile_v8t_reference`` in one Numba launch (v bf16 [B, H, L, D], last dim contiguous; inv
    fp32 [B, H, D] contiguous)."""
    from .launch import _words, _f32_1d
    B, H, L, D = v.shape
    NT = -(-L // BN)
    if not (v.stride(-1) == 1 and all(st % 2 == 0 for st in v.stride()[:-1]) and v.storage_offset() % 2 == 0):
        v = v.contiguous()
    img = torch.empty((B, H, NT * BN * D), dtype=torch.uint8, device=v.device)
    inv = inv.contiguous()
    _v8_kernel(BN, D)[(NT, B * H), 256, _rt.stream()](
        _words(v), _f32_1d(inv), _words(img.view(torch.int32)), v.stride(0) // 2, v.stride(1) // 2, v.stride(2) // 2,
        NT * BN * D // 4, L, H)
    return img
