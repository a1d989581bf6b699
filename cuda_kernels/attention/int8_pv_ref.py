"""Torch reference of an all-integer 8-bit attention (issue #38): int8 S = Q8 K8^T as today's 8-bit
kernels compute it, then P V on integers too -- u8 P (a scale per row and 64-key group) x s8 V^T
(a scale per channel), int32 within a group, fp32 across groups.  No kernel runs this yet: this file
fixes the arithmetic one must reproduce, one function per kernel step, and exposes every
intermediate (``int8_pv_trace``) for kernel-vs-reference tests.

Steps ([B, H, L, D]; D = 128 on the GPU), per query row:
  1. Q / K: int8_format's torch references, imported: ``quantize_8bit`` (the pre-pass: K smoothed by
     its mean, Q per 16 rows, K per 64 keys) or, q_scales="token", Q from ``quant8_reference``
     (qk_norm_rope's per-token pack) with K from the pre-pass (int8_wgmma's QTOK path).
     S_int = Q8 K8^T, exact; x = float32(S_int) * ((q_scale * log2(e) / sqrt(D)) * k_scale) -- S in
     log2 units, the factor built in the kernel's order; + max(mask * log2(e), -1e30) if masked;
     keys >= L: -3e38.
  2. V: v_scale[b, h, d] = absmax over the L tokens / 127, v8 = rni(v * (127 / absmax)) (half to even,
     see ``quantize_v``).  ``vt8_image``: V^T's tile image for wgmma's K-major s8 B operand.
  3. Online softmax per tile of ``max_keys`` keys (128, int8_wgmma's BN): xn = max(tile's row max, m);
     m moves to xn only when xn > m + tau (tau = 8, int8_wgmma's TAU; 0: whenever it grows);
     alpha = exp2(m - m_new) (1 if it did not move); O' *= alpha, l *= alpha.
  4. Per group of ``keys`` keys (64) inside the tile, mt = the group's row max of x:
        P_u8 = rni(exp2(x - mt) * 255)     u8; the max key gives exactly 255, keys >= L give 0
        acc  = P_u8 @ v8                   int32, exact (|acc| <= keys 255 127 = 2,072,640 < 2^21;
                                           < 2^22 at 128 keys: also the magic-bias int -> fp32 range)
        rs   = sum P_u8                    int32 (the kernel: an s8 ones row group after the V^T tile
                                           in shared memory, as today's ones column)
        w    = exp2(mt - m)                fp32, <= 2^tau
        O'  += float32(acc) * w ;  l += float32(rs) * w
     P's dequantisation scale is p_scale = w / 255; the 1/255 is common to O' and l and cancels, so
     the kernel never applies it.  v_scale is per column and commutes with the loop: epilogue only.
  5. out = bf16(O' * (1 / l) * v_scale[d]), [B, L, H*D] like the op.

Design decisions (measured: tests/test_int8_pv_ref.py; [1, 2, 4608, 128], 2 seeds, vs fp32 attention):
  * P scale per (row, 64-key group) = the group's own max -> 255, not a static x 255: every group
    uses its 8 bits however far below the running max it sits (bench/probes/attn8_pv_error.py: 1.65-1.70%
    per 128-key tile vs 2.14-2.19% static; this reference: 1.61-1.66% with 64-key groups, 1.66-1.71%
    with 128).  No extra cost: mt is the max the kernel computes for the running max anyway, and
    exp2(x - mt) is the same one-FFMA argument.  A static 255 would also break with tau > 0 (P <= 2^tau).
  * tau = 8 as today: P's precision does not depend on it (P is relative to mt), only O' / l's range.
  * V rounding half to even, not the Q / K format's half up: bf16 v puts ~0.1% of the products exactly
    on .5 and rounding those one way biases whole channels, which P's average over keys does not
    shrink (half up: 1.77-1.80% instead of 1.61-1.66%).
  * V per channel over the sequence: the loop's two-level step stays one conversion + one FFMA per
    element and group.  (Per channel and tile, 1.55-1.58% in the emulation, would let qk_norm_rope
    scale V tile by tile, at a multiply per element per group in the loop.)  No V mean subtraction.
  * Ragged L: supported.  Keys >= L give P_u8 = 0; a group with no key < L (max_keys > keys) gets
    mt = -3e38, w = 0.  V's rows past L are zero in the image; query rows >= L are not computed.

What a kernel must match: exactly -- S_int, v8 / v_scale, and for the P_u8 it produced acc == P_u8 @ v8
and rs == sum P_u8; mt exactly for the same x; P_u8 to +-1 for the same x (exp2 / fp32 rounding at a
boundary; int8_wgmma's folded FFMA moves x itself by up to ulp(1.5 2^23 f) / 2: compare P_u8 from the
kernel's own x where that matters); O', l, out to fp32 / bf16 rounding (FFMA vs multiply-add, MUFU exp2).
"""
import math

import torch

from .int8_format import VT_KEYS, quantize_8bit, quant8_reference
from .launch import _BN, _LOG2E, normalize_mask

KEYS = 64               # keys per P scale and per int32 accumulation (one group)
MAX_KEYS = 128          # keys per online-softmax tile (the running max moves once per tile): int8_wgmma's BN
TAU = 8.0               # rescale threshold, log2 units (int8_wgmma's)
P_MAX = 255             # u8 P: the group's row max -> 255
V_MAX = 127             # s8 V per channel
NEG = -3e38             # keys >= L, and the running max before the first tile (the kernels' value)
MASK_FLOOR = -1e30


def acc_bound(keys=KEYS):
    """The largest |int32 P V| of one group of ``keys`` keys: keys * 255 * 127."""
    return keys * P_MAX * V_MAX


assert acc_bound(128) < 2 ** 22     # int32 exact, and within the magic-bias int -> fp32 range


# ---------------------------------------------------------------------------------------------- V
def quantize_v(v):
    """s8 V per (b, h, d): (v8 int8 [B, H, L, D], v_scale fp32 [B, H, D]) with v ~ v8 * v_scale.
    absmax over the L tokens (floored at 1e-20), v8 = rni(v * (127 / absmax)): round half to even
    (cvt.rni), clamped to +-127.  Not the Q / K format's half up: bf16 v puts ~0.1% of the products
    exactly on .5 (v = absmax / 2, ...), rounding those one way biases whole channels, and P's average
    over the keys does not shrink a bias ([1, 2, 4608, 128], random: 1.77-1.80% error with half up,
    1.61-1.66% with half to even)."""
    vf = v.float()
    m = vf.abs().amax(dim=2).clamp_min(1e-20)               # [B, H, D]
    inv = 127.0 / m                                         # fp32, as the format's 127 / m
    v8 = torch.round(vf * inv[:, :, None, :]).clamp_(-V_MAX, V_MAX).to(torch.int8)
    return v8, m / 127.0


def dequantize_v(v8, v_scale):
    return v8.float() * v_scale[:, :, None, :]


def vt8_image(v8, keys=VT_KEYS):
    """V^T's tile image: int8 [B, H, NT * keys, D] (NT = ceil(L / keys); viewed flat per head, the
    bytes the kernel's bulk copy moves).  Tile t holds V^T[:, t*keys:(t+1)*keys] ([D, keys], keys
    past L zero) as 8-row x 16-byte core matrices ordered (d group of 8, 16-key chunk, d in group,
    key in chunk): byte (t, d, key) at t*keys*D + (d // 8)*(keys*8) + (key // 16)*128 + (d % 8)*16 +
    key % 16.  K-major for wgmma's s8 B operand (LBO 128 between key chunks, SBO 8 * keys between
    d groups) -- the tiled K8 image's order with V^T's rows (d) in place of K's rows (keys)."""
    B, H, L, D = v8.shape
    assert keys % 16 == 0 and D % 8 == 0, (keys, D)
    NT = -(-L // keys)
    x = torch.zeros((B, H, NT * keys, D), dtype=torch.int8, device=v8.device)
    x[:, :, :L] = v8
    # [B, H, NT, kc, k16, dg, d8] -> (NT, dg, kc, d8, k16)
    x = x.view(B, H, NT, keys // 16, 16, D // 8, 8).permute(0, 1, 2, 5, 3, 6, 4)
    return x.contiguous().view(B, H, NT * keys, D)


def vt8_from_image(img, L, keys=VT_KEYS):
    """``vt8_image``'s inverse: int8 [B, H, L, D]."""
    B, H, Lt, D = img.shape
    NT = Lt // keys
    x = img.reshape(B, H, NT, D // 8, keys // 16, 8, 16).permute(0, 1, 2, 4, 6, 3, 5)
    return x.contiguous().view(B, H, NT * keys, D)[:, :, :L]


# -------------------------------------------------------------------------------------------- S
def qk8(q, k, q_scales="block"):
    """int8 Q / K and their scales per row / key: (q8 [B, H, L, D], k8 [B, H, L, D], qs [B, H, L],
    ks [B, H, L]).  q_scales "block": the pre-pass (``quantize_8bit``: Q per 16 rows, K per 64 keys);
    "token": Q from qk_norm_rope's pack (``quant8_reference``, per token), K from the pre-pass."""
    B, H, L, D = q.shape
    q8, k8, qs, ks, Lp = quantize_8bit(q, k)
    ks = ks.view(B, H, Lp // _BN).repeat_interleave(_BN, dim=2)
    if q_scales == "block":
        qs = qs.view(B, H, Lp // 16).repeat_interleave(16, dim=2)
    elif q_scales == "token":
        q8, _, qs, _, _, _ = quant8_reference(q, k)
        qs = qs.view(B, H, Lp)
    else:
        raise ValueError(q_scales)
    return q8[:, :, :L], k8[:, :, :L], qs[:, :, :L].contiguous(), ks[:, :, :L].contiguous()


def scores_log2(q8, k8, qs, ks, mask=None):
    """(S_int int32 [B, H, L, L], x fp32 [B, H, L, L]): the exact int8 product and S in log2 units,
    x = float32(S_int) * ((qs * log2(e)/sqrt(D)) * ks) (+ the mask's max(m * log2 e, -1e30))."""
    D = q8.shape[-1]
    s = q8.double() @ k8.double().transpose(-1, -2)         # exact: |S| <= D * 127^2 < 2^53
    assert D * 127 * 127 < 2 ** 31
    s_int = s.to(torch.int32)
    sl2 = torch.tensor(_LOG2E / math.sqrt(D), dtype=torch.float32, device=q8.device)
    f = (qs.float() * sl2)[..., :, None] * ks.float()[..., None, :]
    x = s_int.float() * f
    if mask is not None:
        m = normalize_mask(mask).to(x.device)
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=torch.float32, device=x.device).masked_fill_(~m, MASK_FLOOR)
        else:
            m = m.float().clamp(min=MASK_FLOOR)
        x = x + torch.clamp(m * torch.tensor(_LOG2E, dtype=torch.float32, device=x.device),
                            min=MASK_FLOOR)
    return s_int, x


# ---------------------------------------------------------------------------- the key-tile loop
def quantize_p(x, mt, valid):
    """One group's u8 P: rni(exp2(x - mt) * 255) where the key is < L, else 0.  x [.., rows, keys],
    mt [.., rows, 1] (the group's row max), valid [keys] bool."""
    p = torch.round(torch.exp2(x - mt) * P_MAX).clamp_(0, P_MAX)      # cvt.rni.sat.u8.f32
    return torch.where(valid, p, torch.zeros_like(p)).to(torch.uint8)


def pv_int32(p_u8, v8):
    """acc = P_u8 @ v8 in int32 (exact: asserted |acc| <= keys * 255 * 127 < 2^31).  torch has no
    int32 matmul on CUDA: there the product is taken in float64 (exact, far below 2^53)."""
    assert acc_bound(p_u8.shape[-1]) < 2 ** 31
    if p_u8.device.type == "cpu":
        return p_u8.to(torch.int32) @ v8.to(torch.int32)
    return (p_u8.double() @ v8.double()).to(torch.int32)


def moved(xn, m, tau):
    """The running max after a tile whose max (with m) is xn: xn when it exceeds m by more than
    tau (tau 0: whenever it grew), else m."""
    if tau > 0:
        return torch.where(xn > m + tau, xn, m)
    return xn


def _loop(x, v8, L, keys, max_keys, tau, trace):
    """Steps 3-4 over x [B, H, L, L] and v8 [B, H, L, D]: (O' [B, H, L, D], l [B, H, L, 1], the
    trace's per-group lists or None)."""
    B, H, Lq, _ = x.shape
    D = v8.shape[-1]
    assert max_keys % keys == 0, (keys, max_keys)
    NT = -(-L // max_keys)
    Lt = NT * max_keys
    f32 = dict(dtype=torch.float32, device=x.device)
    xp = torch.full((B, H, Lq, Lt), NEG, **f32)
    xp[..., :L] = x
    vp = torch.zeros((B, H, Lt, D), dtype=torch.int8, device=x.device)
    vp[:, :, :L] = v8
    col = torch.arange(Lt, device=x.device)
    m = torch.full((B, H, Lq, 1), NEG, **f32)
    o = torch.zeros((B, H, Lq, D), **f32)
    l = torch.zeros((B, H, Lq, 1), **f32)
    one = torch.ones((), **f32)
    tr = {k: [] for k in ("p_u8", "mt", "w", "acc", "rs", "alpha", "m")} if trace else None
    for t in range(NT):
        t0 = t * max_keys
        xt = xp[..., t0:t0 + max_keys]
        xn = torch.maximum(xt.amax(-1, keepdim=True), m)
        mn = moved(xn, m, tau)
        alpha = torch.where(mn != m, torch.exp2(m - mn), one)
        o = o * alpha                       # (the kernel skips rows whose alpha is 1: same values)
        l = l * alpha
        m = mn
        if trace:
            tr["alpha"].append(alpha)
            tr["m"].append(m)
        for g0 in range(t0, t0 + max_keys, keys):
            xg = xp[..., g0:g0 + keys]
            valid = col[g0:g0 + keys] < L
            mt = xg.amax(-1, keepdim=True)
            p8 = quantize_p(xg, mt, valid)
            acc = pv_int32(p8, vp[:, :, g0:g0 + keys])
            rs = p8.to(torch.int32).sum(-1, keepdim=True, dtype=torch.int32)
            w = torch.exp2(mt - m)          # a group of keys >= L only: mt = -3e38, w = 0
            o = o + acc.float() * w
            l = l + rs.float() * w
            if trace:
                for k_, v_ in (("p_u8", p8), ("mt", mt), ("w", w), ("acc", acc), ("rs", rs)):
                    tr[k_].append(v_)
    return o, l, tr


def _epilogue(o, l, v_scale):
    """bf16(O' * (1 / l) * v_scale[d]) as [B, L, H*D]."""
    B, H, L, D = o.shape
    out = (o * (1.0 / l)) * v_scale[:, :, None, :]
    return out.bfloat16().transpose(1, 2).reshape(B, L, H * D)


def int8_pv_trace(q, k, v, mask=None, keys=KEYS, max_keys=MAX_KEYS, tau=TAU, q_scales="block"):
    """Every intermediate of the reference, for kernel-vs-reference tests.  A dict:
      q8, k8 int8 [B,H,L,D]; qs, ks fp32 [B,H,L] (per row / per key); s_int int32 and x fp32 [B,H,L,L];
      v8 int8 [B,H,L,D], v_scale fp32 [B,H,D];
      per online-softmax tile t (lists of NT): alpha, m fp32 [B,H,L,1] (after the tile);
      per group g (NG = NT * max_keys / keys; tensors stacked on dim 3): p_u8 uint8 [B,H,L,NG,keys],
      mt / w / p_scale fp32 [B,H,L,NG] (p_scale = w / 255: exp2(x - m) ~ p_u8 * p_scale, m the running
      max after the group's tile), acc int32 [B,H,L,NG,D], rs int32 [B,H,L,NG];
      o fp32 [B,H,L,D] (O', before / l and v_scale), l fp32 [B,H,L,1], out bf16 [B,L,H*D]."""
    B, H, L, D = q.shape
    q8, k8, qs, ks = qk8(q, k, q_scales)
    s_int, x = scores_log2(q8, k8, qs, ks, mask)
    v8, v_scale = quantize_v(v)
    o, l, tr = _loop(x, v8, L, keys, max_keys, tau, trace=True)
    st = lambda name: torch.stack(tr[name], dim=3)           # noqa: E731
    w = st("w")[..., 0]
    return dict(q8=q8, k8=k8, qs=qs, ks=ks, s_int=s_int, x=x, v8=v8, v_scale=v_scale,
                alpha=tr["alpha"], m=tr["m"], p_u8=st("p_u8"), mt=st("mt")[..., 0], w=w, p_scale=w / P_MAX,
                acc=st("acc"), rs=st("rs")[..., 0], o=o, l=l, out=_epilogue(o, l, v_scale))


def attention_int8_pv_reference(q, k, v, mask=None, keys=KEYS, max_keys=MAX_KEYS, tau=TAU, q_scales="block"):
    """The all-integer 8-bit attention: [B, L, H*D] bf16 (the op's layout).  q, k, v [B, H, L, D];
    mask as the op takes it (None, bool or additive, [L, L] / [B, L, L] / [B, H, L, L])."""
    B, H, L, D = q.shape
    q8, k8, qs, ks = qk8(q, k, q_scales)
    _, x = scores_log2(q8, k8, qs, ks, mask)
    v8, v_scale = quantize_v(v)
    o, l, _ = _loop(x, v8, L, keys, max_keys, tau, trace=False)
    return _epilogue(o, l, v_scale)
