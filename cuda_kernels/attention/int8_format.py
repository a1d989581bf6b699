"""The int8 Q / K format of the 8-bit kernels, shared with qk_norm_rope, and the pre-pass.

Format: K smoothed by a per-(b, h) vector, the mean of the tokens ``kmean_index(L)`` (64 evenly
spaced; softmax is invariant to any per-head shift of the keys, so no correction is needed --
the mean only centres K's channel bias so int8 keeps its precision); int8 = round(x * 127 /
absmax), rows past L zero, L padded to Lp = a multiple of 64.  Two scale layouts:
  per block  (the pre-pass here): Q per 16 rows, K per 64 keys -- fp32 [B*H*Lp/16] / [B*H*Lp/64];
  per token  (``Quant8``, written by qk_norm_rope(quant8=True) in its own pass): fp32 [B*H*Lp].
The 8-bit op takes a ``Quant8`` as its ``q8`` argument (``usable_pack`` checks it fits the call);
without one it runs the pre-pass: ONE Numba launch over Q and K (``quantize_8bit_numba``;
``quantize_8bit`` is its torch reference), K8 optionally written straight in tile_kv's layout
for the wgmma kernel, or K alone when a pack supplies Q."""
import math

import torch
import torch.nn.functional as F

from .. import runtime as _rt
from .launch import cuda, int32, float32, _mma
from .launch import _BN, _words, _words_ok, _arr, _c_arr

KMEAN_SAMPLES = 64


def kmean_index(L):
    """Token indices of K's smoothing mean: 64 evenly spaced tokens (all of them when L <= 64)."""
    S = min(L, KMEAN_SAMPLES)
    return [(i * L) // S for i in range(S)]


class Quant8:
    """int8 Q/K + per-(token, head) scales made from exactly ``q`` and ``k`` (qk_norm_rope's
    quant8 pass).  q8/k8 int8 [B, H, Lp, D]; qs/ks fp32 [B*H*Lp]; kmean fp32 [B, H, D]; views: a
    dict the consumer caches its numba views in.  The buffers are scratch cached per shape and
    stream: the next call with that shape overwrites them (stream order keeps a consumer launched
    before that safe)."""
    __slots__ = ("q", "k", "q8", "k8", "qs", "ks", "kmean", "Lp", "views")

    def __init__(self, q, k, q8, k8, qs, ks, kmean, Lp, views):
        self.q, self.k, self.q8, self.k8, self.qs, self.ks = q, k, q8, k8, qs, ks
        self.kmean, self.Lp, self.views = kmean, Lp, views


def quant8_reference(q, k):
    """Torch reference of the per-token format (from the bf16 q, k): (q8, k8, qs, ks, Lp, kmean)
    laid out like Quant8 (pad rows zero, pad scales 1e-20/127)."""
    B, H, L, D = q.shape
    Lp = -(-L // 64) * 64
    kf = k.float()
    kmean = kf[:, :, kmean_index(L)].mean(dim=2)

    def qz(x):
        m = x.abs().amax(-1, keepdim=True).clamp_min(1e-20)
        y = torch.floor(x * (127.0 / m) + 0.5).clamp_(-127, 127).to(torch.int8)
        y = F.pad(y, (0, 0, 0, Lp - L))
        sc = F.pad(m[..., 0] / 127.0, (0, Lp - L), value=1e-20 / 127.0)
        return y, sc.reshape(-1)

    q8, qs = qz(q.float())
    k8, ks = qz(kf - kmean[:, :, None])
    return q8, k8, qs, ks, Lp, kmean


def usable_pack(pk, q, k, needs_k):
    """``pk`` when it is a Quant8 of exactly these q / k (the same tensor objects, matching
    shapes and device) and holds K8 if the kernel reads it (``needs_k``: the mma kernel), else
    None (the op then runs the pre-pass)."""
    if pk is None or pk.q is not q or pk.k is not k or (needs_k and pk.k8 is None):
        return None
    B, H, L, D = q.shape
    if k.shape != q.shape or tuple(pk.q8.shape) != (B, H, pk.Lp, D) or pk.Lp < L or pk.Lp % _BN \
            or pk.q8.device != q.device or pk.qs.numel() != B * H * pk.Lp:
        return None
    return pk


def operands(q, k, pk, tiled):
    """(q8, k8, q_scale, k_scale) numba views and Lp for the 8-bit kernels.  pk: a usable Quant8
    or None; tiled: the wgmma kernel's key-tile width (K8 in tile_kv's layout), else 0."""
    if pk is not None:  # qk_norm_rope already wrote int8 Q/K + per-token scales
        key = "attn8" if pk.k8 is not None else "attn8 q"
        arrs = pk.views.get(key)
        if arrs is None:  # numba views cached with the (scratch) buffers
            arrs = pk.views[key] = (_arr(pk.q8), None if pk.k8 is None else _arr(pk.k8), _c_arr(pk.qs),
                                    None if pk.ks is None else _c_arr(pk.ks))
        if not tiled:
            return arrs, pk.Lp
        # wgmma: the pack's Q8 + per-token Q scales; K8 tiled + per-64-key scales from here
        ent, Lk = _prepass(q, k, tiled=tiled, konly=True)
        assert Lk == pk.Lp, (Lk, pk.Lp)
        return (arrs[0], ent[7], arrs[2], ent[9]), pk.Lp
    ent, Lp = _prepass(q, k, tiled=tiled)       # K8 straight in the tile layout when tiled
    return (ent[6], ent[7], ent[8], ent[9]), Lp


def quantize_8bit(q, k, v=None, block_q=16, block_k=_BN):
    """Torch reference of the pre-pass: (q8, k8, q_scale, k_scale, Lp).  q8/k8 int8 [B,H,Lp,D]
    (zero rows past L), scales fp32 [B*H*Lp/16] / [B*H*Lp/64] (absmax/127, per block); K
    smoothed by the mean of the tokens ``kmean_index(L)`` (any per-head vector works: softmax
    is shift invariant per query row).  ``v`` is unused (the kernel reads the caller's bf16 V)."""
    B, H, L, D = q.shape
    Lp = -(-L // _BN) * _BN

    def quant(x, blk):
        x = F.pad(x, (0, 0, 0, Lp - L)).view(B, H, Lp // blk, blk, D)
        sc = x.abs().amax(dim=(3, 4), keepdim=True).clamp_min(1e-20) / 127.0
        xq = torch.round(x / sc).clamp_(-127, 127).to(torch.int8).view(B, H, Lp, D)
        return xq, sc.reshape(-1).contiguous()

    q8, qs = quant(q.float(), block_q)
    kf = k.float()
    idx = torch.tensor(kmean_index(L), device=k.device)
    k8, ks = quant(kf - kf[:, :, idx].mean(dim=2, keepdim=True), block_k)
    return q8, k8, qs, ks, Lp


# ---------------------------------------------------------------------- 8-bit quantization pre-pass
# ONE launch, grid (Lp/64, B*H, 2): z = 0 quantizes a 64-row tile of Q (4 scales, one per 16
# rows), z = 1 a 64-token tile of K (one scale) after subtracting the head's smoothing vector
# (mean of 64 evenly spaced tokens, recomputed by every K block in the same order -> bit-identical
# across blocks; ~16 KB of L2 reads per block).  128 threads; thread (i, tid) holds word
# w = tid % (D/2) of row 2i + tid // 64 (D = 128) in registers: Q / K are read from global
# memory exactly once (4-byte coalesced loads), absmax by a shared-memory tree (no shuffles,
# simulator-safe), int8 written as int16 pairs, rows >= L as zeros.
# Bytes (FLUX [1,24,4608,128]): read 2 x 28.3 MB, write 2 x 14.2 MB (+ scales) = 85 MB
# -> 23 us at 3.7 TB/s; plus one ~20 us launch from Python (scratch buffers and their numba views
# are cached per shape / stream, so a call costs 2 as_cuda_array + 1 launch).
_QNT = 128
_qkernels = {}


def _make_prepass(D, TK=False, KONLY=False):
    """TK: K8 is written as tile_kv's image (8-row x 16-byte core matrices, rows of Lt per head:
    the buffer's rows past Lp must be zero, see _scratch8_tiled) for the Hopper wgb kernels' bulk
    copies -- no separate relayout launch.  KONLY: K alone (grid z = 1; the fused FLUX path takes
    Q8 and its per-token scales from qk_norm_rope's pack)."""
    DW = D // 2
    NTH = _QNT
    RS = NTH // DW          # rows per register step
    NI = 64 * DW // NTH     # words per thread per tile
    IPG = NI // 4           # register steps per 16-row group
    NSPLIT = NTH // DW      # mean: threads per word
    NSAMP = KMEAN_SAMPLES
    RED = 4 * NTH
    PART = 2 * NTH
    NV = 2 * NI
    assert NTH % DW == 0 and NI % 4 == 0
    bf16_lo, bf16_hi = _mma.bf16_lo, _mma.bf16_hi
    ZERO = float32(0)

    @cuda.jit(device=True, inline=True)
    def q8(x, inv):
        y = int32(math.floor(x * inv + float32(0.5)))
        return min(max(y, -127), 127) & 0xFF

    @cuda.jit(fastmath=True)
    def kern(q, k, qs0, qs1, qs2, ks0, ks1, ks2, q8out, k8out, qsc, ksc, L, Lp, H, Lt):
        red = cuda.shared.array(RED, float32)
        part = cuda.shared.array(PART, float32)
        vals = cuda.local.array(NV, float32)
        tid = cuda.threadIdx.x
        w = tid % DW
        hs = tid // DW
        bh = cuda.blockIdx.y
        b = bh // H
        h = bh - b * H
        blk = cuda.blockIdx.x
        r0 = blk * 64
        isk = 1 if KONLY else cuda.blockIdx.z
        if isk:
            x = k
            out = k8out
            base = b * ks0 + h * ks1
            s2 = ks2
        else:
            x = q
            out = q8out
            base = b * qs0 + h * qs1
            s2 = qs2
        c0 = ZERO
        c1 = ZERO
        if isk:  # smoothing vector: mean of NS evenly spaced tokens (same order in every block)
            S = min(L, NSAMP)
            a0 = ZERO
            a1 = ZERO
            # constant trip count + clamped address + select: the loads issue back to back
            # (a data-dependent loop / a branch around each load serializes their latencies)
            for ii in range(NSAMP // NSPLIT):
                i = hs + ii * NSPLIT
                ok = i < S
                u = x[base + ((min(i, S - 1) * L) // S) * s2 + w]
                a0 += bf16_lo(u) if ok else ZERO
                a1 += bf16_hi(u) if ok else ZERO
            part[2 * tid] = a0
            part[2 * tid + 1] = a1
            cuda.syncthreads()
            for sp in range(NSPLIT):
                c0 += part[2 * (sp * DW + w)]
                c1 += part[2 * (sp * DW + w) + 1]
            c0 = c0 / float32(S)
            c1 = c1 / float32(S)
        m0 = ZERO
        m1 = ZERO
        m2 = ZERO
        m3 = ZERO
        for i in range(NI):
            row = r0 + RS * i + hs
            ok = row < L
            u = x[base + min(row, L - 1) * s2 + w]   # always a valid address: no branch around the load
            lo = bf16_lo(u) - c0 if ok else ZERO
            hi = bf16_hi(u) - c1 if ok else ZERO
            vals[2 * i] = lo
            vals[2 * i + 1] = hi
            a = max(abs(lo), abs(hi))
            gq = i // IPG
            if gq == 0:
                m0 = max(m0, a)
            elif gq == 1:
                m1 = max(m1, a)
            elif gq == 2:
                m2 = max(m2, a)
            else:
                m3 = max(m3, a)
        red[tid] = m0
        red[NTH + tid] = m1
        red[2 * NTH + tid] = m2
        red[3 * NTH + tid] = m3
        cuda.syncthreads()
        st = NTH // 2
        while st > 0:
            if tid < st:
                for gg in range(4):
                    red[gg * NTH + tid] = max(red[gg * NTH + tid], red[gg * NTH + tid + st])
            cuda.syncthreads()
            st //= 2
        m0 = red[0]
        m1 = red[NTH]
        m2 = red[2 * NTH]
        m3 = red[3 * NTH]
        if isk:
            m0 = max(max(m0, m1), max(m2, m3))
            m1 = m0
            m2 = m0
            m3 = m0
        m0 = max(m0, float32(1e-20))
        m1 = max(m1, float32(1e-20))
        m2 = max(m2, float32(1e-20))
        m3 = max(m3, float32(1e-20))
        if tid == 0:
            if isk:
                ksc[bh * (Lp // 64) + blk] = m0 / float32(127)
            else:
                qb = bh * (Lp // 16) + blk * 4
                qsc[qb] = m0 / float32(127)
                qsc[qb + 1] = m1 / float32(127)
                qsc[qb + 2] = m2 / float32(127)
                qsc[qb + 3] = m3 / float32(127)
        i0 = float32(127) / m0
        i1 = float32(127) / m1
        i2 = float32(127) / m2
        i3 = float32(127) / m3
        ob = bh * Lp * DW + r0 * DW + w
        tb = bh * Lt * DW + (w // 8) * 64 + w % 8
        for i in range(NI):
            gq = i // IPG
            inv = i0
            if gq == 1:
                inv = i1
            elif gq == 2:
                inv = i2
            elif gq == 3:
                inv = i3
            wv = q8(vals[2 * i], inv) | (q8(vals[2 * i + 1], inv) << 8)
            wv = wv - ((wv >> 15) << 16)   # as a signed int16
            if TK and isk:
                row = r0 + RS * i + hs
                out[tb + (row // 8) * (DW * 8) + (row % 8) * 8] = wv
            else:
                out[ob + (RS * i + hs) * DW] = wv

    return kern


def _qkernel(D, TK=False, KONLY=False):
    k = _qkernels.get((D, TK, KONLY))
    if k is None:
        k = _qkernels[(D, TK, KONLY)] = _make_prepass(D, TK, KONLY)
    return k


_scratch = {}


def _scratch8(B, H, Lp, D, dev):
    """int8 Q/K + scale buffers and their numba views, cached per shape and stream
    (runtime.stream_scratch)."""
    def make():
        q8 = torch.empty((B, H, Lp, D), dtype=torch.int8, device=dev)
        k8 = torch.empty((B, H, Lp, D), dtype=torch.int8, device=dev)
        qs = torch.empty(B * H * Lp // 16, dtype=torch.float32, device=dev)
        ks = torch.empty(B * H * Lp // _BN, dtype=torch.float32, device=dev)
        v16 = lambda t: _c_arr(t.reshape(-1).view(torch.int16))  # noqa: E731
        return (q8, k8, qs, ks, v16(q8), v16(k8), _arr(q8), _arr(k8), _c_arr(qs), _c_arr(ks))
    return _rt.stream_scratch(_scratch, (B, H, Lp, D, str(dev)), make)


def _scratch8_tiled(B, H, Lp, Lt, D, dev):
    """The tiled K8 buffer (int8 [B, H, Lt, D], zero-filled once: the pre-pass never writes its
    rows past Lp, part of the key) and its 16-bit / word numba views, cached like _scratch8."""
    def make():
        k8t = torch.zeros((B, H, Lt, D), dtype=torch.int8, device=dev)
        return (k8t, _c_arr(k8t.reshape(-1).view(torch.int16)), _arr(k8t))
    return _rt.stream_scratch(_scratch, ("tiled", B, H, Lp, Lt, D, str(dev)), make)


def _prepass(q, k, qw=None, kw=None, tiled=0, konly=False):
    """tiled: 0, or the wgb kernels' key-tile width -> K8 written as its tile image into
    _scratch8_tiled (returned as ent[1] / ent[5] / ent[7] of a copy of the scratch entry).
    konly: quantize K alone (ent's Q8 / Q-scale buffers are left as they were)."""
    B, H, L, D = q.shape
    Lp = -(-L // _BN) * _BN
    ent = _scratch8(B, H, Lp, D, q.device)
    Lt = Lp
    if tiled:
        Lt = -(-L // tiled) * tiled
        t = _scratch8_tiled(B, H, Lp, Lt, D, q.device)
        ent = (ent[0], t[0], ent[2], ent[3], ent[4], t[1], ent[6], t[2], ent[8], ent[9])
    qw = _words(q) if qw is None else qw
    kw = _words(k) if kw is None else kw
    _qkernel(D, bool(tiled), bool(konly))[(Lp // 64, B * H, 1 if konly else 2), _QNT, _rt.stream()](
        qw, kw, q.stride(0) // 2, q.stride(1) // 2, q.stride(2) // 2,
        k.stride(0) // 2, k.stride(1) // 2, k.stride(2) // 2, ent[4], ent[5], ent[8], ent[9], L, Lp, H, Lt)
    return ent, Lp


def quantize_8bit_numba(q, k, v=None):
    """Same outputs as quantize_8bit() (up to rounding ties / float summation order) from ONE
    numba launch: (q8, k8, q_scale, k_scale, Lp).  The tensors are cached scratch buffers that the
    next call with the same shape overwrites."""
    if any(not _words_ok(x) for x in (q, k)):
        q, k = q.contiguous(), k.contiguous()
    ent, Lp = _prepass(q, k)
    return ent[0], ent[1], ent[2], ent[3], Lp
