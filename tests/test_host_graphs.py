"""CUDA graphs through the host adapter, per supported ComfyUI version (split from test_host.py):
graph_state, per-block graphs following residency and equal to stock, where graphs stand down
(another node's block wrapper, ComfyUI's compiler), DynamicVRAM residency signatures, capture
headroom, checkpoint-chosen attention, re-patching, version features.
"""
import logging

import pytest
import torch

from test_comfyui import (N_BLOCKS, Patch, _inputs, comfy, forward, patch_stats, rel_err,  # noqa: F401
                          tiny_patcher, pytestmark)
from _host_testing import CASES, TINY_LATENT, _after_patch, _cond, _sample, version


# ----------------------------------------------------------------------------- graph_state (no ComfyUI)
def test_graph_state_one_pass():
    """host.graph_state: the per-step / per-decode check of a replayed CUDA graph -- weight addresses
    in module order (a replaced parameter changes them), and each reason a graph is unsafe."""
    from flux_numba_pack.nodes.host import graph_state
    m = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.ReLU(), torch.nn.GroupNorm(2, 4))
    assert graph_state(m, torch.device("cpu")) == (["not a CUDA device"], None)
    why, key = graph_state(m, torch.device("cuda", 0))   # CPU weights: "offloaded"
    assert len(why) == 1 and "not on cuda:0" in why[0] and "Conv2d.weight" in why[0]
    assert key == tuple(p.data_ptr() for p in m.parameters())
    m[2].weight = torch.nn.Parameter(m[2].weight.detach().clone())   # ComfyUI replaces a parameter
    assert graph_state(m, torch.device("cuda", 0))[1] != key
    m[1] = torch.nn.Linear(2, 2)                                     # a swapped submodule: new addresses
    assert len(graph_state(m, torch.device("cuda", 0))[1]) == len(key) + 2
    m[2]._v = object()                                       # DynamicVRAM vbar weights
    why, _ = graph_state(m, torch.device("cuda", 0))          # (the CPU weights before it are named too)
    assert len(why) == 2 and "offloaded" in why[0] and "per call" in why[1] and "GroupNorm" in why[1], why
    m[0].weight_function = [lambda w: w]                     # on-the-fly LoRA, on the first layer:
    why, _ = graph_state(m, torch.device("cuda", 0))          # the walk stops there (nothing else needed)
    assert len(why) == 1 and "per call" in why[0] and "Conv2d" in why[0], why


# ----------------------------------------------------------------------------- per-block graphs
GRAPH_CASES = ["plain", "lora_after_patch", "cfg_negative", "noise_mask", "batch2", "easycache_after_patch"]


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_block_graphs_follow_residency_and_equal_stock(comfy, monkeypatch, case):
    """Per-block graphs in ComfyUI's sampler, driven by a stand-in residency (resident, streamed every
    third call of a block, weights moved half-way) and a recording stand-in for CUDA graphs (a replay
    re-runs the captured block over the same static buffers): every state occurs -- capture, replay,
    eager on a miss, re-capture after a move -- and the samples equal stock's."""
    import flux_numba_pack.nodes.runner as patch_mod
    from test_block_graphs import Recorder
    c = CASES[case]
    calls = {}
    moved = {"after": None}

    def fake_residency(blk, device, epoch, **k):
        n = calls[id(blk)] = calls.get(id(blk), 0) + 1
        if n % 3 == 0:
            return None, "weights not resident (stand-in)", ()
        gen = 1 if moved["after"] is not None and n > moved["after"] else 0
        return ("resident", epoch, id(blk), gen), None, ()
    rec = Recorder()
    monkeypatch.setattr(patch_mod, "block_residency", fake_residency)
    monkeypatch.setattr(patch_mod, "BLOCK_CAPTURE", rec)
    mp = tiny_patcher(comfy, torch.float32)
    h, w = TINY_LATENT[1:]
    B = c.get("batch", 1)
    latent = torch.zeros(B, 16, h, w)
    kw = dict(steps=8, cfg=c.get("cfg", 1.0))
    if c.get("mask"):
        m = torch.zeros(B, 1, h * 8, w * 8)
        m[..., : h * 4, :] = 1.0
        kw["noise_mask"] = m
        latent = torch.randn(B, 16, h, w, generator=torch.Generator().manual_seed(3))
    if c.get("neg"):
        kw["neg"] = _cond(neg=True)
    stock_model, pm = _after_patch(c, mp, Patch().patch(mp, backend="torch", profile="exact", cuda_graph="auto")[0])
    stock = _sample(stock_model, latent, **kw)
    moved["after"] = 4
    got = _sample(pm, latent, **kw)
    st = patch_stats(pm)
    counts = st["block_graphs"]
    assert st["fallbacks"] == 0 and not st.get("off"), st
    assert counts["capture"] >= N_BLOCKS and counts["replay"] > 0 and counts["eager_not_resident"] > 0, counts
    assert counts["capture"] > N_BLOCKS, f"a move must re-capture: {counts}"
    assert torch.allclose(got, stock, rtol=1e-5, atol=1e-5), rel_err(got, stock)
    import comfy.patcher_extension as pe
    for cb in pm.get_all_callbacks(pe.CallbacksMP.ON_DETACH):
        cb(pm, True)  # ComfyUI unloads the model: every graph and buffer goes
    assert rec.graphs and _graphs_of(pm).entries == {} and _graphs_of(pm).buffers == {}


def _graphs_of(pm):
    from flux_numba_pack.nodes.patch import runner_of
    return runner_of(pm).graphs


def test_block_graphs_off_where_another_node_wraps_the_blocks(comfy, monkeypatch):
    """Another node's block replacement around ours may keep our outputs between calls: those calls
    run eagerly (no static buffers handed out)."""
    import flux_numba_pack.nodes.runner as patch_mod
    from test_block_graphs import Recorder
    monkeypatch.setattr(patch_mod, "block_residency", lambda blk, device, epoch, **k: (("r", id(blk)), None, ()))
    monkeypatch.setattr(patch_mod, "BLOCK_CAPTURE", Recorder())
    mp = tiny_patcher(comfy, torch.float32)
    inner = mp.clone()
    for i in range(len(inner.model.diffusion_model.double_blocks)):
        inner.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", "double_block", i)
    pm, = Patch().patch(inner, backend="torch", cuda_graph="auto")
    latent = torch.zeros(1, 16, *TINY_LATENT[1:])
    got = _sample(pm, latent, steps=4)
    assert torch.allclose(got, _sample(mp, latent, steps=4), rtol=1e-5, atol=1e-5)
    counts = patch_stats(pm)["block_graphs"]
    n_single = len(mp.model.diffusion_model.single_blocks)
    assert counts["capture"] == n_single, counts  # only the unwrapped single blocks


class _FakeVbar:
    """comfy-aimdo's ModelVBAR as the host sees it: page signatures per fault, a budget, a pin count."""
    def __init__(self, pages=8, watermark=8):
        self.offset, self.wm, self.pins, self.gen, self.full = pages * (32 << 20), watermark, 0, 0, False
        self.loaded = self.offset

    def get_watermark(self):
        return self.wm

    def loaded_size(self):
        return self.loaded


class _FakeModelVbar:
    def __init__(self):
        self.unpinned = []

    def vbar_fault(self, alloc):
        vb, off, size = alloc
        if vb.full:
            return None
        vb.pins += 1
        return bytes([vb.gen, off % 251])

    def vbar_unpin(self, alloc):
        alloc[0].pins -= 1
        self.unpinned.append(alloc)

    def vbar_signature_compare(self, a, b):
        return a is not None and b is not None and a == b


def test_block_residency_faults_each_dynamic_module_and_compares_signatures(monkeypatch):
    """DynamicVRAM modules are faulted one by one (the block's ``_v_block`` instead where ComfyUI set
    one), every fault is unpinned by ``release_pins``; the key changes when a page is re-faulted
    (eviction), is None when a fault finds no room, and weight functions / offloaded parameters
    make the block ungraphable."""
    from flux_numba_pack.nodes.host import residency as host
    fake = _FakeModelVbar()
    monkeypatch.setattr(host, "_model_vbar", lambda: fake)
    vb = _FakeVbar()
    blk = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for i, m in enumerate(blk[:2]):
        m._v = (vb, 1024 * (i + 1), 4096)
    dev = torch.device("cuda", 0)
    k1, why, pins = host.block_residency(blk, dev, "epoch")  # the LayerNorm's CPU weights: offloaded
    assert k1 is None and "offloaded" in why and not pins
    blk[2].weight, blk[2].bias = None, None
    k1, why, pins = host.block_residency(blk, dev, "epoch")
    assert why is None and len(pins) == 2 and vb.pins == 2
    host.release_pins(pins)
    assert vb.pins == 0
    k2, _, pins = host.block_residency(blk, dev, "epoch")
    host.release_pins(pins)
    assert k1 == k2
    vb.gen = 1  # pages evicted and faulted again: new signatures
    k3, _, pins = host.block_residency(blk, dev, "epoch")
    host.release_pins(pins)
    assert k3 != k2
    k4, _, pins = host.block_residency(blk, dev, "other epoch")  # a new LoRA set: a new key
    host.release_pins(pins)
    assert k4 != k3
    vb.full = True
    k5, why, pins = host.block_residency(blk, dev, "epoch")
    assert k5 is None and "not resident" in why and vb.pins == 0
    vb.full = False
    blk._v_block = (vb, 0, 8192)   # ComfyUI made the block a DynamicVRAM unit: one fault for it
    _, _, pins = host.block_residency(blk, dev, "epoch")
    assert pins == (blk._v_block,)
    host.release_pins(pins)
    blk[0].weight_function = [lambda w: w]
    k6, why, pins = host.block_residency(blk, dev, "epoch")
    assert k6 is None and "weight functions" in why and not pins
    # a module served by the fast profile's kept copy: neither faulted nor checked (its weight functions
    # went into the copy), the copies' serials are part of the key instead (_v_block is not used then)
    k7, why, pins = host.block_residency(blk, dev, "epoch", skip={id(blk[0])}, extra=(3,))
    assert why is None and pins == (blk[1]._v,) and vb.pins == 1
    host.release_pins(pins)
    k8, _, pins = host.block_residency(blk, dev, "epoch", skip={id(blk[0])}, extra=(4,))  # re-quantised
    host.release_pins(pins)
    assert k8 != k7 and vb.pins == 0


def test_vae_graph_state_under_dynamic_vram(monkeypatch):
    """The VAE decoder's low-res graph under DynamicVRAM: keyed on its weights' residency (every
    ``_v`` faulted, the faults unpinned at once: the decode's staging holds its own pins), a capture
    put off while the budget cannot hold the model; streamed weights -> eager with the reason; a
    decoder without vbar weights keeps the address check."""
    from flux_numba_pack.nodes.host import residency as host
    from flux_numba_pack.nodes.host import vae as hvae
    fake = _FakeModelVbar()
    monkeypatch.setattr(host, "_model_vbar", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (64 << 30, 141 << 30))
    vb = _FakeVbar(pages=8, watermark=8)
    dec = torch.nn.Sequential(torch.nn.Conv2d(2, 2, 1), torch.nn.GroupNorm(1, 2))
    for i, m in enumerate(dec):
        m._v = (vb, 4096 * i, 4096)
    dev = torch.device("cuda", 0)
    why, k1, can_capture = hvae._graph_state(dec, dev)
    assert why == [] and vb.pins == 0 and can_capture() is None
    assert hvae._graph_state(dec, dev)[1] == k1
    vb.gen = 1                       # pages evicted and faulted again: another key (re-capture)
    assert hvae._graph_state(dec, dev)[1] != k1
    vb.wm = 6                        # the budget no longer holds the model: replays yes, captures no
    assert "budget holds 6" in hvae._graph_state(dec, dev)[2]()
    vb.full = True
    why, key = hvae._graph_state(dec, dev)
    assert key is None and "not resident" in why[0] and vb.pins == 0
    plain = torch.nn.Conv2d(2, 2, 1)
    why, key = hvae._graph_state(plain, dev)   # CPU weights, no vbar: the address check's reasons
    assert "offloaded" in why[0]


def test_capture_headroom_refuses_streamed_weights_and_low_memory(monkeypatch):
    """No capture while the DynamicVRAM budget cannot hold the model (its weights are streamed: a
    capture's allocation could make comfy-aimdo evict pages inside it) or memory is short; a call
    that reads only part of the model (the fast profile's kept copies serve its GEMMs) needs room
    below the budget for the pages resident now."""
    from flux_numba_pack.nodes.host import residency as host
    dev = torch.device("cuda", 0)
    vb = _FakeVbar(pages=8, watermark=6)
    why = host.capture_headroom(((vb, 0, 1),), dev)
    assert why and "budget holds 6 of the model's 8" in why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (40 << 30, 80 << 30))
    vb.loaded = 6 * (32 << 20)           # streamed through the whole budget
    assert "used up by the 6 pages" in host.capture_headroom(((vb, 0, 1),), dev, partial=True)
    vb.loaded = 3 * (32 << 20)           # the pages this model's calls fault fit with room to spare
    assert host.capture_headroom(((vb, 0, 1),), dev, partial=True) is None
    vb.wm = 8
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (1 << 30, 80 << 30))
    assert "1.0 GB free" in host.capture_headroom(((vb, 0, 1),), dev)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (40 << 30, 80 << 30))
    assert host.capture_headroom(((vb, 0, 1),), dev) is None
    assert host.capture_headroom((), torch.device("cpu")) is None


def test_streamed_weights_are_those_beyond_the_vbar_watermark():
    """comfy-aimdo keeps a vbar's pages below its watermark resident and streams the rest: a module
    whose allocation ends beyond it is streamed on every call (the fast profile keeps a copy)."""
    from flux_numba_pack.nodes.host import residency as host
    vb = _FakeVbar(pages=8, watermark=4)
    vb.base_addr = 1 << 40
    page = 32 << 20
    low, high, plain = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    low._v = (vb, vb.base_addr + page, 2 * page)        # pages 1-2
    high._v = (vb, vb.base_addr + 3 * page, 2 * page)   # pages 3-4: ends beyond a watermark of 4 pages
    assert not host.streamed_weights(low) and host.streamed_weights(high) and not host.streamed_weights(plain)
    vb.wm = 8
    assert not host.streamed_weights(high)


def test_checkpoint_chosen_block_attention_is_honoured(comfy):
    """ComfyUI 0.36+ gives each FLUX block a ``comfy_attention`` module that a checkpoint can fill
    (e.g. int8 attention); a block with a chosen function runs it for its attention, as stock does."""
    import types
    import torch.nn.functional as F
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    ref = forward(mp, inp)
    calls = []

    def own(q, k, v, heads, skip_reshape=False, mask=None, transformer_options=None, **kw):
        calls.append(tuple(q.shape))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    pm, = Patch().patch(mp, backend="torch")
    dm = pm.model.diffusion_model
    blocks = list(dm.double_blocks) + list(dm.single_blocks)
    try:
        for blk in blocks:
            blk.comfy_attention = types.SimpleNamespace(function=own)
        got = forward(pm, inp)
    finally:
        for blk in blocks:
            del blk.comfy_attention
    assert len(calls) == N_BLOCKS
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), rel_err(got, ref)
    assert patch_stats(pm)["fallbacks"] == 0


def test_graphs_stand_down_while_comfys_compiler_records(comfy, monkeypatch, caplog):
    """ComfyUI 0.36+'s model compiler records a forward's allocations per thread; while it does, the
    pack captures no CUDA graph (whole-forward or per-block) and says so once."""
    import sys
    import threading
    import types
    import flux_numba_pack.nodes.runner as patch_mod
    from flux_numba_pack.nodes.host import flux as host
    from test_block_graphs import Recorder
    fake = types.SimpleNamespace(ACTIVE_MALLOC_GRAPHS={})
    real = sys.modules.get("comfy.model_prefetch")
    if real is not None:
        monkeypatch.setattr(real, "ACTIVE_MALLOC_GRAPHS", fake.ACTIVE_MALLOC_GRAPHS, raising=False)
    else:
        monkeypatch.setitem(sys.modules, "comfy.model_prefetch", fake)
    assert host.compiler_recording() is None
    rec = Recorder()
    monkeypatch.setattr(patch_mod, "block_residency", lambda blk, device, epoch, **k: (("r", id(blk)), None, ()))
    monkeypatch.setattr(patch_mod, "BLOCK_CAPTURE", rec)
    mp = tiny_patcher(comfy, torch.float32)
    pm, = Patch().patch(mp, backend="torch", cuda_graph="auto")
    latent = torch.zeros(1, 16, *TINY_LATENT[1:])
    fake.ACTIVE_MALLOC_GRAPHS[threading.get_ident()] = object()
    with caplog.at_level(logging.INFO, logger="flux_numba"):
        got = _sample(pm, latent, steps=4)
    assert "model compiler is recording" in caplog.text
    assert not rec.graphs and patch_stats(pm)["block_graphs"]["capture"] == 0
    assert torch.allclose(got, _sample(mp, latent, steps=4), rtol=1e-5, atol=1e-5)
    fake.ACTIVE_MALLOC_GRAPHS.clear()
    _sample(pm, latent, steps=4)
    assert rec.graphs, "once the recording is over the block graphs come back"


def test_repatching_reuses_the_runner_and_frees_other_fp8_copies(comfy):
    """Re-running FluxNumbaPatch with the same model and options (a workflow that alternates) reuses
    its runner -- graphs, attention choices -- and a switch frees the other runners' kept fp8 copies."""
    from flux_numba_pack.nodes.patch import runner_of
    from flux_numba_pack.flux_core import fast
    if fast.support("cpu"):
        pytest.skip(fast.support("cpu"))
    mp = tiny_patcher(comfy, torch.float32)
    latent = torch.zeros(1, 16, *TINY_LATENT[1:])
    a, = Patch().patch(mp, backend="torch", profile="fast-cached")
    _sample(a, latent)
    ra = runner_of(a)
    cache = [c for c in ra._fp8.values() if c is not None][0]
    assert cache._cache, "fast-cached keeps fp8 copies"
    a2, = Patch().patch(mp, backend="torch", profile="fast-cached")
    assert runner_of(a2) is ra and cache._cache, "same model and options: the same runner, copies kept"
    b, = Patch().patch(mp, backend="torch", profile="exact")
    assert runner_of(b) is not ra and not cache._cache, "another patch of the model runs: copies freed"
    got = _sample(Patch().patch(mp, backend="torch", profile="fast-cached")[0], latent)
    assert cache._cache and torch.isfinite(got).all()


def test_versions_features_name_what_differs(comfy, caplog):
    """host.versions: the version and what the host package adapts to, read from ComfyUI itself;
    one log line, once."""
    import logging

    from flux_numba_pack.nodes.host import versions
    f = versions.features()
    assert f["version"] == version() and f["tested"]
    if f["version"] == "0.33.0":
        assert f["block_prefetch"] and f["qk_norm"].startswith("operations.RMSNorm")
    if f["version"] == "0.8.0":
        assert not f["block_prefetch"] and f["qk_norm"].startswith("RMSNorm (.scale)")
    assert not f["model_compiler"]  # 0.36+
    assert f["attention_containers"] == (f["version"] != "0.8.0")  # v0.33 has them (MiniMax uses them)
    versions._logged.clear()
    with caplog.at_level(logging.INFO, logger="flux_numba"):
        versions.log_once()
        versions.log_once()
    lines = [r.getMessage() for r in caplog.records if "[flux_numba] ComfyUI" in r.getMessage()]
    assert len(lines) == 1 and f"ComfyUI {f['version']}" in lines[0] and "block_prefetch" in lines[0]
