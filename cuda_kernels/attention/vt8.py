"""s8 V for the integer P V of the 8-bit wgmma kernel (Int8Config pv="u8s8"; issue #38).

V per (b, h, channel): v_scale = absmax over the L tokens / 127, v8 = rni(v * (127 / absmax))
(round half to even, +-127): int8_pv_ref.quantize_v, exactly.  The kernel reads one buffer per head,
int32 words [B, H, W] (W = NT * BN * D / 4 + D):
  NT tiles of BN keys, each ``int8_pv_ref.vt8_image`` of V^T (K-major core matrices of 8 channels x
  16 keys for wgmma's s8 B operand: byte (d, key) of a tile at (d // 8) * BN * 8 + (key // 16) * 128 +
  (d % 8) * 16 + key % 16) with the 16 keys of each chunk in ``VT8_PERM`` order, keys past L zero;
  then the D channel scales (fp32 bits) -- in the same buffer, so the kernel keeps the bf16-P V
  kernels' argument list (its scales sit at word ntiles * BN * D / 4 of the head).
VT8_PERM: key-position p of every 16 holds key VT8_PERM[p].  The u8 P A fragment of wgmma k32 wants,
for thread (g, t), key positions 4t .. 4t + 3 (and 16 + ..) of its rows; S's accumulator gives it keys
2t, 2t + 1 of each 8-key n-tile -- packing n-tiles 2i, 2i + 1 into one register and permuting V's keys
the same way makes S's layout the A fragment, with no shuffle (the product sums over the keys).

``pack_vt8`` here: a torch absmax + one Numba launch (tile per block).  Where it should live: in
qk_norm_rope's "qv" pass, which already writes V's bf16 tile image in its own pass over qkv -- but the
per-channel absmax spans the whole sequence, so a pack there needs the absmax first (a second pass
or per-tile scales, which int8_pv_ref measured at a similar error but a multiply per element and group
in the loop).

Bytes ([1,24,4608,128]): read V 28.3 MB (twice: absmax, then the pack), write 14.2 MB -> ~19 us at
3.7 TB/s.
"""
import torch

from .. import runtime as _rt
from .launch import cuda, int32, float32, _mma
from .launch import _words, _f32_1d, _c_arr
from .int8_pv_ref import quantize_v, vt8_image

VT8_PERM = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)


def head_words(L, BN, D):
    """int32 words per head of the packed buffer: the tiles' image + D scales."""
    return -(-L // BN) * BN * D // 4 + D


def pack_vt8_reference(v, BN):
    """Torch reference of ``pack_vt8``: (buf int32 [B, H, head_words], v8 int8 [B, H, L, D],
    v_scale fp32 [B, H, D])."""
    B, H, L, D = v.shape
    v8, vs = quantize_v(v)
    NT = -(-L // BN)
    x = torch.zeros((B, H, NT * BN, D), dtype=torch.int8, device=v.device)
    x[:, :, :L] = v8
    perm = torch.tensor(VT8_PERM, device=v.device)
    x = x.view(B, H, NT * BN // 16, 16, D)[:, :, :, perm].reshape(B, H, NT * BN, D)
    img = vt8_image(x, keys=BN).reshape(B, H, NT * BN * D).view(torch.int32)
    buf = torch.cat([img, vs.float().contiguous().view(torch.int32)], dim=2)
    return buf.contiguous(), v8, vs


_kerns = {}


def _pack_kernel(BN, D):
    """One block per (tile, b * h): the tile's BN x D values quantized into shared memory (row-major
    bytes; coalesced reads of bf16 pairs), then written as the image's 16-byte chunks (4 words, a
    warp's stores contiguous); block x = 0 also writes the head's D scales."""
    kern = _kerns.get((BN, D))
    if kern is not None:
        return kern
    from numba import uint8
    from ..device import wrap_i32
    NW = BN * D // 2
    NC = BN * D // 16
    KC = BN // 16
    HD = D // 2
    SMB = BN * D
    TW = BN * D // 4
    bf16_lo, bf16_hi, fadd_rn, f32_bits = _mma.bf16_lo, _mma.bf16_hi, _mma.fadd_rn, _mma.f32_bits
    M = float32(12582912.0)             # 1.5 * 2^23: x + M rounds x to an integer, half to even
    MB = int32(0x4B400000)
    P = VT8_PERM

    @cuda.jit(device=True, inline=True)
    def q8(x):
        """rni(x) clamped to +-127, as a byte (|x| <= 127 here, up to the scale's rounding)."""
        r = f32_bits(fadd_rn(x, M)) - MB
        return min(max(r, -127), 127) & 0xFF

    @cuda.jit(fastmath=True)
    def kern(v, inv, vsc, buf, vs0, vs1, vs2, W, L, H):
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
                e0 = q8(bf16_lo(w) * inv[bh * D + 2 * c])
                e1 = q8(bf16_hi(w) * inv[bh * D + 2 * c + 1])
            sm[key * D + 2 * c] = e0
            sm[key * D + 2 * c + 1] = e1
        cuda.syncthreads()
        base = bh * W + nt * TW
        for ch in range(tid, NC, cuda.blockDim.x):     # chunk = (d group, key chunk, d in group)
            d8 = ch % 8
            rest = ch // 8
            kc = rest % KC
            d = (rest // KC) * 8 + d8
            r = kc * 16 * D + d
            for j in range(4):          # word j: key positions 4j .. 4j + 3
                w = (int32(sm[r + P[4 * j] * D]) | (int32(sm[r + P[4 * j + 1] * D]) << 8)
                     | (int32(sm[r + P[4 * j + 2] * D]) << 16) | (int32(sm[r + P[4 * j + 3] * D]) << 24))
                buf[base + ch * 4 + j] = wrap_i32(w)
        if nt == 0:
            for d in range(tid, D, cuda.blockDim.x):
                buf[bh * W + cuda.gridDim.x * TW + d] = f32_bits(vsc[bh * D + d])

    _kerns[(BN, D)] = kern
    return kern


def pack_vt8(v, BN):
    """``pack_vt8_reference``'s buffer (int32 [B, H, head_words]) from bf16 v [B, H, L, D] (last dim
    contiguous): per-channel absmax in torch, then one Numba launch."""
    B, H, L, D = v.shape
    if not (v.stride(-1) == 1 and all(st % 2 == 0 for st in v.stride()[:-1]) and v.storage_offset() % 2 == 0):
        v = v.contiguous()
    m = v.abs().amax(dim=2).float().clamp_min(1e-20)        # [B, H, D] (bf16 absmax is exact)
    inv = (127.0 / m).contiguous()
    vsc = (m / 127.0).contiguous()
    NT = -(-L // BN)
    W = head_words(L, BN, D)
    buf = torch.empty((B, H, W), dtype=torch.int32, device=v.device)
    _pack_kernel(BN, D)[(NT, B * H), 256, _rt.stream()](
        _words(v), _f32_1d(inv), _f32_1d(vsc), _c_arr(buf.view(-1)), v.stride(0) // 2, v.stride(1) // 2,
        v.stride(2) // 2, W, L, H)
    return buf
