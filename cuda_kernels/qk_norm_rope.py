"""q/k RMSNorm (learned scale, eps 1e-6) + RoPE, written into the attention layout.

``qk_norm_rope(parts, pe, num_heads, eps=1e-6) -> (q, k, v)``
  parts: list of ``(qkv, q_scale, k_scale)``, one per stream in sequence order (double block:
         text then image; single block: one part).  ``qkv`` is [B, L_i, 3*H*D] -- it may be a
         row-strided view (the single block's linear1 output slice); q_scale/k_scale are [D].
  pe:    [B or 1, 1, sum(L_i), D/2, 2, 2] float32 rotation matrices (ComfyUI's EmbedND), or None.
  out:   q, k, v as [B, H, sum(L_i), D] tensors in qkv's dtype (the numba backend returns views in
         [B, L, H, D] memory order, the torch reference contiguous ones); q and k normalised
         and rotated, v copied.  This replaces view/permute/RMSNorm/cat/RoPE of stock ComfyUI.

Numba backend ("numba", bf16 qkv, 1 or 2 parts, D in {4, 8, 16, 32, 64, 128}, every qkv row
8-byte aligned -- else declined by check): grid (tokens, B, head chunks), blocks of <= 128
threads (launch bounds (128, 8): <= 64 registers, 8+ blocks = 48+ KB of loads in flight per SM).
A group of G = D/8 lanes (D/4 when rows are only 8-byte aligned) per head; each lane owns 16
bytes (8 bf16) of the head vector and issues its q, k and v loads together (v is stored straight
back), sum of squares by a G-lane shuffle, fp32 math, one RNE rounding (the stock path rounds
after the norm, after the scale and after RoPE; differences stay within ~1 bf16 ulp).  The
lane's RoPE matrices (16 fp32 = 4 x 16-byte loads) and scales come from L1 (pe: 1 KB per token,
read from DRAM once; 3 blocks per token hit L2).  All 16-byte accesses are single
ld/st.global.v2.u64; no integer division in the kernel.  q, k, v come back as views of one
[3, B, H, L, D] allocation.

Bytes per call at FLUX 1024^2 (H*D = 3072, B = 1, 4608 tokens), floor at 3.7 TB/s:
  read qkv 84.9 MB + pe 4.7 MB, write q, k, v 84.9 MB = 174.6 MB -> 47.2 us
  (same for the double block: txt 512 + img 4096 tokens; stock moves ~3-4x that through
  view/permute/rms_norm/cat/rope copies.)
"""
import functools

import numpy as np
import torch

from . import intrinsics as ik
# module globals (not closure cells): the simulator swaps `cuda` per thread, and the on-disk
# cache key then only hashes the factory's int constants
from .intrinsics import cuda, float32, int64, unpack_w, pack4, unpack_f32x2, group_sum, rsqrt, ld2, st2  # noqa: F401
from .registry import registry

OP = "qk_norm_rope"


def rms_norm(x, scale, eps):
    return torch.nn.functional.rms_norm(x, scale.shape, weight=scale.to(device=x.device, dtype=x.dtype), eps=eps)


def apply_rope1(x, pe):
    """ComfyUI's torch RoPE (fp32 math, cast back); comfy-kitchen computes the same function."""
    x_ = x.to(dtype=pe.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    x_out = pe[..., 0] * x_[..., 0]
    x_out.addcmul_(pe[..., 1], x_[..., 1])
    return x_out.reshape(*x.shape).type_as(x)


def reference(parts, pe, num_heads: int, eps: float = 1e-6):
    qs, ks, vs = [], [], []
    for qkv, q_scale, k_scale in parts:
        B, L, _ = qkv.shape
        q, k, v = qkv.view(B, L, 3, num_heads, -1).permute(2, 0, 3, 1, 4) if qkv.is_contiguous() else \
            qkv.reshape(B, L, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
        qs.append(rms_norm(q, q_scale, eps).to(v))
        ks.append(rms_norm(k, k_scale, eps).to(v))
        vs.append(v)
    q = torch.cat(qs, dim=2) if len(qs) > 1 else qs[0]
    k = torch.cat(ks, dim=2) if len(ks) > 1 else ks[0]
    v = torch.cat(vs, dim=2) if len(vs) > 1 else vs[0]
    if pe is not None:
        q, k = _stock_rope(q, k, pe) if _stock_rope is not None else (apply_rope1(q, pe), apply_rope1(k, pe))
    return q, k, v


# The host's own RoPE for the torch reference path (ComfyUI: comfy.ldm.flux.math.apply_rope, i.e.
# comfy-kitchen's kernel).  Same function as apply_rope1 -- but a plain-torch fp32 RoPE makes ~10
# passes over q and k, 13 ms per FLUX step slower than stock on an H200 (run 1), so the pack's
# "torch" path would not be the stock baseline it claims to be.  None = plain torch (tests).
_stock_rope = None


def set_stock_rope(fn):
    """Use ``fn(q, k, pe) -> (q, k)`` for RoPE in the torch reference (None: plain torch)."""
    global _stock_rope
    _stock_rope = fn


registry.register(OP, reference, doc=__doc__)

# ----------------------------------------------------------------------------- numba backend
MAX_THREADS = 128


LB = {"launch_bounds": (MAX_THREADS, 8)}


def make_qk_kernel(VW=2):
    """qkv0/qkv1 [B, L_p, 3*H*Dw] int64 words; scales [2, 2, D/2] int64 (fp32 pairs; part, q|k);
    pe [Bp, Ltot, D] int64 (pair r: word 2r = (m[r,0,0], m[r,0,1]), 2r+1 = (m[r,1,0], m[r,1,1]));
    out [3, B, H, Ltot, Dw] int64.  A group of G = Dw/VW lanes per head; lane w owns words
    w*VW .. +VW (VW 2: 16-byte accesses) = elements 4*VW*w .. +4*VW; group g does head g (q, k
    and v of it: three loads in flight per lane before any math; v stored straight away)."""

    RED = ik.RED_SMEM
    NE = 4 * VW  # elements of one vector per lane

    def qk_kernel(qkv0, qkv1, scales, pe, out, L0, has_pe, eps):
        smem = cuda.shared.array(RED, float32)
        wq = cuda.local.array(VW, int64)
        wk = cuda.local.array(VW, int64)
        wv = cuda.local.array(VW, int64)
        a = cuda.local.array(NE, float32)
        c = cuda.local.array(NE, float32)
        f = cuda.local.array(4, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        B = out.shape[1]
        H = out.shape[2]
        Ltot = out.shape[3]
        Dw = out.shape[4]
        lg = 0
        while (1 << lg) < Dw:
            lg += 1
        if VW == 2:
            lg -= 1
        G = 1 << lg  # lanes per head vector: a power of two <= 32
        g = tid >> lg
        w = tid & (G - 1)
        NG = nt >> lg
        inv_d = float32(1) / float32(Dw * 4)
        Bp = pe.shape[0]
        wo = w * VW  # first word of this lane in a head vector
        b = cuda.blockIdx.y
        while b < B:
            pb = b
            if pb >= Bp:
                pb = Bp - 1
            t = cuda.blockIdx.x
            while t < Ltot:
                p = 0
                tl = t
                if t >= L0:
                    p = 1
                    tl = t - L0
                if p == 0:
                    row = qkv0[b, tl]
                else:
                    row = qkv1[b, tl]
                h0 = cuda.blockIdx.z * NG
                while h0 < H:  # uniform trip count over the block (shuffles below)
                    h = h0 + g
                    valid = h < H
                    if valid:
                        if VW == 2:
                            t2 = ld2(row, h * Dw + wo)
                            wq[0] = t2[0]
                            wq[1] = t2[1]
                            t2 = ld2(row, (H + h) * Dw + wo)
                            wk[0] = t2[0]
                            wk[1] = t2[1]
                            t2 = ld2(row, (2 * H + h) * Dw + wo)
                            st2(out[2, b, h, t], wo, t2[0], t2[1])
                        else:
                            wq[0] = row[h * Dw + wo]
                            wk[0] = row[(H + h) * Dw + wo]
                            wv[0] = row[(2 * H + h) * Dw + wo]
                            out[2, b, h, t, wo] = wv[0]
                    else:
                        for u in range(VW):
                            wq[u] = int64(0)
                            wk[u] = int64(0)
                    s_q = float32(0)
                    s_k = float32(0)
                    for u in range(VW):
                        unpack_w(wq[u], a, 4 * u, 4)
                        unpack_w(wk[u], c, 4 * u, 4)
                    for e in range(NE):
                        s_q += a[e] * a[e]
                        s_k += c[e] * c[e]
                    s_q = group_sum(s_q, G, smem)
                    s_k = group_sum(s_k, G, smem)
                    if valid:
                        rq = rsqrt(s_q * inv_d + eps)
                        rk = rsqrt(s_k * inv_d + eps)
                        sqr = scales[p, 0]
                        skr = scales[p, 1]
                        for u in range(VW):  # scale words 2*wo + 2u, +1: 4 fp32 each pair
                            t2 = ld2(sqr, 2 * wo + 2 * u)
                            f[0], f[1] = unpack_f32x2(t2[0])
                            f[2], f[3] = unpack_f32x2(t2[1])
                            for e in range(4):
                                a[4 * u + e] *= rq * f[e]
                            t2 = ld2(skr, 2 * wo + 2 * u)
                            f[0], f[1] = unpack_f32x2(t2[0])
                            f[2], f[3] = unpack_f32x2(t2[1])
                            for e in range(4):
                                c[4 * u + e] *= rk * f[e]
                        if has_pe:
                            per = pe[pb, t]
                            for i in range(2 * VW):  # rope pair i of this lane: pe words 4*wo + 2i, +1
                                t2 = ld2(per, 4 * wo + 2 * i)
                                f[0], f[1] = unpack_f32x2(t2[0])
                                f[2], f[3] = unpack_f32x2(t2[1])
                                x0 = a[2 * i]
                                x1 = a[2 * i + 1]
                                a[2 * i] = f[0] * x0 + f[1] * x1
                                a[2 * i + 1] = f[2] * x0 + f[3] * x1
                                x0 = c[2 * i]
                                x1 = c[2 * i + 1]
                                c[2 * i] = f[0] * x0 + f[1] * x1
                                c[2 * i + 1] = f[2] * x0 + f[3] * x1
                        for u in range(VW):
                            wq[u] = pack4(a[4 * u], a[4 * u + 1], a[4 * u + 2], a[4 * u + 3])
                            wk[u] = pack4(c[4 * u], c[4 * u + 1], c[4 * u + 2], c[4 * u + 3])
                        if VW == 2:
                            st2(out[0, b, h, t], wo, wq[0], wq[1])
                            st2(out[1, b, h, t], wo, wk[0], wk[1])
                        else:
                            out[0, b, h, t, wo] = wq[0]
                            out[1, b, h, t, wo] = wk[0]
                    h0 += NG * cuda.gridDim.z
                t += cuda.gridDim.x
            b += cuda.gridDim.y

    return ik.jit_kernel(qk_kernel, **LB)


_launchers = {}
_scale_cache = {}
_dummy_pe = {}


def _launcher(VW):
    la = _launchers.get(VW)
    if la is None:
        la = _launchers[VW] = ik.Launcher(lambda: make_qk_kernel(VW))
    return la


@functools.lru_cache(maxsize=1024)
def _threads(G, H):
    """(threads, head chunks): one group of G lanes per head, at most MAX_THREADS threads per
    block; grid z = head chunks (small blocks: more of them resident per SM)."""
    nt = max(32, -(-min(H * G, MAX_THREADS) // 32) * 32)
    return nt, -(-H // (nt // G))


def _ptx_cases():
    from numba import types as nt
    A = lambda dt, nd: nt.Array(dt, nd, "A")  # noqa: E731
    sig = (A(nt.int64, 3), A(nt.int64, 3), A(nt.int64, 3), A(nt.int64, 3), A(nt.int64, 5),
           nt.int64, nt.int64, nt.float32)
    return {"qk_norm_rope w2": lambda: (make_qk_kernel(2), sig),
            "qk_norm_rope w1": lambda: (make_qk_kernel(1), sig)}


PTX_CASES = _ptx_cases()


def check(parts, pe, num_heads: int, eps: float = 1e-6):
    if not isinstance(parts, (list, tuple)) or not 1 <= len(parts) <= 2:
        return "numba qk_norm_rope takes 1 or 2 parts"
    qkv0 = parts[0][0]
    why = ik.common_check(*[p[0] for p in parts])
    if why:
        return why
    why = ik.runtime.device_ok(pe, *[s for p in parts for s in p[1:]])
    if why:
        return why
    B, _, C3 = qkv0.shape
    H = num_heads
    if C3 % (3 * H):
        return f"qkv width {C3} not divisible by 3*heads"
    D = C3 // (3 * H)
    if D % 4 or (D // 4) & (D // 4 - 1) or D > 128:
        return f"head dim {D} not in (4, 8, 16, 32, 64, 128)"
    Ltot = 0
    for qkv, qs, ks in parts:
        if qkv.ndim != 3 or qkv.shape[0] != B or qkv.shape[2] != C3:
            return f"part qkv shape {tuple(qkv.shape)} does not match {tuple(qkv0.shape)}"
        if ik.words(qkv) is None:
            return "qkv rows not 8-byte aligned"
        if qs.numel() != D or ks.numel() != D:
            return "norm scale size != head dim"
        Ltot += qkv.shape[1]
    if pe is not None:
        if pe.dtype != torch.float32:
            return f"pe must be float32, got {pe.dtype}"
        if pe.ndim != 6 or pe.shape[0] not in (1, B) or tuple(pe.shape[2:]) != (Ltot, D // 2, 2, 2):
            return f"pe shape {tuple(pe.shape)} does not match [B|1, 1, {Ltot}, {D // 2}, 2, 2]"
    return None


def _scales(parts, device):
    # cached per (storage, version): the cache holds the sources, so an address cannot be reused;
    # without a version counter an in-place update (a LoRA on the norm scales) could go unseen,
    # so such scales are prepared afresh on every call (4 tiny ops).
    vers = [ik.runtime.tensor_version(s) for p in parts for s in p[1:]]
    key = None if None in vers else tuple((s.data_ptr(), v, str(s.dtype)) for s, v in zip([s for p in parts for s in p[1:]], vers))
    hit = _scale_cache.get(key) if key is not None else None
    if hit is None:
        rows = [torch.stack([p[1].reshape(-1), p[2].reshape(-1)]) for p in parts]
        if len(rows) == 1:
            rows.append(rows[0])
        # the reference casts the scale to bf16 before multiplying: do the same rounding once
        sc = torch.stack(rows).to(device=device, dtype=torch.bfloat16).float().contiguous().view(torch.int64)
        if key is None:
            return sc
        if len(_scale_cache) > 512:
            _scale_cache.clear()
        hit = _scale_cache[key] = (sc, [p[1:] for p in parts])  # keep sources alive
    return hit[0]


def _pe_arr(pe, D, device):
    if pe is None:
        d = _dummy_pe.get(device)
        if d is None:
            d = _dummy_pe[device] = torch.zeros((1, 1, 2), dtype=torch.int64, device=device)
        return d
    Bp, Lt = pe.shape[0], pe.shape[2]
    # a free view for the contiguous pe ComfyUI and flux_core make (no cache: pe is new each step,
    # and an inference-mode tensor has no version counter to validate a cached copy with);
    # the kernel reads it with 16-byte loads: copy when the base is not 16-byte aligned
    w = pe.reshape(Bp, Lt, 2 * D).contiguous()
    if w.data_ptr() % 16:
        w = w.clone()
    return w.view(torch.int64)


def numba_qk_norm_rope(parts, pe, num_heads: int, eps: float = 1e-6):
    qkv0 = parts[0][0]
    B, L0, C3 = qkv0.shape
    H = num_heads
    D = C3 // (3 * H)
    Ltot = L0 + (parts[1][0].shape[1] if len(parts) > 1 else 0)
    dev = qkv0.device
    # q, k, v are returned as [B, H, L, D] views of a [3, B, L, H, D] buffer: attention's output then
    # comes back in [B, L, H, D] order (cuDNN/flash allocate it in the query's stride order), so
    # its reshape to [B, L, H*D] is free instead of a 28 MB copy per block (run 8: 3.6 ms/step).
    out = torch.empty((3, B, Ltot, H, D), dtype=qkv0.dtype, device=dev).permute(0, 1, 3, 2, 4)
    a0 = ik.words(qkv0)
    a1 = ik.words(parts[1][0]) if len(parts) > 1 else a0
    ow = out.view(torch.int64)
    VW = 2 if D >= 8 and ik.aligned16(a0, a1, ow) else 1
    nt, nz = _threads(D // (4 * VW), H)
    _launcher(VW)(ik.grid3(Ltot, B, nz), nt,
                  a0, a1, _scales(parts, dev), _pe_arr(pe, D, dev), ow,
                  L0, 1 if pe is not None else 0, np.float32(eps))
    return out[0], out[1], out[2]


registry.register_backend(OP, "numba", numba_qk_norm_rope, check=check)
