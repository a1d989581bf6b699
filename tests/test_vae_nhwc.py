"""groupnorm_silu_nhwc and upsample_nearest2x (the NHWC VAE decoder's kernels) against their torch
references on fresh random inputs: simulator-sized shapes here; FLUX_NUMBA_REAL_GPU=1 adds the
decoder's shapes on a GPU."""
import pytest
import torch
import torch.nn.functional as F

from flux_numba_pack.cuda_kernels import registry, runtime
from flux_numba_pack.cuda_kernels import groupnorm_silu_nhwc as gnh
from flux_numba_pack.cuda_kernels import upsample_nearest2x as up
from flux_numba_pack.cuda_kernels import bias_residual_nhwc as br
from flux_numba_pack.cuda_kernels import vae_attention as va

DEV = "cpu" if runtime.SIMULATOR else "cuda"
CL = torch.channels_last


# the simulator speed-up, registry.strict and the NaN-poisoned torch.empty / empty_like (they patch
# torch itself, so they cover these modules' allocations too)
from test_vae import _fast_simulator, strict, poison  # noqa: E402,F401


def _inputs(shape, wdtype, mean=0.0, scale=2.0, seed=None):
    g = torch.Generator()
    g.manual_seed(torch.seed() if seed is None else seed)      # fresh inputs every run
    x = (torch.randn(shape, generator=g) * scale + mean).to(torch.bfloat16)
    C = shape[1]
    w = (1 + 0.5 * torch.randn(C, generator=g)).to(wdtype)
    b = (0.5 * torch.randn(C, generator=g)).to(wdtype)
    return x.to(DEV).contiguous(memory_format=CL), w.to(DEV), b.to(DEV)


def _call(op, *args, **kw):
    with registry.force("numba", ops=[op]):
        y = registry.call(op, *args, **kw)
    assert registry.last[op] == "numba"
    return y


def _fp32_gn(x, G, w, b, eps, silu):
    y = F.group_norm(x.float(), G, w.float(), b.float(), eps)
    return F.silu(y) if silu else y


GN_CASES = [
    # shape,            groups, w dtype,        silu   (channels per group -> groups per column)
    ((1, 64, 5, 7), 32, torch.bfloat16, True),     # cpg 2: 4 groups in one 16-byte column, odd H W
    ((2, 128, 4, 6), 32, torch.float32, True),     # cpg 4 (the decoder's 128 ch), 2 samples, fp32 affine
    ((2, 256, 3, 5), 32, torch.bfloat16, False),   # cpg 8: one group per column, no SiLU
    ((1, 64, 9, 8), 4, torch.bfloat16, True),      # cpg 16: two columns per group
    ((1, 32, 16, 16), 32, torch.bfloat16, True),   # cpg 1, main loops (>= U R pixels per chunk)
]


@pytest.mark.parametrize("shape,G,wdt,silu", GN_CASES)
def test_groupnorm_silu_nhwc_matches_reference(shape, G, wdt, silu, strict, poison):
    x, w, b = _inputs(shape, wdt)
    y = _call(gnh.OP, x, G, w, b, 1e-6, silu=silu)
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=CL)
    assert not torch.isnan(y).any()
    ref = _fp32_gn(x, G, w, b, 1e-6, silu)
    stock = gnh.reference(x, G, w.to(x.dtype), b.to(x.dtype), 1e-6, silu)
    err, err_stock = (y.float() - ref).abs().max().item(), (stock.float() - ref).abs().max().item()
    assert err <= max(2 * err_stock, 1.6e-2 * ref.abs().max().item()), (err, err_stock)


@pytest.mark.parametrize("shape,G,pdt", [((1, 128, 5, 7), 32, torch.bfloat16), ((2, 64, 4, 6), 4, torch.float32)])
def test_groupnorm_silu_nhwc_pre_bias(shape, G, pdt, strict, poison):
    """pre_bias (a conv's bias the statistics add on load and the affine folds in) == GN(x + bias)."""
    x, w, b = _inputs(shape, torch.bfloat16)
    pb = (3 * torch.randn(shape[1])).to(pdt).to(DEV)        # large against x's spread: a wrong fold shows
    y = _call(gnh.OP, x, G, w, b, 1e-6, silu=True, pre_bias=pb)
    ref = _fp32_gn(x.float() + pb.float().view(1, -1, 1, 1), G, w, b, 1e-6, True)
    stock = gnh.reference(x, G, w, b, 1e-6, True, pre_bias=pb)
    err, err_stock = (y.float() - ref).abs().max().item(), (stock.float() - ref).abs().max().item()
    assert err <= max(2 * err_stock, 1.6e-2 * ref.abs().max().item()), (err, err_stock)


def test_groupnorm_silu_nhwc_multi_chunk(strict, poison, monkeypatch):
    """Several statistics blocks per sample (partials merged in the coefficient kernel), as on the GPU."""
    monkeypatch.setattr(gnh, "_chunks", lambda N, HW, R, MAX_S: 4)
    x, w, b = _inputs((2, 64, 8, 10), torch.bfloat16)
    y = _call(gnh.OP, x, 32, w, b, 1e-6, silu=True)
    torch.testing.assert_close(y.float(), _fp32_gn(x, 32, w, b, 1e-6, True), atol=2e-2, rtol=1.6e-2)


def test_groupnorm_silu_nhwc_large_mean(strict, poison):
    """mean 300, std 1 (bf16 steps of 2 there): Chan merges keep the variance."""
    x, w, b = _inputs((1, 64, 6, 6), torch.float32, mean=300.0, scale=4.0)
    y = _call(gnh.OP, x, 32, w, b, 1e-6, silu=False)
    ref = F.group_norm(x.double(), 32, w.double(), b.double(), 1e-6)
    assert (y.double() - ref).abs().max().item() < 3e-2


def test_groupnorm_silu_nhwc_check():
    x, w, b = _inputs((1, 64, 4, 4), torch.bfloat16)
    assert gnh.check(x, 32, w, b) is None
    assert gnh.check(x.contiguous(), 32, w, b) is not None          # NCHW memory
    assert gnh.check(x.float(), 32, w, b) is not None               # bf16 only
    assert gnh.check(x[:, :60], 30, w[:60], b[:60]) is not None     # C % 8
    assert gnh.check(x, 32, None, b) is not None
    x3, w3, b3 = _inputs((1, 96, 4, 4), torch.bfloat16)
    assert gnh.check(x3, 32, w3, b3) is not None                    # cpg 3 neither divides nor is a multiple of 8


BR_CASES = [
    ((1, 8, 3, 5), torch.bfloat16, True),     # one column, odd H W, residual
    ((2, 64, 4, 3), torch.float32, False),    # 8 columns, 2 samples, fp32 bias, no residual
    ((1, 32, 16, 16), torch.bfloat16, True),  # main loop (>= U strides)
]


@pytest.mark.parametrize("shape,bdt,res", BR_CASES)
def test_bias_residual_nhwc_matches_reference(shape, bdt, res, strict):
    y0 = torch.randn(shape).to(torch.bfloat16).to(DEV).contiguous(memory_format=CL)
    b = torch.randn(shape[1]).to(bdt).to(DEV)
    r = torch.randn(shape).to(torch.bfloat16).to(DEV).contiguous(memory_format=CL) if res else None
    y = y0.clone()
    out = _call(br.OP, y, b, r)
    assert out is y and y.is_contiguous(memory_format=CL)                    # in place
    exact = y0.float() + b.float().view(1, -1, 1, 1) + (r.float() if res else 0)
    assert (y.float() - exact).abs().max().item() <= 2 ** -7 * exact.abs().max().item()   # one bf16 rounding
    stock = br.reference(y0.clone(), b, r)
    assert (y.float() - exact).abs().mean() <= (stock.float() - exact).abs().mean() + 1e-6


def test_bias_residual_check():
    y = torch.randn(1, 16, 3, 3).to(torch.bfloat16).to(DEV).contiguous(memory_format=CL)
    b = torch.randn(16).to(DEV)
    assert br.check(y, b) is None and br.check(y, b, y.clone()) is None
    assert br.check(y.contiguous(), b) is not None                 # NCHW
    assert br.check(y, b, y.contiguous()) is not None              # residual NCHW
    assert br.check(y, b[:8]) is not None


@pytest.mark.parametrize("shape", [(1, 16, 4, 4), (2, 8, 3, 4)])
def test_vae_attention_matches_reference(shape, strict):
    g = torch.Generator().manual_seed(torch.seed())
    q, k, v = ((torch.randn(shape, generator=g) * s).to(torch.bfloat16).to(DEV).contiguous(memory_format=CL)
               for s in (3.0, 3.0, 1.0))                   # peaked softmax rows
    out = _call(va.OP, q, k, v)
    assert out.shape == q.shape and out.is_contiguous(memory_format=CL) and out.dtype == torch.bfloat16
    B, C, H, W = shape
    qf, kf, vf = (t.float().reshape(B, C, H * W).transpose(1, 2) for t in (q, k, v))
    exact = torch.softmax(qf @ kf.transpose(1, 2) / C ** 0.5, -1) @ vf
    exact = exact.reshape(B, H, W, C).permute(0, 3, 1, 2)
    stock = va.reference(q, k, v).float()
    e, es = (out.float() - exact).norm() / exact.norm(), (stock - exact).norm() / exact.norm()
    assert e <= 2 * es + 2e-3, (e.item(), es.item())


UP_CASES = [
    ((1, 8, 3, 5), torch.bfloat16),     # one 16-byte column per pixel, odd H W
    ((2, 64, 4, 3), torch.bfloat16),    # 8 columns, 2 samples
    ((1, 12, 2, 7), torch.float32),     # fp32: 48 bytes per pixel
]


@pytest.mark.parametrize("shape,dt", UP_CASES)
def test_upsample_nearest2x_matches_reference(shape, dt, strict, poison):
    x = torch.randn(shape).to(dt).to(DEV).contiguous(memory_format=CL)
    y = _call(up.OP, x)
    assert y.is_contiguous(memory_format=CL) and y.shape == (shape[0], shape[1], 2 * shape[2], 2 * shape[3])
    assert torch.equal(y, F.interpolate(x, scale_factor=2.0, mode="nearest"))   # a copy: bit-exact


def test_upsample_check():
    x = torch.randn(1, 8, 3, 3).to(torch.bfloat16).to(DEV)
    assert up.check(x.contiguous(memory_format=CL)) is None
    assert up.check(x) is not None                                   # NCHW
    assert up.check(x[:, :4].contiguous(memory_format=CL)) is not None   # 8 bytes per pixel


@pytest.mark.skipif(runtime.SIMULATOR, reason="decoder shapes need a GPU (FLUX_NUMBA_REAL_GPU=1)")
@pytest.mark.parametrize("C,H", [(512, 128), (512, 256), (512, 512), (256, 512), (256, 1024), (128, 1024)])
def test_decoder_shapes_gpu(C, H, strict):
    x, w, b = _inputs((1, C, H, H), torch.bfloat16)
    y = _call(gnh.OP, x, 32, w, b, 1e-6, silu=True)
    ref = _fp32_gn(x, 32, w, b, 1e-6, True)
    stock = gnh.reference(x, 32, w, b, 1e-6, True)
    e, es = (y.float() - ref).norm() / ref.norm(), (stock.float() - ref).norm() / ref.norm()
    assert e <= 1.2 * es + 1e-4, (e.item(), es.item())
    pb = torch.randn(C, device=DEV)
    y = _call(gnh.OP, x, 32, w, b, 1e-6, silu=True, pre_bias=pb)
    ref = _fp32_gn(x.float() + pb.view(1, -1, 1, 1), 32, w, b, 1e-6, True)
    e = (y.float() - ref).norm() / ref.norm()
    assert e <= 1.2 * es + 1e-4, (e.item(), es.item())
    r = torch.randn_like(x)
    yb = x.clone()
    _call(br.OP, yb, pb, r)
    exact = x.float() + pb.view(1, -1, 1, 1) + r.float()
    assert (yb.float() - exact).abs().max().item() <= 2 ** -7 * exact.abs().max().item()
    if H == 128:   # the mid block's attention shape
        q, k, v = (torch.randn_like(x) * s for s in (2.0, 2.0, 1.0))
        out = _call(va.OP, q, k, v)
        qf, kf, vf = (t.float().reshape(1, C, -1).transpose(1, 2) for t in (q, k, v))
        exact = (torch.softmax(qf @ kf.transpose(1, 2) / C ** 0.5, -1) @ vf).reshape(1, H, H, C).permute(0, 3, 1, 2)
        stock = va.reference(q, k, v).float()
        e, es = (out.float() - exact).norm() / exact.norm(), (stock - exact).norm() / exact.norm()
        assert e <= 1.5 * es + 1e-3, (e.item(), es.item())
    if H <= 512:
        u = _call(up.OP, x)
        assert torch.equal(u, F.interpolate(x, scale_factor=2.0, mode="nearest"))


def test_plain_decoder_host_attention_is_single_head_sdpa():
    """flux_core.vae.DecoderHost (plain torch modules, no ComfyUI): the mid block's attention over
    every pixel, one head of C channels -- softmax(Q K^T / sqrt(C)) V on fresh random inputs."""
    from flux_numba_pack.flux_core.vae import DecoderHost
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 8, 3, 5, generator=g) for _ in range(3))
    got = DecoderHost().attention(None, q, k, v)
    rows = lambda t: t.flatten(2).transpose(1, 2)  # noqa: E731  [B, HW, C]
    w = torch.softmax(rows(q) @ rows(k).transpose(1, 2) / 8 ** 0.5, dim=-1)
    want = (w @ rows(v)).transpose(1, 2).reshape(2, 8, 3, 5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
