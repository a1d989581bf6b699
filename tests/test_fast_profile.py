"""The fast profile (flux_core/fast.py): block GEMMs in fp8 e4m3 with row-wise scales.

On the CPU the quantising ops run their torch references and torch's CPU ``_scaled_mm`` does the
GEMMs, so this checks the wiring and the weight cache, not speed: the fp8 forward stays within
fp8 error of the bf16-exact one, every block GEMM went through fp8, and a changed weight is
re-quantised alone.  GPU: bench.py's ``fast`` variant, bench/gpu_fp8.py."""
import pytest
import torch

from flux_numba_pack.flux_core import BlockContext, FluxModel, tiny_state_dict
from flux_numba_pack.flux_core import fast
from flux_numba_pack.cuda_kernels import registry

from test_flux_core import inputs

pytestmark = pytest.mark.skipif(fast.support("cpu") is not None, reason=str(fast.support("cpu")))


def _run(m, inp, fp8=None):
    ctx = BlockContext(fused=True)
    ctx.fp8 = fp8
    with torch.no_grad(), registry.force("torch"):
        return m(*inp, ctx)


def test_fast_forward_close_to_exact_and_every_gemm_in_fp8(monkeypatch):
    m = FluxModel.from_state_dict(tiny_state_dict(seed=3))
    inp = inputs(m.cfg, B=2, h=8, w=6, Lt=7)
    calls = []
    real = fast.scaled_mm
    monkeypatch.setattr(fast, "scaled_mm", lambda *a, **k: calls.append(a[2].shape) or real(*a, **k))
    exact = _run(m, inp)
    w = fast.Fp8Weights()
    got = _run(m, inp, w)
    rel = ((got - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.08, rel  # fp8 e4m3 (3 mantissa bits) through 4 blocks; 0 would mean fp8 never ran
    per_double, per_single = 8, 2
    assert len(calls) == m.cfg.depth * per_double + m.cfg.depth_single_blocks * per_single
    n = len(calls)
    assert w.quantised == n  # each weight quantised once
    _run(m, inp, w)
    assert w.quantised == n and len(calls) == 2 * n  # and cached


def test_changed_weight_requantised_alone():
    m = FluxModel.from_state_dict(tiny_state_dict(seed=4))
    inp = inputs(m.cfg, B=1)
    w = fast.Fp8Weights()
    a = _run(m, inp, w)
    n = w.quantised
    with torch.no_grad():
        m.single_blocks[0].linear2.weight.mul_(1.5)  # an in-place patch (as ComfyUI applies a LoRA)
    b = _run(m, inp, w)
    assert w.quantised == n + 1
    assert not torch.allclose(a, b)
    with torch.no_grad():
        m.single_blocks[0].linear2.weight.div_(1.5)
    c = _run(m, inp, fast.Fp8Weights())  # fresh cache on the restored weights
    assert torch.allclose(_run(m, inp, w), c, atol=1e-6)


def test_outlier_channels_keep_quality():
    """Activations with a few channels 30x larger (as real DiTs have): per-token scales must not
    collapse the other channels."""
    from flux_numba_pack.cuda_kernels import fp8_format
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    x[:, :4] *= 30
    wt = torch.randn(128, 256, generator=g) * 0.02
    xq, xs = fp8_format.quantize_rows_reference(x)
    wq, ws = fp8_format.quantize_rows_reference(wt)
    y = fast.scaled_mm(xq, xs, wq, ws.reshape(1, -1), None, torch.float32)
    ref = x @ wt.t()
    snr = 10 * torch.log10(ref.pow(2).mean() / (y - ref).pow(2).mean())
    assert snr > 25, snr  # e4m3 per-token / per-channel: ~30 dB on this stress case


def test_support_reasons():
    assert fast.support("cpu") is None
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability()
        assert (fast.support("cuda") is None) == (cc >= (9, 0))
