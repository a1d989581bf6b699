"""The fast profile (flux_core/fast.py): block GEMMs in fp8 e4m3 with row-wise scales.

On the CPU the quantising ops run their torch references and torch's CPU ``_scaled_mm`` does the
GEMMs, so this checks the wiring and the weight cache, not speed: the fp8 forward stays within
fp8 error of the bf16-exact one, every block GEMM went through fp8, and a changed weight is
re-quantised alone.  GPU: bench.py's ``fast`` variant, bench/ops/gpu_fp8.py."""
import contextlib

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


def test_no_row_wise_scales_means_exact(monkeypatch):
    """A device whose _scaled_mm takes no row-wise scales (sm_89) gets a reason: the exact profile runs."""
    monkeypatch.setattr(fast, "_probe_row", lambda d: False)
    monkeypatch.setattr(fast, "_SUPPORT", {})
    why = fast.support("cpu")
    assert why and "row-wise" in why
    monkeypatch.setattr(fast, "_SUPPORT", {})
    monkeypatch.setattr(fast, "_probe_row", lambda d: True)
    assert fast.support("cpu") is None


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


class _Model:
    pass


@contextlib.contextmanager
def _kept_copy(device, ids):
    """(model, fast-cached runner, exact runner, its kept Fp8Weights holding one weight on ``device``),
    both runners registered for reuse (as patching the model twice leaves them), unregistered after."""
    import weakref

    from flux_numba_pack.flux_core import fast
    from flux_numba_pack.nodes import runner as P
    from flux_numba_pack.nodes.patch import options
    model = _Model()
    cached = P._Runner(options(profile="fast-cached"), weakref.ref(model), ids[0])
    exact = P._Runner(options(profile="exact"), weakref.ref(model), ids[1])
    f8 = fast.Fp8Weights(keep=True)
    lin = torch.nn.Linear(16, 8)
    f8._cache[id(lin)] = (weakref.ref(lin), ("k",), torch.zeros(8, 16), torch.ones(8))
    cached._fp8[device] = f8
    for r in (cached, exact):
        P._REUSE[P._reuse_key(model, r.plan)] = r
    try:
        yield model, cached, exact, f8
    finally:
        for r in (cached, exact):
            P._REUSE.pop(P._reuse_key(model, r.plan), None)


def test_freeing_fp8_copies_drops_the_graphs_that_read_them():
    """A fast-cached runner's kept fp8 weights are freed when another patch of the model runs
    (``_release_fp8_copies``); its CUDA graphs were captured over those copies, so they must go too
    -- a replay after the free read freed memory (an illegal address that took a v0.33 server down
    when stock / exact / fast-cached prompts alternated)."""
    from flux_numba_pack.nodes import runner as P

    class Dropped:
        def __init__(self):
            self.why = []

        def drop(self, why=""):
            self.why.append(why)

    with _kept_copy("cpu", (901, 902)) as (model, cached, exact, f8):
        cached.graphs, cached.whole = Dropped(), Dropped()
        P._release_fp8_copies(model, exact)
        assert not f8._cache
        assert cached.graphs.why and "fp8" in cached.graphs.why[0] and cached.whole.why == [""]
        cached.graphs, cached.whole = Dropped(), Dropped()
        P._release_fp8_copies(model, exact)  # nothing kept any more: the graphs stay
        assert not cached.graphs.why and not cached.whole.why


def test_unload_drops_graphs_once_and_frees_the_copies():
    """ComfyUI unloads the model: every graph dropped once (before the copies they read are freed),
    the kept fp8 copies freed."""
    class Dropped:
        def __init__(self):
            self.why = []

        def drop(self, why=""):
            self.why.append(why)

    with _kept_copy("cpu", (903, 904)) as (model, cached, exact, f8):
        cached.graphs, cached.whole = Dropped(), Dropped()
        cached.unloaded()
        assert not f8._cache
        assert cached.graphs.why == ["the model was unloaded"] and cached.whole.why == [""]


def test_fp8_copies_stay_while_their_gpu_has_room(monkeypatch):
    """Another patch of the model keeps the fast-cached copies where their GPU has at least
    ``FP8_KEEP_FREE_SHARE`` of its memory free (a switch back replays at once), and frees them below
    that, off a CUDA device, or when the driver cannot say."""
    from flux_numba_pack.nodes import runner as P
    mem = {"free": 60, "total": 100}

    def info(dev):
        if mem.get("raise"):
            raise RuntimeError("no driver")
        return mem["free"], mem["total"]
    monkeypatch.setattr(torch.cuda, "mem_get_info", info)
    from flux_numba_pack.nodes.host import memory
    monkeypatch.setattr(memory, "reserved_memory", lambda: 0)  # (a ComfyUI loaded by other tests reserves some)
    with _kept_copy("cuda:0", (903, 904)) as (model, cached, exact, f8):
        assert f8.nbytes() == 8 * 16 * 4 + 8 * 4
        P._release_fp8_copies(model, exact)
        assert f8._cache, "60% free: kept"
        mem["raise"] = True
        assert not cached.fp8_room()
        del mem["raise"]
        mem["free"] = 20
        P._release_fp8_copies(model, exact)
        assert not f8._cache, "20% free: freed"


def test_fp8_copies_weigh_the_memory_comfyui_reserves(monkeypatch):
    """``--reserve-vram`` (ComfyUI's ``extra_reserved_memory``) is not room: 60 of 100 free with 50
    reserved is 10 of 50 in ComfyUI's budget (20%), so another patch of the model frees the copies
    (an H200 started with ``--reserve-vram 118`` stands for a 24 GB card: there the physical free
    memory is large, the budget is not)."""
    import sys
    import types
    from flux_numba_pack.nodes import runner as P
    from flux_numba_pack.nodes.host import memory
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (60, 100))
    mm = types.ModuleType("comfy.model_management")
    mm.extra_reserved_memory = lambda: 50
    comfy = sys.modules.get("comfy") or types.ModuleType("comfy")
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setattr(comfy, "model_management", mm, raising=False)
    assert memory.device_room("cuda:0") == (10, 50)
    with _kept_copy("cuda:0", (905, 906)) as (model, cached, exact, f8):
        P._release_fp8_copies(model, exact)
        assert not f8._cache, "20% of ComfyUI's budget free: freed"
    mm.extra_reserved_memory = lambda: 0
    assert memory.device_room("cuda:0") == (60, 100)


class _CountingHost:
    """The plain Weights, counting how often a Linear's weights are asked for (a DynamicVRAM host
    stages them then)."""

    def __init__(self):
        from flux_numba_pack.flux_core.context import Weights
        self.base, self.asked = Weights(), []

    def __getattr__(self, name):
        return getattr(self.base, name)

    def linear(self, lin, x):
        self.asked.append(id(lin))
        return self.base.linear(lin, x)


def test_kept_copies_serve_without_asking_the_host_and_follow_the_epoch():
    """fast-cached: once kept, a block GEMM's weights (and a streamed modulation Linear's, kept as a
    plain copy where ``keep_plain`` asks) are never asked of the host again -- nothing to stage --
    until the host's weight-patch epoch changes (a LoRA); the results equal a fresh cache's."""
    m = FluxModel.from_state_dict(tiny_state_dict(seed=6))
    inp = inputs(m.cfg, B=1, h=6, w=6, Lt=5)
    mods = [b.modulation.lin for b in m.single_blocks] + [lin for b in m.double_blocks for lin in (b.img_mod.lin, b.txt_mod.lin)]
    w, host = fast.Fp8Weights(), _CountingHost()

    def run(epoch, keep_plain=frozenset(id(x) for x in mods)):
        ctx = BlockContext(fused=True, host=host, fp8=w, fp8_epoch=epoch, keep_plain=keep_plain)
        with torch.no_grad(), registry.force("torch"):
            return m(*inp, ctx)
    ref = _run(m, inp, fast.Fp8Weights())   # no plain copies: the modulation Linears called as modules
    a = run("e1")
    n_lin = m.cfg.depth * 8 + m.cfg.depth_single_blocks * 2
    assert len(host.asked) == n_lin + len(mods) and torch.allclose(a, ref, atol=1e-6)
    served, serials, plain = w.block_state("single", m.single_blocks[0], "e1", streamed=lambda lin: True)
    blk = m.single_blocks[0]
    assert served == {id(blk.linear1), id(blk.linear2), id(blk.modulation.lin)} and all(serials) and not plain
    host.asked.clear()
    assert torch.equal(run("e1"), a) and host.asked == []          # everything served from the copies
    with torch.no_grad():
        blk.modulation.lin.weight.mul_(1.25)                       # patched in place: its copy alone is redone
    b = run("e1")
    assert host.asked == [id(blk.modulation.lin)] and not torch.allclose(a, b)
    assert torch.allclose(b, _run(m, inp, fast.Fp8Weights()), atol=1e-6)
    host.asked.clear()
    c = run("e2")                                                  # a new weight-patch epoch (a LoRA): all again
    assert len(host.asked) == n_lin + len(mods) and torch.equal(b, c)
    assert w.block_state("single", blk, "e1")[1] == (0, 0, 0)       # old epoch: no current copy
    with torch.no_grad():
        blk.modulation.lin.weight.div_(1.25)
