"""int8_pv_ref: the torch reference of the all-integer 8-bit attention (u8 P x s8 V, issue #38).

CPU only, small shapes: its error against fp32 attention (the 8-bit bar: 2% on random inputs;
finite with 4 channels 30x), the exactness of its integer steps (what a kernel must reproduce bit
for bit), the row sums' definition, and V^T's tile image.
"""
import math

import pytest
import torch

from flux_numba_pack.cuda_kernels.attention import int8_pv_ref as R
from flux_numba_pack.cuda_kernels.attention.int8_format import scores8_reference
from flux_numba_pack.cuda_kernels.attention.tile_kv import tile_kv_reference

D = 128


def make(L, seed, H=2, outliers=False):
    """bf16 q, k, v [1, H, L, 128], N(0, 1); outliers: the same 4 random channels 30x in each."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, L, D, generator=g) for _ in range(3))
    if outliers:
        ch = torch.randperm(D, generator=g)[:4]
        for x in (q, k, v):
            x[..., ch] *= 30
    return [x.bfloat16() for x in (q, k, v)]


def flat(o):
    B, H, L, Dh = o.shape
    return o.transpose(1, 2).reshape(B, L, H * Dh)


def ref32(q, k, v, mask=None):
    """fp32 softmax(Q K^T / sqrt(D)) V, [B, L, H*D]."""
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return flat(torch.softmax(s, -1) @ v.float())


def ref_same_s(q, k, v):
    """fp32 P V on the int8 S (scores8_reference): the error of the P V quantisation alone."""
    return flat(torch.softmax(scores8_reference(q.float(), k.float()), -1) @ v.float())


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ------------------------------------------------------------------------------------ accuracy
@pytest.mark.parametrize("L", [256, 200, 130])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_error_random(L, seed):
    """<= 2% from fp32 attention on fresh N(0, 1) inputs (L = 200 / 130: ragged last tile; at 130
    the second 64-key group of the second 128-key tile holds no key < L)."""
    q, k, v = make(L, seed)
    out = R.attention_int8_pv_reference(q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == (1, L, 2 * D)
    assert torch.isfinite(out.float()).all()
    err = rel(out, ref32(q, k, v))
    print(f"L={L} seed={seed}: {err:.3%} from fp32 attention")
    assert err <= 0.02, err


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_error_outliers(seed):
    """4 channels 30x in q, k and v: finite; the int8 Q K dominates the error against fp32 (10-14%
    here, as for today's bf16-P kernel), so P V's own share is held to 2% against fp32 P V on the same
    int8 S, and the total to the int8 S's error + 0.5 points."""
    q, k, v = make(256, seed, outliers=True)
    out = R.attention_int8_pv_reference(q, k, v)
    assert torch.isfinite(out.float()).all()
    ref, same = ref32(q, k, v), ref_same_s(q, k, v)
    err, err_pv, err_s = rel(out, ref), rel(out, same), rel(same, ref)
    print(f"seed={seed}: {err:.3%} from fp32 attention (int8 S alone {err_s:.3%}), P V share {err_pv:.3%}")
    assert err_pv <= 0.02, err_pv
    assert err <= err_s + 0.005, (err, err_s)


def test_error_variants():
    """Per-token Q scales (qk_norm_rope's pack), 128-key groups, tau 0 and a bool mask: all <= 2%;
    tau changes only fp32 rounding (P is relative to its group's max, not the running max)."""
    q, k, v = make(256, 3)
    ref = ref32(q, k, v)
    base = R.attention_int8_pv_reference(q, k, v)
    assert rel(R.attention_int8_pv_reference(q, k, v, q_scales="token"), ref) <= 0.02
    assert rel(R.attention_int8_pv_reference(q, k, v, keys=128, max_keys=128), ref) <= 0.02
    assert rel(R.attention_int8_pv_reference(q, k, v, keys=64, max_keys=64), ref) <= 0.02
    assert rel(R.attention_int8_pv_reference(q, k, v, tau=0.0), base) <= 2e-3
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(256, 256, generator=g) < 0.7
    mask[:, 0] = True
    assert rel(R.attention_int8_pv_reference(q, k, v, mask=mask), ref32(q, k, v, mask)) <= 0.02


# ------------------------------------------------------------------------ the integer steps
@pytest.mark.parametrize("L,keys,max_keys", [(256, 64, 128), (130, 64, 128), (200, 128, 128), (200, 64, 64)])
def test_integer_steps_exact(L, keys, max_keys):
    """acc == P_u8 @ v8 (float64 matmul of the integer tensors: exact), within the int32 bound;
    rs == sum P_u8; P_u8 = rni(exp2(x - mt) * 255) with 255 at each group's max; keys >= L: 0."""
    q, k, v = make(L, 7)
    t = R.int8_pv_trace(q, k, v, keys=keys, max_keys=max_keys)
    p8, acc, rs, v8 = t["p_u8"], t["acc"], t["rs"], t["v8"]
    NG = -(-L // max_keys) * (max_keys // keys)
    assert p8.dtype == torch.uint8 and acc.dtype == torch.int32 and rs.dtype == torch.int32
    assert v8.dtype == torch.int8 and p8.shape == (1, 2, L, NG, keys) and acc.shape == (1, 2, L, NG, D)
    vp = torch.zeros(1, 2, NG * keys, D, dtype=torch.float64)
    vp[:, :, :L] = v8.double()
    for gi in range(NG):
        exact = p8[:, :, :, gi].double() @ vp[:, :, gi * keys:(gi + 1) * keys]
        assert torch.equal(acc[:, :, :, gi].double(), exact), gi
    assert acc.abs().max().item() <= R.acc_bound(keys)
    assert torch.equal(rs.long(), p8.long().sum(-1))
    # P_u8 from x: the group's max gives 255, keys >= L give 0
    xp = torch.full((1, 2, L, NG * keys), R.NEG)
    xp[..., :L] = t["x"]
    xg = xp.view(1, 2, L, NG, keys)
    valid = (torch.arange(NG * keys) < L).view(NG, keys)
    assert torch.equal(t["mt"], xg.amax(-1))
    want = torch.round(torch.exp2(xg - t["mt"][..., None]) * 255).clamp(0, 255)
    assert torch.equal(p8.float(), torch.where(valid, want, torch.zeros_like(want)))
    full = valid.any(-1)
    assert (p8.amax(-1)[..., full] == 255).all()
    assert (p8[..., ~valid] == 0).all()
    # S: the int8 product exactly, and x its fp32 scaling
    s = (t["q8"].double() @ t["k8"].double().transpose(-1, -2))
    assert torch.equal(t["s_int"].double(), s)


def test_row_sums_from_quantised_p():
    """l is the sum of the dequantised u8 P (row sums of P_u8 times each group's weight, rescaled to
    the final running max), not of the fp32 P; p_u8 * p_scale stays within half a step of P."""
    q, k, v = make(256, 11)
    q = (q.float() * 3).bfloat16()          # a wider S: the running max moves across tiles
    t = R.int8_pv_trace(q, k, v, tau=0.0)
    m_final = t["m"][-1].double()            # [1, 2, L, 1]
    NG = t["w"].shape[-1]
    per_tile = 128 // 64
    m_at = torch.cat([t["m"][gi // per_tile] for gi in range(NG)], -1).double()    # each group's tile
    assert torch.allclose(t["w"].double(), torch.exp2(t["mt"].double() - m_at), rtol=1e-6, atol=0)
    w_final = torch.exp2(t["mt"].double() - m_final)
    l_q = (t["rs"].double() * w_final).sum(-1, keepdim=True)
    assert torch.allclose(t["l"].double(), l_q, rtol=1e-5, atol=0)
    # the fp32 P's sum differs by more than fp32 rounding: the definition is the quantised one
    x = t["x"].double()
    l_f = (torch.exp2(x - m_final) * 255).sum(-1, keepdim=True)
    assert ((l_f - l_q).abs() / l_q).max().item() > 1e-4
    # half a step: |P_u8 * p_scale - exp2(x - m)| <= p_scale / 2 (p_scale = w / 255)
    xg = x.view(1, 2, 256, NG, 64)
    p = torch.exp2(xg - m_at[..., None])
    deq = t["p_u8"].double() * t["p_scale"].double()[..., None]
    assert ((deq - p).abs() <= t["p_scale"].double()[..., None] * (0.5 + 1e-4)).all()
    # rows rescaled after the first tile with tau 0; fewer with tau 8 (the max moves by > 8 only)
    n0 = sum(int((a < 1).sum()) for a in t["alpha"][1:])
    n8 = sum(int((a < 1).sum()) for a in R.int8_pv_trace(q, k, v)["alpha"][1:])
    assert n0 > 0 and n8 < n0, (n0, n8)


def test_trace_matches_reference():
    """The trace's out is the reference's, and out = bf16(O' * (1 / l) * v_scale)."""
    q, k, v = make(200, 13)
    t = R.int8_pv_trace(q, k, v)
    out = R.attention_int8_pv_reference(q, k, v)
    assert torch.equal(t["out"], out)
    o = (t["o"] * (1.0 / t["l"])) * t["v_scale"][:, :, None, :]
    assert torch.equal(flat(o).bfloat16(), out)


# --------------------------------------------------------------------------------------- V
def test_quantize_v():
    """per (b, h, d): |v - v8 * scale| <= scale / 2, each channel's absmax -> +-127, ties to even."""
    _, _, v = make(200, 17, outliers=True)
    v8, sc = R.quantize_v(v)
    assert v8.dtype == torch.int8 and sc.shape == (1, 2, D)
    err = (v.float() - R.dequantize_v(v8, sc)).abs()
    assert (err <= sc[:, :, None, :] * (0.5 + 1e-5)).all()
    assert (v8.abs().amax(2) == 127).all()
    ties = [127.0, 63.5, -63.5, 62.5, -62.5, 0.5, -0.5, 1.5, -1.5]      # absmax 127: v * inv = v exactly
    v8t, sct = R.quantize_v(torch.tensor(ties).view(1, 1, -1, 1))
    assert sct.item() == 1.0
    assert v8t.view(-1).tolist() == [127, 64, -64, 62, -62, 0, 0, 2, -2]


@pytest.mark.parametrize("L,keys", [(256, 128), (200, 128), (130, 64)])
def test_vt8_image(L, keys):
    """V^T's tile image: round trip, zeros past L, the byte formula, and tile_kv's core-matrix order
    (tile_kv_reference of each tile's V^T as 16-bit pairs, D rows)."""
    _, _, v = make(L, 19)
    v8, _ = R.quantize_v(v)
    img = R.vt8_image(v8, keys)
    NT = -(-L // keys)
    assert img.dtype == torch.int8 and img.shape == (1, 2, NT * keys, D)
    assert torch.equal(R.vt8_from_image(img, L, keys), v8)
    flatb = img.reshape(1, 2, -1)
    g = torch.Generator().manual_seed(L)
    for _ in range(64):
        key, d = int(torch.randint(NT * keys, (1,), generator=g)), int(torch.randint(D, (1,), generator=g))
        t, kk = divmod(key, keys)
        off = t * keys * D + (d // 8) * (keys * 8) + (kk // 16) * 128 + (d % 8) * 16 + kk % 16
        want = int(v8[0, 1, key, d]) if key < L else 0
        assert int(flatb[0, 1, off]) == want
    vp = torch.zeros(1, 2, NT * keys, D, dtype=torch.int8)
    vp[:, :, :L] = v8
    for t in range(NT):
        vt_tile = vp[:, :, t * keys:(t + 1) * keys].transpose(-1, -2).contiguous()     # [1, 2, D, keys]
        want = tile_kv_reference(vt_tile.view(torch.int16), D).reshape(1, 2, -1).view(torch.int8)
        assert torch.equal(flatb[:, :, t * keys * D:(t + 1) * keys * D], want)
