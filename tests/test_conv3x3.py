"""conv3x3_nhwc / conv1x1_nhwc / groupnorm_stats_nhwc (Numba) vs their torch references.

Simulator (CPU): tiny shapes and tiny tile configs (the mma.py emulation costs ~25 ms per warp MMA,
so every case keeps its MMA count small): odd sizes (edge masking), 1 and 2 images, Cin / Cout not
multiples of the tile (channel masking), odd Cout (conv_out's 16-bit stores), with / without the
GroupNorm(+SiLU) prologue, residual epilogue and nearest-2x upsample, several warp layouts and
pipeline depths.  Fresh random inputs per case; outputs NaN-poisoned (an unwritten element fails).
Tolerances: the kernel rounds once (bf16 output of an fp32 result from bf16 operands), so it must be
within bf16 rounding of an fp32 reference and no further from it than stock bf16 math is.
GPU (FLUX_NUMBA_REAL_GPU=1): every FLUX-decoder conv shape (conv3x3.DECODER_SHAPES) with its
prologue / epilogue, against fp32 and stock bf16.
"""
import os

import pytest
import torch

from flux_numba_pack.cuda_kernels import registry, runtime
from flux_numba_pack.cuda_kernels import intrinsics as ik
from flux_numba_pack.cuda_kernels import conv3x3 as C3, conv1x1 as C1, groupnorm_stats_nhwc as GS

GPU = os.environ.get("FLUX_NUMBA_REAL_GPU") == "1"
DEV = "cuda" if GPU else "cpu"
BF = torch.bfloat16

pytestmark = pytest.mark.skipif(not ik.NUMBA_OK, reason="numba not importable")


@pytest.fixture(autouse=True)
def strict_and_poison(monkeypatch):
    real_empty = torch.empty

    def nan_empty(*a, **kw):
        t = real_empty(*a, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)
    old = registry.strict
    registry.strict = True
    try:
        yield
    finally:
        registry.strict = old


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def make(N, Hi, Wi, Cin, Cout, ksz=3, up=False, res=False, norm=None, G=8, seed=0):
    """Random inputs: x [N, Hi, Wi, Cin] (mean 0.5, std 2), weight ~ 1/sqrt(fan-in), bias, residual,
    GroupNorm params + the stats of x (fp32 reference: the prologue is tested, not the stats)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, Hi, Wi, Cin, generator=g) * 2 + 0.5).to(BF)
    w = (torch.randn(Cout, Cin, ksz, ksz, generator=g) / (ksz * ksz * Cin) ** 0.5).to(BF)
    b = (0.3 * torch.randn(Cout, generator=g)).to(BF)
    H, W = (2 * Hi, 2 * Wi) if up else (Hi, Wi)
    r = (torch.randn(N, H, W, Cout, generator=g)).to(BF) if res else None
    nm = None
    if norm is not None:
        gam = (1 + 0.3 * torch.randn(Cin, generator=g)).to(BF)
        bet = (0.3 * torch.randn(Cin, generator=g)).to(BF)
        nm = (GS.reference(x, G), gam, bet, bool(norm))
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    nm = None if nm is None else tuple(to(t) if torch.is_tensor(t) else t for t in nm)
    return to(x), C3.pack_weight(w).to(DEV), to(b), to(r), nm


def refs(x, wp, b, r, nm, up):
    """(fp32 reference, stock-bf16 reference)."""
    f = lambda t: None if t is None else t.float()  # noqa: E731
    nmf = None if nm is None else (nm[0], nm[1].float(), nm[2].float(), nm[3])
    return C3.reference(f(x), f(wp), f(b), f(r), nmf, up), C3.reference(x, wp, b, r, nm, up)


def check_close(y, ref32, ref16, shape):
    assert tuple(y.shape) == shape and y.dtype == BF
    assert not torch.isnan(y).any(), "unwritten (NaN) outputs"
    torch.testing.assert_close(y.float(), ref32, atol=2e-2, rtol=1.6e-2)
    assert rel(y, ref32) <= 1.25 * rel(ref16, ref32) + 2e-3, (rel(y, ref32), rel(ref16, ref32))


# (N, Hi, Wi, Cin, Cout, upsample, residual, norm (None | silu), groups, config)
CASES = [
    (1, 5, 7, 16, 16, False, False, None, 8, None),                 # odd H, W: edge tiles
    (2, 3, 5, 16, 16, False, True, None, 8, None),                  # 2 images, residual
    (1, 3, 5, 24, 24, False, False, None, 8, None),                 # Cin, Cout not tile multiples
    (1, 3, 5, 16, 3, False, False, True, 8, None),                  # odd Cout (16-bit stores) + GN+SiLU
    (2, 3, 4, 32, 16, False, True, True, 8, "4x4-16-16-w1x1-s3"),   # 2 chunks through the raw ring
    (1, 2, 3, 48, 16, False, False, False, 16, "4x4-16-16-w1x1-s4"),  # GN without SiLU, 3 chunks, cpg 3
    (1, 3, 4, 16, 16, True, False, None, 8, None),                  # nearest 2x -> 6 x 8
    (2, 2, 3, 16, 16, True, True, True, 4, None),                   # 2x + residual + GN+SiLU
    (1, 3, 5, 32, 32, False, False, None, 8, "4x4-32-32-w1x2-s3"),  # 2 warps along N, BK 32
    (1, 5, 7, 16, 16, False, False, True, 8, "4x8-16-16-w2x1-s2"),  # 2 warps along M
    (1, 3, 5, 16, 16, False, False, True, 8, "4x4-16-16-w1x1-s2-tanh"),  # tanh SiLU
]


@pytest.mark.skipif(GPU, reason="tiny-shape simulator cases")
@pytest.mark.parametrize("N,Hi,Wi,Cin,Cout,up,res,norm,G,cfg", CASES)
def test_conv3x3_matches_reference(N, Hi, Wi, Cin, Cout, up, res, norm, G, cfg):
    x, wp, b, r, nm = make(N, Hi, Wi, Cin, Cout, 3, up, res, norm, G, seed=Hi * 100 + Cin + Cout)
    if cfg is None:  # through the registry (forced numba: strict raises if it would not run)
        with registry.force("numba", ops=[C3.OP]):
            y = registry.call(C3.OP, x, wp, b, residual=r, norm=nm, upsample2x=up)
        assert registry.last[C3.OP] == "numba"
    else:
        y = C3.conv_nhwc_numba(x, wp, b, r, nm, up, cfg=cfg)
    H, W = (2 * Hi, 2 * Wi) if up else (Hi, Wi)
    check_close(y, *refs(x, wp, b, r, nm, up), (N, H, W, Cout))


@pytest.mark.skipif(GPU, reason="tiny-shape simulator cases")
@pytest.mark.parametrize("N,Hi,Wi,Cin,Cout,res,norm,cfg", [
    (2, 3, 5, 32, 16, True, None, None),
    (1, 3, 5, 64, 16, False, False, "4x4-16-16-w1x1-s3"),   # 4 chunks, S-deep raw / halo rings
    (1, 4, 4, 16, 8, False, True, None),                    # Cout < BN
])
def test_conv1x1_matches_reference(N, Hi, Wi, Cin, Cout, res, norm, cfg):
    x, wp, b, r, nm = make(N, Hi, Wi, Cin, Cout, 1, False, res, norm, 8, seed=Cin + 7 * Cout)
    if cfg is None:
        with registry.force("numba", ops=[C1.OP]):
            y = registry.call(C1.OP, x, wp, b, residual=r, norm=nm)
        assert registry.last[C1.OP] == "numba"
    else:
        y = C1.conv1x1_nhwc_numba(x, wp, b, r, nm, cfg=cfg)
    check_close(y, *refs(x, wp, b, r, nm, False), (N, Hi, Wi, Cout))


@pytest.mark.parametrize("shape,G", [((2, 5, 7, 64), 32), ((1, 8, 8, 32), 8), ((2, 3, 5, 128), 32),
                                     ((1, 6, 6, 16), 16), ((2, 9, 11, 256), 32)])
def test_groupnorm_stats_nhwc(shape, G):
    g = torch.Generator().manual_seed(shape[3])
    x = (torch.randn(shape, generator=g) * 2 + 1).to(BF).to(DEV)
    with registry.force("numba", ops=[GS.OP]):
        st = registry.call(GS.OP, x, G, 1e-6)
    assert registry.last[GS.OP] == "numba"
    ref = GS.reference(x.double(), G, 1e-6)
    assert st.shape == (2, shape[0], G) and st.dtype == torch.float32
    torch.testing.assert_close(st.double(), ref, atol=1e-5, rtol=1e-5)


def test_groupnorm_stats_large_mean():
    """mean 300, std 1 in bf16 data: the two-pass / Chan merge keeps the variance."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 6, 6, 64, generator=g) + 300).to(BF).to(DEV)
    st = GS.groupnorm_stats_nhwc_numba(x, 32, 1e-6)
    torch.testing.assert_close(st.double(), GS.reference(x.double(), 32, 1e-6), atol=1e-4, rtol=1e-5)


def test_checks_decline_with_a_reason():
    x, wp, b, r, nm = make(1, 4, 4, 16, 16, 3, False, True, True)
    assert C3.check(x, wp, b, r, nm) is None
    assert C3.check(x.float(), wp, b) is not None                     # dtype
    assert C3.check(x[..., :8], C3.pack_weight(torch.zeros(16, 8, 3, 3)).to(DEV), b) is not None  # strided x
    assert "Cin" in C3.check(x[..., :12].contiguous(), C3.pack_weight(torch.zeros(16, 12, 3, 3)).to(DEV), b)
    assert C3.check(x, wp[:, :1].contiguous(), b) is not None           # a 1x1 weight is not conv3x3's
    assert C1.check(x, wp, b) is not None                               # and vice versa
    assert C3.check(x, wp, b, r[:, :2].contiguous()) is not None         # residual shape
    assert C3.check(x, wp, b, None, (nm[0][:, :, :3], nm[1], nm[2], True)) is not None  # groups
    assert GS.check(x, 32) is not None and GS.check(x, 8) is None      # 16 channels, 32 groups
    with pytest.raises(ValueError):
        C3.Config.parse("8x16-128")
    assert C3.Config.parse("8x16-128-32-w2x4-s3-tanh-lb2").name == "8x16-128-32-w2x4-s3-tanh-lb2"
    assert C3.Config.parse("4x4-16-24-w1x1-s2").why_invalid()              # bk 24


def test_pack_weight_roundtrip():
    w = torch.randn(24, 16, 3, 3).to(BF)
    wp = C3.pack_weight(w)
    assert wp.shape == (24, 9, 16) and wp.is_contiguous()
    assert torch.equal(C3.unpack_weight(wp), w)


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.skipif(not GPU, reason="decoder shapes run on a real GPU (FLUX_NUMBA_REAL_GPU=1)")
@pytest.mark.parametrize("shape", C3.DECODER_SHAPES, ids=[s[0] for s in C3.DECODER_SHAPES])
def test_decoder_shapes_gpu(shape):
    name, Cin, Cout, Hi, ksz, up, norm, res, _ = shape
    x, wp, b, r, nm = make(1, Hi, Hi, Cin, Cout, ksz, bool(up), bool(res), norm, 32, seed=Cin + Cout + Hi)
    if ksz == 3:
        y = C3.conv_nhwc_numba(x, wp, b, r, nm, bool(up))
    else:
        y = C1.conv1x1_nhwc_numba(x, wp, b, r, nm)
    H = 2 * Hi if up else Hi
    ref32, ref16 = refs(x, wp, b, r, nm, bool(up))
    assert not torch.isnan(y).any()
    assert tuple(y.shape) == (1, H, H, Cout)
    assert rel(y, ref32) <= 1.25 * rel(ref16, ref32) + 2e-3, (name, rel(y, ref32), rel(ref16, ref32))
    assert (y.float() - ref32).abs().max().item() <= 0.05 * ref32.abs().max().item() + 0.05
