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


def test_per_step_weights_equal_cached_and_hold_nothing(monkeypatch):
    """keep=False (profile fast): the weights are quantised on every call by the quantize_fp8 op
    (one row per output channel) -- the same operands as the cache's, nothing kept."""
    m = FluxModel.from_state_dict(tiny_state_dict(seed=5))
    inp = inputs(m.cfg, B=1, h=6, w=8, Lt=5)
    cached = _run(m, inp, fast.Fp8Weights(keep=True))
    ops = []
    real = registry.call
    monkeypatch.setattr(registry, "call", lambda name, *a, **k: ops.append(name) or real(name, *a, **k))
    w = fast.Fp8Weights(keep=False)
    a = _run(m, inp, w)
    n = ops.count("quantize_fp8")
    b = _run(m, inp, w)
    assert torch.equal(a, cached) and torch.equal(a, b)
    per_double_weights = 8 + 2  # + the attention outputs' quantize_fp8 (img, txt)
    assert n == m.cfg.depth * per_double_weights + m.cfg.depth_single_blocks * 2
    assert ops.count("quantize_fp8") == 2 * n and w.quantised == 0 and not w._cache


def test_tensor_wise_scaling_matches_row_wise(monkeypatch):
    """sm_89's path (tensor-wise scales only): unit-scale GEMM, then the row / channel scales and the
    bias on its output -- the same result as row-wise scales in the epilogue, to bf16 rounding."""
    if not fast._probe(torch.device("cpu"), "tensor"):
        pytest.skip("this torch's CPU _scaled_mm takes no tensor-wise scales")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g).bfloat16()
    w = torch.randn(48, 64, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    xq, xs = registry.call("quantize_fp8", x)
    wq, ws = registry.call("quantize_fp8", w)
    monkeypatch.setitem(fast._MODES, torch.device("cpu"), "row")
    row = fast.scaled_mm(xq, xs, wq, ws.view(1, -1), b)
    monkeypatch.setitem(fast._MODES, torch.device("cpu"), "tensor")
    ten = fast.scaled_mm(xq, xs, wq, ws.view(1, -1), b)
    ref = (xq.float() * xs) @ (wq.float() * ws).t() + b.float()
    for got in (row, ten):
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
    m = FluxModel.from_state_dict(tiny_state_dict(seed=6))
    inp = inputs(m.cfg, B=1)
    a = _run(m, inp, fast.Fp8Weights())
    monkeypatch.setitem(fast._MODES, torch.device("cpu"), "row")
    c = _run(m, inp, fast.Fp8Weights())
    assert ((a - c).norm() / c.norm()).item() < 2e-2


def test_tensor_wise_only_device_runs_exact_unless_asked(monkeypatch):
    """A GPU whose _scaled_mm takes no row-wise scales gets a reason (the exact profile runs) that
    names the opt-in knob; with FLUX_NUMBA_FP8_SCALING=tensor it gets the tensor-wise path."""
    dev = torch.device("cpu")
    monkeypatch.setattr(fast, "_probe", lambda d, mode: mode == "tensor")
    monkeypatch.setattr(fast, "_MODES", {})
    why = fast.support(dev)
    assert why and "FLUX_NUMBA_FP8_SCALING=tensor" in why
    monkeypatch.setattr(fast, "_MODES", {})
    monkeypatch.setattr(fast, "SCALING", "tensor")
    assert fast.support(dev) is None and fast.scaling_mode(dev) == "tensor"


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
