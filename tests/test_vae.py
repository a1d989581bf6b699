"""groupnorm_silu (Numba, simulator-sized shapes) and the FluxNumbaVAEPatch node.

The decoder-level test needs ComfyUI (marked ``comfyui``): tests/test_comfyui_matrix.py runs it once
per ComfyUI tree; directly: COMFYUI_PATH -> a ComfyUI tree, with an interpreter that can import it
(e.g. /work/venv-comfy/bin/python -m pytest tests/test_vae.py tests/test_vae_decoder.py); otherwise it
skips.  The decoder-level tests are in test_vae_decoder.py.
"""
import importlib
import sys

import pytest
import torch

from flux_numba_pack.cuda_kernels import registry, runtime
from flux_numba_pack.cuda_kernels import groupnorm_silu as gn

DEV = "cpu" if runtime.SIMULATOR else "cuda"


def _plan_of(decoder):
    """The DecoderPlan of a decoder the VAE patch made (its low-res graph, layout ...)."""
    from flux_numba_pack.nodes.host.vae import plan_of
    return plan_of(decoder)


@pytest.fixture(autouse=True, scope="module")
def _fast_simulator():
    # The simulator's block manager busy-polls its threads; a short GIL switch interval makes
    # every syncthreads ~100x cheaper on 2 cores.
    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(old)


@pytest.fixture
def strict():
    old = registry.strict
    registry.strict = True
    yield
    registry.strict = old


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the launcher allocates (output, partials) starts as NaN."""
    empty_like, empty = torch.empty_like, torch.empty

    def nan_like(t, *a, **k):
        return empty_like(t, *a, **k).fill_(float("nan"))

    def nan_empty(*a, **k):
        out = empty(*a, **k)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(gn.torch, "empty_like", nan_like)
    monkeypatch.setattr(gn.torch, "empty", nan_empty)


def _inputs(shape, dtype, wdtype, mean=0.0, scale=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale + mean).to(dtype)
    C = shape[1]
    w = (1 + 0.5 * torch.randn(C, generator=g)).to(wdtype)
    b = (0.5 * torch.randn(C, generator=g)).to(wdtype)
    return x.to(DEV), w.to(DEV), b.to(DEV)


def _numba(x, G, w, b, eps, silu):
    with registry.force("numba", ops=[gn.OP]):
        y = registry.call(gn.OP, x, G, w, b, eps, silu=silu)
    assert registry.last[gn.OP] == "numba"
    return y


CASES = [
    # shape,         x dtype,          w dtype,          silu   (path)
    ((2, 64, 5, 7), torch.float32, torch.float32, True),    # scalar fp32, cpg 2, odd spatial
    ((2, 96, 5, 7), torch.bfloat16, torch.bfloat16, True),  # scalar bf16, cpg 3
    ((2, 64, 4, 6), torch.bfloat16, torch.bfloat16, False),  # 8-byte vectors, bf16
    ((2, 96, 6, 6), torch.float32, torch.float32, False),   # 8-byte vectors, fp32
    ((2, 64, 8, 8), torch.bfloat16, torch.float32, True),   # bf16 x, fp32 affine params
    # main loops (>= U*TPB slots per group run / plane in the simulator), every slot width:
    ((1, 32, 16, 16), torch.bfloat16, torch.bfloat16, True),  # 16-byte slots, bf16
    ((1, 32, 8, 16), torch.float32, torch.float32, True),     # 16-byte slots, fp32
    ((1, 32, 12, 11), torch.bfloat16, torch.bfloat16, True),  # 8-byte words (H*W % 8 == 4), bf16
    ((1, 32, 6, 11), torch.float32, torch.bfloat16, False),   # 8-byte words, fp32 x, bf16 params
]


@pytest.mark.parametrize("shape,dt,wdt,silu", CASES)
def test_groupnorm_silu_matches_reference(shape, dt, wdt, silu, strict, poison):
    x, w, b = _inputs(shape, dt, wdt)
    y = _numba(x, 32, w, b, 1e-6, silu)
    ref = gn.reference(x, 32, w.to(dt), b.to(dt), 1e-6, silu)  # ComfyUI: x's dtype end to end
    assert y.dtype == dt and y.shape == x.shape
    assert not torch.isnan(y).any()
    if dt == torch.bfloat16:  # one rounding (ours) vs two (group_norm, then silu): <= ~1 ulp
        torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=1.6e-2)
    else:
        torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-5)


def test_slot_modes():
    """The shapes above reach every load/store width (16-byte, 8-byte, element)."""
    def mode(shape, dt):
        x = torch.empty(shape, dtype=dt, device=DEV)
        return gn._mode(x, shape[2] * shape[3])
    assert [mode(c[0], c[1]) for c in CASES] == [0, 0, 2, 2, 2, 2, 2, 1, 1]


def test_unaligned_view_uses_narrower_slots(strict, poison):
    """x starting 8 bytes into a buffer: 8-byte words instead of 16-byte slots; 2 bytes: elements."""
    g = torch.Generator().manual_seed(5)
    buf = torch.randn(32 * 8 * 8 + 8, generator=g).to(torch.bfloat16).to(DEV)
    w = (1 + 0.3 * torch.randn(32, generator=g)).to(torch.bfloat16).to(DEV)
    b = (0.3 * torch.randn(32, generator=g)).to(torch.bfloat16).to(DEV)
    for off, want in ((4, 1), (1, 0)):
        x = buf[off:off + 32 * 8 * 8].view(1, 32, 8, 8)
        assert gn._mode(x, 64) == want
        y = _numba(x, 32, w, b, 1e-6, True)
        ref = gn.reference(x, 32, w, b, 1e-6, True)
        assert not torch.isnan(y).any()
        torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=1.6e-2)


def test_multi_chunk_statistics(strict, poison, monkeypatch):
    """Several blocks per group (partials merged in the normalize kernel), as on the GPU."""
    monkeypatch.setattr(gn, "_chunks", lambda ng, ls, per_iter: 4)
    x, w, b = _inputs((1, 32, 8, 10), torch.bfloat16, torch.bfloat16, seed=3)
    y = _numba(x, 32, w, b, 1e-6, True)
    ref = gn.reference(x.float(), 32, w.float(), b.float(), 1e-6, True)
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=1.6e-2)


def test_large_mean_is_numerically_safe(strict, poison):
    """mean 1e4, std 1 in fp32: E[x^2]-E[x]^2 would lose the variance; Chan/Welford does not."""
    x, w, b = _inputs((2, 64, 6, 6), torch.float32, torch.float32, mean=1e4, scale=1.0, seed=1)
    y = _numba(x, 32, w, b, 1e-6, False)
    ref = gn.reference(x.double(), 32, w.double(), b.double(), 1e-6, False)
    assert (y.double() - ref).abs().max().item() < 5e-3
    # the naive single-pass formula in fp32 on the same data, for contrast
    xs = x.view(2, 32, -1)
    naive_var = (xs * xs).mean(-1) - xs.mean(-1) ** 2
    true_var = x.double().view(2, 32, -1).var(-1, unbiased=False)
    assert (naive_var.double() - true_var).abs().max().item() > 0.05


def test_check_rejects_unsupported():
    x, w, b = _inputs((1, 64, 4, 4), torch.float32, torch.float32)
    assert gn.check(x.transpose(2, 3), 32, w, b) is not None  # not contiguous
    assert gn.check(x.half(), 32, w, b) is not None
    assert gn.check(x, 32, None, b) is not None
    assert gn.check(x, 32, w, b) is None


# ------------------------------------------------------------------ node (no ComfyUI)
def _node_module():
    return importlib.import_module("flux_numba_pack.nodes.vae_patch")
