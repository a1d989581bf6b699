"""q/k RMSNorm (learned scale, eps 1e-6) + RoPE, written into the attention layout.

``qk_norm_rope(parts, pe, num_heads, eps=1e-6) -> (q, k, v)``
  parts: list of ``(qkv, q_scale, k_scale)``, one per stream in sequence order (double block:
         text then image; single block: one part).  ``qkv`` is [B, L_i, 3*H*D] -- it may be a
         row-strided view (the single block's linear1 output slice); q_scale/k_scale are [D].
  pe:    [B or 1, 1, sum(L_i), D/2, 2, 2] float32 rotation matrices (ComfyUI's EmbedND), or None.
  out:   q, k, v as [B, H, sum(L_i), D] tensors in qkv's dtype (the numba backend returns views in
         [B, L, H, D] memory order, the torch reference contiguous ones); q and k normalised
         and rotated, v copied.  This replaces view/permute/RMSNorm/cat/RoPE of stock ComfyUI.
  quant8=True / "qk": returns (q, k, v, pack) -- pack is a ``Quant8`` (int8 Q/K + per-token scales
         for the numba-8bit attention, made in the same pass; see the section "8-bit attention
         prologue") or None (torch reference, or a layout the kernel does not quantize);
         quant8="q": Q alone (pack.k8 / ks / kmean None: the Hopper 8-bit kernel quantizes K itself).
         quant8="qv": Q + V's tile image for the Hopper 8-bit kernel (pack.vt: its tile_kv of v
         written by this pass, 28 MB more stores at FLUX 1024^2 instead of a 57 MB relayout launch).

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

from . import launching
from .jit import jit_kernel
from .device import RED_SMEM
from . import runtime as _rt
# module globals (not closure cells): the simulator swaps `cuda` per thread, and the on-disk
# cache key then only hashes the factory's int constants
from .device import cuda, float32, int64, unpack_w, pack4, unpack_f32x2, group_sum, group_max, rsqrt, ld2, st2  # noqa: F401
from .registry import registry
from .config import QK_NORM_ROPE, QkConfig, launcher_key  # noqa: F401

OP = "qk_norm_rope"


def rms_norm(x, scale, eps):
    return torch.nn.functional.rms_norm(x, scale.shape, weight=scale.to(device=x.device, dtype=x.dtype), eps=eps)


def apply_rope1(x, pe):
    """ComfyUI's torch RoPE (fp32 math, cast back); comfy-kitchen computes the same function."""
    x_ = x.to(dtype=pe.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    x_out = pe[..., 0] * x_[..., 0]
    x_out.addcmul_(pe[..., 1], x_[..., 1])
    return x_out.reshape(*x.shape).type_as(x)


def reference(parts, pe, num_heads: int, eps: float = 1e-6, quant8: bool = False):
    """quant8=True: returns (q, k, v, None) -- the reference makes no int8 copy (numba-8bit attention
    then quantizes with its own pre-pass)."""
    if quant8:
        return (*reference(parts, pe, num_heads, eps), None)
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
# passes over q and k, ~10 ms per FLUX step slower than stock (BENCHMARKS.md, FLUX step), so the pack's
# "torch" path would not be the stock baseline it claims to be.  None = plain torch (tests).
_stock_rope = None


def set_stock_rope(fn):
    """Use ``fn(q, k, pe) -> (q, k)`` for RoPE in the torch reference (None: plain torch)."""
    global _stock_rope
    _stock_rope = fn


registry.register(OP, reference, doc=__doc__)

# ----------------------------------------------------------------------------- numba backend
# the most threads per block and the launch bounds: config.QkConfig


def make_qk_kernel(VW=2, QUANT=0, VT=0, LB_T=QK_NORM_ROPE.max_threads, LB_B=QK_NORM_ROPE.min_blocks):
    """qkv0/qkv1 [B, L_p, 3*H*Dw] int64 words; scales [2, 2, D/2] int64 (fp32 pairs; part, q|k);
    pe [Bp, Ltot, D] int64 (pair r: word 2r = (m[r,0,0], m[r,0,1]), 2r+1 = (m[r,1,0], m[r,1,1]));
    out [3, B, H, Ltot, Dw] int64.  A group of G = Dw/VW lanes per head; lane w owns words
    w*VW .. +VW (VW 2: 16-byte accesses) = elements 4*VW*w .. +4*VW; group g does head g (q, k
    and v of it: three loads in flight per lane before any math; v stored straight away).

    QUANT (VW 2 only; the section "8-bit attention prologue"): 0 = bf16 q, k, v alone (q8 / qsc /
    kmean are placeholders, not read); 1 = also int8 Q: q8 int64 [2, B, H, Lp, D/8] (8 int8 per
    word; lane w owns word w), qsc f32 [2, B, H, Lp]; 2 = int8 Q and K (K less kmean f32 [B, H, D]).
    With QUANT the grid strides over Lp = q8.shape[3] tokens (tokens >= Ltot: zero int8 rows, no
    bf16 stores, no loads).
    VT (VW 2 only; 0 or the tile width in keys): v is also stored into vt (int64 words of a bf16
    [B, H, Lt, D] buffer, Lt a multiple of VT) as the 8-bit wgmma kernel's V image,
    tile_kv_reference(v, VT, chunk_major=True): lane w's 16 bytes are column chunk w of the token's
    row, unit (((b H + h) Lt / VT + t / VT) (D / 8) + w) (VT / 8) + (t % VT) / 8) * 8 + t % 8.  Rows
    >= Ltot are never written (the buffer is zeroed once)."""
    assert QUANT in (0, 1, 2) and (QUANT == 0 or VW == 2) and (VT == 0 or (VW == 2 and VT % 8 == 0))
    RED = RED_SMEM
    NE = 4 * VW  # elements of one vector per lane
    KQ = QUANT == 2
    pack8 = _quant_helpers()
    TINY = float32(1e-20)

    GPT = VT // 8

    def qk_kernel(qkv0, qkv1, scales, pe, out, q8, qsc, kmean, vt, L0, has_pe, eps):
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
        Lp = Ltot
        if QUANT:
            Lp = q8.shape[3]
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
        NTV = 0
        if VT:
            NTV = vt.shape[0] // (B * H * Dw * VT)   # V tiles per head
        b = cuda.blockIdx.y
        while b < B:
            pb = b
            if pb >= Bp:
                pb = Bp - 1
            t = cuda.blockIdx.x
            while t < Lp:
                tok = t < Ltot  # (QUANT: pad tokens write zero int8 rows only)
                p = 0
                tl = t
                if t >= L0:
                    p = 1
                    tl = t - L0
                if not tok:
                    p = 0
                    tl = 0
                if p == 0:
                    row = qkv0[b, tl]
                else:
                    row = qkv1[b, tl]
                h0 = cuda.blockIdx.z * NG
                while h0 < H:  # uniform trip count over the block (shuffles below)
                    h = h0 + g
                    valid = h < H
                    if valid and tok:
                        if VW == 2:
                            t2 = ld2(row, h * Dw + wo)
                            wq[0] = t2[0]
                            wq[1] = t2[1]
                            t2 = ld2(row, (H + h) * Dw + wo)
                            wk[0] = t2[0]
                            wk[1] = t2[1]
                            t2 = ld2(row, (2 * H + h) * Dw + wo)
                            st2(out[2, b, h, t], wo, t2[0], t2[1])
                            if VT:
                                tv = t // VT
                                tr = t - tv * VT
                                st2(vt, 2 * (((((b * H + h) * NTV + tv) * (Dw // 2) + w) * GPT + tr // 8) * 8 + tr % 8),
                                    t2[0], t2[1])
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
                    mq = float32(0)
                    mk = float32(0)
                    if valid and tok:
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
                        if QUANT:
                            # quantize exactly the bf16 values just stored (only the 4 packed words
                            # stay live across the reduction: unpacked again below, <= 64 registers)
                            for u in range(VW):
                                unpack_w(wq[u], a, 4 * u, 4)
                                unpack_w(wk[u], c, 4 * u, 4)
                            for e in range(NE):
                                mq = max(mq, abs(a[e]))
                                if KQ:
                                    mk = max(mk, abs(c[e] - kmean[b, h, 4 * wo + e]))
                    if QUANT:  # (pad tokens: zero words, tiny scales)
                        mq = group_max(mq, G, smem)
                        if KQ:
                            mk = group_max(mk, G, smem)
                        if valid:
                            mq = max(mq, TINY)
                            for u in range(VW):
                                unpack_w(wq[u], a, 4 * u, 4)
                            q8[0, b, h, t, w] = pack8(a, 0, float32(127) / mq)
                            if w == 0:
                                qsc[0, b, h, t] = mq / float32(127)
                            if KQ:
                                mk = max(mk, TINY)
                                for u in range(VW):
                                    unpack_w(wk[u], a, 4 * u, 4)
                                if tok:
                                    for e in range(NE):
                                        a[e] -= kmean[b, h, 4 * wo + e]
                                q8[1, b, h, t, w] = pack8(a, 0, float32(127) / mk)
                                if w == 0:
                                    qsc[1, b, h, t] = mk / float32(127)
                    h0 += NG * cuda.gridDim.z
                t += cuda.gridDim.x
            b += cuda.gridDim.y

    return jit_kernel(qk_kernel, **({"launch_bounds": (LB_T, LB_B)} if LB_B else {}))


_launchers = {}
_scale_cache = {}
_placeholders = {}  # device -> (pe, q8, qsc, kmean, vt) stand-ins for arguments a launch does not read


def _launcher(VW, QUANT=0, VT=0, cfg=QK_NORM_ROPE):
    return launching.cached_launcher(_launchers, launcher_key((VW, QUANT, VT), cfg, QK_NORM_ROPE), make_qk_kernel,
                                     VW, QUANT, VT, cfg.max_threads, cfg.min_blocks)


def _placeholder(device):
    """(pe, q8, qsc, kmean, vt) stand-ins on ``device`` for arguments a launch does not read: pe when
    there is none (``has_pe`` 0), the int8 outputs when the kernel writes no int8 copy (QUANT 0), vt
    when it writes no V image (VT 0)."""
    d = _placeholders.get(device)
    if d is None:
        d = _placeholders[device] = (torch.zeros((1, 1, 2), dtype=torch.int64, device=device),
                                     torch.zeros((1, 1, 1, 1, 1), dtype=torch.int64, device=device),
                                     torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=device),
                                     torch.zeros((1, 1, 1), dtype=torch.float32, device=device),
                                     torch.zeros(2, dtype=torch.int64, device=device))
    return d


@functools.lru_cache(maxsize=1024)
def _threads(G, H, MAX_THREADS=QK_NORM_ROPE.max_threads):
    """(threads, head chunks): one group of G lanes per head, at most MAX_THREADS threads per
    block; grid z = head chunks (small blocks: more of them resident per SM)."""
    nt = max(32, -(-min(H * G, MAX_THREADS) // 32) * 32)
    return nt, -(-H // (nt // G))


def _ptx_cases():
    from numba import types as nt
    A = lambda dt, nd: nt.Array(dt, nd, "A")  # noqa: E731
    sig = (A(nt.int64, 3), A(nt.int64, 3), A(nt.int64, 3), A(nt.int64, 3), A(nt.int64, 5),
           nt.int64, nt.int64, nt.float32)
    sig = sig[:5] + (A(nt.int64, 5), A(nt.float32, 4), A(nt.float32, 3), A(nt.int64, 1)) + sig[5:]
    sig_m = sig[:4] + (A(nt.float32, 3), nt.int64, nt.int64, nt.int64, nt.int64, nt.float32)
    return {"qk_norm_rope w2": lambda: (make_qk_kernel(2), sig),
            "qk_norm_rope w1": lambda: (make_qk_kernel(1), sig),
            "qk_norm_rope q8": lambda: (make_qk_kernel(2, 2), sig),
            "qk_norm_rope q8 q only": lambda: (make_qk_kernel(2, 1), sig),
            "qk_norm_rope q8 q + v tiles": lambda: (make_qk_kernel(2, 1, VT_KEYS), sig),
            "qk kmean": lambda: (make_kmean_kernel(), sig_m)}


PTX_CASES = _ptx_cases()


def check(parts, pe, num_heads: int, eps: float = 1e-6, quant8: bool = False, config=None):
    if not isinstance(parts, (list, tuple)) or not 1 <= len(parts) <= 2:
        return "numba qk_norm_rope takes 1 or 2 parts"
    qkv0 = parts[0][0]
    why = launching.common_check(*[p[0] for p in parts])
    if why:
        return why
    why = _rt.device_ok(pe, *[s for p in parts for s in p[1:]])
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
        if launching.words(qkv) is None:
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
    vers = [_rt.tensor_version(s) for p in parts for s in p[1:]]
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
        return _placeholder(device)[0]
    Bp, Lt = pe.shape[0], pe.shape[2]
    # a free view for the contiguous pe ComfyUI and flux_core make (no cache: pe is new each step,
    # and an inference-mode tensor has no version counter to validate a cached copy with);
    # the kernel reads it with 16-byte loads: copy when the base is not 16-byte aligned
    w = pe.reshape(Bp, Lt, 2 * D).contiguous()
    if w.data_ptr() % 16:
        w = w.clone()
    return w.view(torch.int64)


# ----------------------------------------------------------------------------- 8-bit attention prologue
# ``quant8=True`` (flux_core.blocks asks for it only when its attention is the 8-bit op):
# the SAME pass over qkv also writes what numba-8bit attention consumes, so it skips its pre-pass:
#   q8, k8  int8 [B, H, Lp, D] (Lp = L rounded up to 64; pad rows written as zeros),
#   qs, ks  fp32 [B, H, Lp] per-(token, head) absmax/127 scales (the 16-lane group holds the whole
#           row: the absmax is a group shuffle max; pad tokens get 1e-20/127),
#   Q quantized from the bf16-rounded q this op returns; K from (bf16-rounded k - kmean[b, h]) where
#   kmean = mean of k over the tokens kmean_index(L) (64 evenly spaced; any per-head vector is exact
#   for softmax, the mean just centres K's channel bias so int8 keeps its precision).
# kmean comes from a tiny launch BEFORE the main one (one block per (b, h), one 16-lane group per
# sampled token: RMSNorm + RoPE of just those 64 k rows, then a fixed-order sum: deterministic).
# Bytes at FLUX 1024^2 on top of the plain pass (174.6 MB): int8 q/k 28.3 MB + scales 0.9 MB
# (+ kmean: 64 x 24 k rows = 0.4 MB) = +29.6 MB -> +8 us at 3.7 TB/s; numba-8bit's pre-pass
# (85 MB, measured 0.40 ms) is gone.  Only VW == 2 (16-byte rows; always true for FLUX) and
# D in QUANT_DIMS; otherwise the pack is None and attention falls back to its pre-pass.
QUANT_DIMS = (32, 64, 128)
# the format (smoothing tokens, the Quant8 pack, its torch reference) is the attention op's:
from .attention.int8_format import KMEAN_SAMPLES, kmean_index, Quant8, quant8_reference, pack8_factory, VT_KEYS  # noqa: E402,F401
KM_SMEM = KMEAN_SAMPLES * 128  # floats: one row per sampled token


def _quant_helpers():
    """(pack8,): 8 fp32 * inv -> 8 int8 (round half up, clamp +-127) in one int64 word (the format's)."""
    return pack8_factory()


def make_kmean_kernel():
    """kmean f32 [B, H, D] = mean over tokens kmean_index(Ltot) of the bf16-rounded normalised +
    rotated k.  Grid-strides (h, b) over blocks; a block = NG groups of G = D/8 lanes (16-byte words),
    group g does sampled tokens g, g + NG, ... (uniform trip count), rows go to shared memory, then
    thread d < D sums column d in token order."""
    RED = RED_SMEM
    KS = KM_SMEM

    def kmean_kernel(qkv0, qkv1, scales, pe, kmean, L0, Ltot, S, has_pe, eps):
        smem = cuda.shared.array(RED, float32)
        rows = cuda.shared.array(KS, float32)
        wk = cuda.local.array(2, int64)
        c = cuda.local.array(8, float32)
        f = cuda.local.array(4, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        B = kmean.shape[0]
        H = kmean.shape[1]
        D = kmean.shape[2]
        Dw = D // 4
        G = D // 8
        lg = 0
        while (1 << lg) < G:
            lg += 1
        g = tid >> lg
        w = tid & (G - 1)
        NG = nt >> lg
        wo = 2 * w
        inv_d = float32(1) / float32(D)
        Bp = pe.shape[0]
        iters = (S + NG - 1) // NG
        b = cuda.blockIdx.y
        while b < B:
            pb = b
            if pb >= Bp:
                pb = Bp - 1
            h = cuda.blockIdx.x
            while h < H:
                for it in range(iters):
                    i = g + it * NG
                    ok = i < S and g < NG
                    t = 0
                    if ok:
                        t = (i * Ltot) // S
                    p = 0
                    tl = t
                    if t >= L0:
                        p = 1
                        tl = t - L0
                    if p == 0:
                        row = qkv0[b, tl]
                    else:
                        row = qkv1[b, tl]
                    if ok:
                        t2 = ld2(row, (H + h) * Dw + wo)
                        wk[0] = t2[0]
                        wk[1] = t2[1]
                    else:
                        wk[0] = int64(0)
                        wk[1] = int64(0)
                    unpack_w(wk[0], c, 0, 4)
                    unpack_w(wk[1], c, 4, 4)
                    s_k = float32(0)
                    for e in range(8):
                        s_k += c[e] * c[e]
                    s_k = group_sum(s_k, G, smem)
                    if ok:
                        rk = rsqrt(s_k * inv_d + eps)
                        skr = scales[p, 1]
                        for u in range(2):
                            t2 = ld2(skr, 2 * wo + 2 * u)
                            f[0], f[1] = unpack_f32x2(t2[0])
                            f[2], f[3] = unpack_f32x2(t2[1])
                            for e in range(4):
                                c[4 * u + e] *= rk * f[e]
                        if has_pe:
                            per = pe[pb, t]
                            for j in range(4):
                                t2 = ld2(per, 4 * wo + 2 * j)
                                f[0], f[1] = unpack_f32x2(t2[0])
                                f[2], f[3] = unpack_f32x2(t2[1])
                                x0 = c[2 * j]
                                x1 = c[2 * j + 1]
                                c[2 * j] = f[0] * x0 + f[1] * x1
                                c[2 * j + 1] = f[2] * x0 + f[3] * x1
                        for u in range(2):  # the bf16 value qk_norm_rope writes
                            wk[u] = pack4(c[4 * u], c[4 * u + 1], c[4 * u + 2], c[4 * u + 3])
                            unpack_w(wk[u], c, 4 * u, 4)
                        for e in range(8):
                            rows[i * D + 8 * w + e] = c[e]
                cuda.syncthreads()
                d = tid
                while d < D:
                    acc = float32(0)
                    for i in range(S):
                        acc += rows[i * D + d]
                    kmean[b, h, d] = acc / float32(S)
                    d += nt
                cuda.syncthreads()
                h += cuda.gridDim.x
            b += cuda.gridDim.y

    return jit_kernel(kmean_kernel, launch_bounds=(1024, 1))


_kmean_launchers = {}
_q8_scratch = {}


def _kmean_launcher():
    return launching.cached_launcher(_kmean_launchers, "kmean", make_kmean_kernel)


def _q8_buffers(B, H, Lp, D, dev):
    """int8 q|k [2, B, H, Lp, D], scales [2, B, H, Lp], kmean [B, H, D] + a dict for the consumer's
    cached views; per shape and stream (runtime.stream_scratch)."""
    def make():
        q8 = torch.empty((2, B, H, Lp, D), dtype=torch.int8, device=dev)
        sc = torch.empty((2, B, H, Lp), dtype=torch.float32, device=dev)
        km = torch.empty((B, H, D), dtype=torch.float32, device=dev)
        return (q8, q8.view(torch.int64), sc, km, {})
    return _rt.stream_scratch(_q8_scratch, (B, H, Lp, D, str(dev)), make)


def _vt_buffer(B, H, Ltot, D, dev):
    """V's tile image (bf16 [B, H, Lt, D], Lt = Ltot rounded up to VT_KEYS, zeroed once: rows >= Ltot
    are never written) and its int64 view; per shape and stream like _q8_buffers."""
    def make():
        Lt = -(-Ltot // VT_KEYS) * VT_KEYS
        vt = torch.zeros((B, H, Lt, D), dtype=torch.bfloat16, device=dev)
        return vt, vt.view(torch.int64).reshape(-1)
    return _rt.stream_scratch(_q8_scratch, ("vt", B, H, Ltot, D, str(dev)), make)


def _launch_quant(a0, a1, sc, pe_w, ow, q, k, v, B, H, D, L0, Ltot, has_pe, eps, nt, nz, dev, kind="qk", cfg=QK_NORM_ROPE):
    """kind "qk": int8 Q and K (+ the K-mean launch); "q": Q alone (the pack's k8 / ks / kmean None);
    "qv": Q + V's tile image (pack.vt, see int8_format.VT_KEYS)."""
    Lp = -(-Ltot // 64) * 64
    q8, q8w, qsc, km, views = _q8_buffers(B, H, Lp, D, dev)
    hp = 1 if has_pe else 0
    kq = kind == "qk"
    vt = vtw = None
    if kind == "qv":
        vt, vtw = _vt_buffer(B, H, Ltot, D, dev)
    if kq:
        S = min(Ltot, KMEAN_SAMPLES)
        ntm = min(1024, -(-(S * (D // 8)) // 32) * 32)
        _kmean_launcher()(launching.grid3(H, B, 1), ntm, a0, a1, sc, pe_w, km, L0, Ltot, S, hp, np.float32(eps))
    _launcher(2, 2 if kq else 1, VT_KEYS if vt is not None else 0, cfg)(
        launching.grid3(Lp, B, nz), nt, a0, a1, sc, pe_w, ow, q8w, qsc, km,
        vtw if vt is not None else _placeholder(dev)[4], L0, hp, np.float32(eps))
    if not kq:
        return Quant8(q, k, q8[0], None, qsc[0].reshape(-1), None, None, Lp, views, v=v if vt is not None else None, vt=vt)
    return Quant8(q, k, q8[0], q8[1], qsc[0].reshape(-1), qsc[1].reshape(-1), km, Lp, views)


def numba_qk_norm_rope(parts, pe, num_heads: int, eps: float = 1e-6, quant8: bool = False, config=None):
    """``config``: a QkConfig (benchmarks / tests), else ``config.QK_NORM_ROPE``."""
    cfg = config or QK_NORM_ROPE
    qkv0 = parts[0][0]
    B, L0, C3 = qkv0.shape
    H = num_heads
    D = C3 // (3 * H)
    Ltot = L0 + (parts[1][0].shape[1] if len(parts) > 1 else 0)
    dev = qkv0.device
    # q, k, v are returned as [B, H, L, D] views of a [3, B, L, H, D] buffer: attention's output then
    # comes back in [B, L, H, D] order (cuDNN/flash allocate it in the query's stride order), so
    # its reshape to [B, L, H*D] is free instead of a 28 MB copy per block (a few ms per step).
    out = torch.empty((3, B, Ltot, H, D), dtype=qkv0.dtype, device=dev).permute(0, 1, 3, 2, 4)
    a0 = launching.words(qkv0)
    a1 = launching.words(parts[1][0]) if len(parts) > 1 else a0
    ow = out.view(torch.int64)
    VW = 2 if D >= 8 and launching.aligned16(a0, a1, ow) else 1
    nt, nz = _threads(D // (4 * VW), H, cfg.max_threads)
    if quant8 and VW == 2 and D in QUANT_DIMS:
        q, k, v = out[0], out[1], out[2]
        kind = quant8 if quant8 in ("q", "qv") else "qk"
        pack = _launch_quant(a0, a1, _scales(parts, dev), _pe_arr(pe, D, dev), ow, q, k, v,
                             B, H, D, L0, Ltot, pe is not None, eps, nt, nz, dev, kind=kind, cfg=cfg)
        return q, k, v, pack
    _launcher(VW, cfg=cfg)(launching.grid3(Ltot, B, nz), nt,
                  a0, a1, _scales(parts, dev), _pe_arr(pe, D, dev), ow, *_placeholder(dev)[1:],
                  L0, 1 if pe is not None else 0, np.float32(eps))
    if quant8:  # no int8 copy for this layout: attention falls back to its pre-pass
        return out[0], out[1], out[2], None
    return out[0], out[1], out[2]


registry.register_backend(OP, "numba", numba_qk_norm_rope, check=check)
