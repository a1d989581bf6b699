"""qk_norm_rope(quant8=True), the 8-bit attention prologue, and the single block's linear2 input
built inside linear1 (split from test_kernels_fused.py; same conventions: forced numba, strict,
NaN-poisoned outputs).
"""
import pytest
import torch

from flux_numba_pack.cuda_kernels import registry
from flux_numba_pack.cuda_kernels import jit
from flux_numba_pack.cuda_kernels import qk_norm_rope as QK
from flux_numba_pack.flux_core import blocks
from _kernel_testing import DEV, BF, rnd, strict_and_poison  # noqa: F401  (autouse fixture)
from _fused_testing import TinyDouble, TinySingle, _rel, close, numba, ref_of, rope_pe

pytestmark = pytest.mark.skipif(not jit.NUMBA_OK, reason="numba not importable")


# ------------------------------------------------------ qk_norm_rope(quant8=True): 8-bit attention prologue
@pytest.fixture
def poison_int8(monkeypatch):
    """int8 buffers come back filled with -128 (never a quantized value: those are in +-127)."""
    cur = torch.empty

    def empty(*a, **kw):
        t = cur(*a, **kw)
        if t.dtype == torch.int8:
            t.fill_(-128)
        return t
    monkeypatch.setattr(torch, "empty", empty)
    QK._q8_scratch.clear()
    yield
    QK._q8_scratch.clear()


def check_quant8_pack(q, k, pk):
    """pack vs the torch reference of the same quantization (from the bf16 q/k the op returned)."""
    L = q.shape[2]
    q8, k8, qs, ks, Lp, km = QK.quant8_reference(q, k)
    assert pk is not None and pk.q is q and pk.k is k and pk.Lp == Lp
    torch.testing.assert_close(pk.kmean, km, rtol=1e-5, atol=1e-5)
    for a, b in ((pk.q8, q8), (pk.k8, k8)):
        assert a.shape == b.shape and a.dtype == torch.int8
        assert (a != -128).all(), "unwritten int8 elements"
        d = (a.int() - b.int()).abs()
        assert d.max().item() <= 1 and (d > 0).float().mean().item() < 0.01  # rounding ties / approx division
        assert (a[:, :, L:] == 0).all()
    for a, b in ((pk.qs, qs), (pk.ks, ks)):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)


def test_qk_norm_rope_quant8_two_parts(poison_int8):
    """Double block: txt + img parts (img row-strided, K with a channel offset the mean absorbs),
    batch 2 with per-batch pe, ragged L (18 -> Lp 64: pad rows zero)."""
    torch.manual_seed(7)
    B, H, D, L1, L2 = 2, 2, 32, 5, 13
    txt = rnd(B, L1, 3 * H * D, scale=2.0)
    img = rnd(B, L2, 3 * H * D + 8)[..., :3 * H * D]
    img[..., H * D:2 * H * D] += 2.0
    s = [rnd(D, offset=1.0) for _ in range(4)]
    parts = [(txt, s[0], s[1]), (img, s[2], s[3])]
    pe = rope_pe(2, L1 + L2, D)
    with numba():
        q, k, v, pk = registry.call("qk_norm_rope", parts, pe, H, 1e-6, quant8=True)
    qr, kr, vr = ref_of("qk_norm_rope")(parts, pe, H, 1e-6)
    close(q, qr)
    close(k, kr)
    assert torch.equal(v, vr)
    check_quant8_pack(q, k, pk)


def test_qk_norm_rope_quant8_declines_cleanly():
    """No int8 pack where the kernel does not make one (head dim 16; the torch reference): the
    4th result is None and q/k/v are the ordinary outputs (attention then uses its pre-pass)."""
    torch.manual_seed(8)
    B, H, D, L = 1, 2, 16, 6
    qkv = rnd(B, L, 3 * H * D)
    s = rnd(D, offset=1.0)
    with numba():
        q, k, v, pk = registry.call("qk_norm_rope", [(qkv, s, s)], None, H, 1e-6, quant8=True)
    assert pk is None
    qr, kr, vr, pr = ref_of("qk_norm_rope")([(qkv, s, s)], None, H, 1e-6, quant8=True)
    assert pr is None
    close(q, qr)
    close(k, kr)


def test_blocks_fused_8bit_attention_uses_quant8_pack(poison_int8, monkeypatch):
    """flux_core blocks whose options say the attention is the 8-bit op (BlockContext.quant8):
    qk_norm_rope emits the int8 pack, the block passes it to the attention op (q8=) and the 8-bit
    kernel consumes it (no pre-pass); outputs match the torch blocks.  The decision comes from the
    options alone: other contexts never ask, whatever the registry policy."""
    from flux_numba_pack.cuda_kernels.attention import int8_format
    from flux_numba_pack.cuda_kernels import attention as A
    torch.manual_seed(3)
    h, heads, B, Lt, Li = 64, 2, 2, 5, 7
    dbl = TinyDouble(h, heads).to(DEV, BF)
    img, txt = rnd(B, Li, h, scale=2.0), rnd(B, Lt, h, scale=2.0)
    vec = rnd(B, h)
    pe = rope_pe(1, Lt + Li, h // heads)
    got = []
    orig = A.usable_pack
    monkeypatch.setattr(A, "usable_pack", lambda *a, **kw: got.append(orig(*a, **kw)) or got[-1])
    prepass = []
    monkeypatch.setattr(int8_format, "_prepass", lambda *a, **kw: prepass.append(1))  # must not run
    with torch.no_grad():
        with registry.force("torch"):
            ctx = blocks.BlockContext(fused=True)
            assert not ctx.wants_q8()
            ri, rt = blocks.double_block(dbl, img.clone(), txt.clone(), vec, pe, ctx=ctx)
        with registry.force("numba", attention="numba-8bit"):
            assert not blocks.BlockContext().wants_q8()        # the policy alone decides nothing
        with registry.force("torch", qk_norm_rope="numba", attention="numba-8bit"):
            ctx = blocks.BlockContext(fused=True, quant8=True)
            assert ctx.wants_q8() and not blocks.BlockContext(quant8=True, attention=lambda *a: None).wants_q8()
            ni, nt_ = blocks.double_block(dbl, img.clone(), txt.clone(), vec, pe, ctx=ctx)
    assert len(got) == 1 and got[0] is not None and not prepass
    for a, b in ((ni, ri), (nt_, rt)):
        assert not torch.isnan(a).any()
        assert _rel(a, b) < 2e-2, _rel(a, b)


def test_fused_single_block_builds_linear2_input_inside_linear1(monkeypatch):
    """With Numba q/k/v (own buffer) the fused single block writes attention + GELU into
    linear1's output and allocates no [B, L, C+M] buffer (peak memory <= stock); with torch
    q/k/v (views of linear1) it must use a separate buffer and still match."""
    torch.manual_seed(3)
    h, heads, B, L, mlp = 64, 2, 2, 9, 128
    sgl = TinySingle(h, heads, mlp).to(DEV, BF)
    x, vec = rnd(B, L, h, scale=2.0), rnd(B, h)
    pe = rope_pe(1, L, h // heads)
    shapes = []
    real_empty = torch.empty

    def spy(*a, **kw):
        shapes.append(tuple(a[0]) if a and isinstance(a[0], (tuple, list)) else tuple(a))
        return real_empty(*a, **kw)
    with torch.no_grad():
        with registry.force("torch"):
            ref = blocks.single_block(sgl, x.clone(), vec, pe, ctx=blocks.BlockContext(fused=False))
        monkeypatch.setattr(blocks.torch, "empty", spy)
        with registry.force("torch"):
            viewed = blocks.single_block(sgl, x.clone(), vec, pe, ctx=blocks.BlockContext(fused=True))
        assert (B, L, h + mlp) in shapes
        shapes.clear()
        with numba():
            inside = blocks.single_block(sgl, x.clone(), vec, pe, ctx=blocks.BlockContext(fused=True))
        assert (B, L, h + mlp) not in shapes
    for out in (viewed, inside):
        assert not torch.isnan(out).any()
        assert _rel(out, ref) < 1e-2, _rel(out, ref)
