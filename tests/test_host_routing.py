"""The host adapter's routing in ComfyUI's sampler, per supported ComfyUI version (split from
test_host.py): DynamicVRAM staging of blocks (comfy's block prefetch), the attention route
(measured SDPA only for ComfyUI's plain SDPA, overrides through ComfyUI), and conditioning moved
to the GPU once (comfy's sampler wrapper).
"""
import logging

import pytest
import torch

from test_comfyui import (N_BLOCKS, Patch, _inputs, comfy, forward, patch_stats, rel_err,  # noqa: F401
                          tiny_patcher, pytestmark)
from _host_testing import TINY_LATENT, _cond, _sample, version


# ----------------------------------------------------------------------------- DynamicVRAM staging
def _fake_prefetch(monkeypatch, resident=True):
    """Record ComfyUI's block-prefetch calls (the real ones need comfy-aimdo vbars on a GPU); a pop
    that stages leaves ``_prefetch`` on each vbar module as ComfyUI's does (``resident`` or not)."""
    import comfy.model_prefetch as mpf
    log_ = []

    def make(blocks, device, topts):
        log_.append(("make", tuple(blocks), topts.get("prefetch_dynamic_vbars")))
        return [None] + list(blocks) + [None]

    def pop(queue, device, module, **k):
        log_.append(("pop", queue[1] if len(queue) > 1 else None) + ((k["dtype"],) if k.get("dtype") else ()))
        queue.pop(0)
        if queue and queue[0] is not None:
            roots = queue[0] if isinstance(queue[0], tuple) else (queue[0],)
            for r in roots:
                for m in r.modules():
                    if hasattr(m, "_v"):
                        m._prefetch = {"resident": resident}
    monkeypatch.setattr(mpf, "make_prefetch_queue", make)
    monkeypatch.setattr(mpf, "prefetch_queue_pop", pop)
    return log_


def test_staged_block_uses_comfy_block_prefetch(comfy, monkeypatch):
    """DynamicVRAM: a block's weights are staged at once through ComfyUI's own prefetch queue and
    released on exit, also when the block raises; nothing happens for non-dynamic blocks or hosts
    without the prefetch queue (v0.8.0).  Staged: whether every weight is resident (a capture's
    preparation also resolves them first: ``dtype``); modules in ``skip`` (Linears served by the
    fast profile's kept fp8 copy) are left unstaged."""
    from flux_numba_pack.nodes.host import dynamic_block, staged_block
    mp = tiny_patcher(comfy)
    blk = mp.model.diffusion_model.double_blocks[0]
    assert not dynamic_block(blk)
    try:
        import comfy.model_prefetch  # noqa: F401
    except ImportError:  # v0.8.0: no prefetch queue, staging is a no-op
        with staged_block(blk, torch.device("cpu"), True) as on:
            assert on is None
        return
    calls = _fake_prefetch(monkeypatch)
    with staged_block(blk, torch.device("cpu"), False) as on:
        assert on is None
    assert calls == []
    with staged_block(blk, torch.device("cpu"), True) as on:  # no vbar weights under it: nothing to stage
        assert on is True
    assert calls == []
    lins = [blk.img_attn.qkv, blk.img_mod.lin, blk.txt_mlp[0]]
    for i, m in enumerate(lins):
        m._v = ("vbar", i, 1)
    try:
        with staged_block(blk, torch.device("cpu"), True) as on:
            assert on is True and calls == [("make", (blk,), True), ("pop", blk)]
        assert calls[-1] == ("pop", None) and len(calls) == 3
        with pytest.raises(RuntimeError):
            with staged_block(blk, torch.device("cpu"), True):
                raise RuntimeError("inside the block")
        assert len(calls) == 6 and calls[-1] == ("pop", None)
        calls.clear()
        with staged_block(blk, torch.device("cpu"), True, dtype=torch.bfloat16, skip={id(lins[0])}) as on:
            assert on is True
        assert calls[0] == ("make", ((lins[1], lins[2]),), True)
        assert calls[1] == ("pop", (lins[1], lins[2]), torch.bfloat16)
        calls[:] = _fake_prefetch(monkeypatch, resident=False)
        with staged_block(blk, torch.device("cpu"), True, dtype=torch.bfloat16) as on:
            assert on is False  # a weight not resident after staging: a capture now would record its copy
    finally:
        for m in lins:
            del m._v
            m.__dict__.pop("_prefetch", None)


def test_patched_dynamic_blocks_are_staged_per_call(comfy, monkeypatch):
    """With DynamicVRAM weights every fused block call is staged once (and the result equals stock)."""
    try:
        import comfy.model_prefetch  # noqa: F401
    except ImportError:
        pytest.skip(f"ComfyUI {version()} has no block prefetch queue (staging is v0.33+)")
    import flux_numba_pack.nodes.runner as patch_mod
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    ref = forward(mp, inp)
    calls = _fake_prefetch(monkeypatch)
    monkeypatch.setattr(patch_mod, "dynamic_block", lambda blk: True)
    dm = mp.model.diffusion_model
    vmods = [m for blk in list(dm.double_blocks) + list(dm.single_blocks) for m in blk.modules()
             if isinstance(m, torch.nn.Linear)]
    for i, m in enumerate(vmods):  # what DynamicVRAM leaves on its weights (ComfyUI's CPU cast path reads around it)
        m._v = ("vbar", i, 1)
    pm, = Patch().patch(mp, backend="torch")
    try:
        got = forward(pm, inp)
    finally:
        for m in vmods:
            del m._v
            m.__dict__.pop("_prefetch", None)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), rel_err(got, ref)
    st = patch_stats(pm)
    assert st["fallbacks"] == 0 and st["calls"] == N_BLOCKS
    assert sum(1 for c in calls if c[0] == "make") == N_BLOCKS
    assert sum(1 for c in calls if c[0] == "pop") == 2 * N_BLOCKS


# ----------------------------------------------------------------------------- attention route
def _runner(attention="auto", backend="auto"):
    from flux_numba_pack.nodes import runner as patch_mod
    opts = {"profile": "exact", "route_norms": True, "attention": attention, "backend": backend, "cuda_graph": "off"}
    return patch_mod._Runner(opts, None, 10_000)


def test_attention_auto_runs_measured_sdpa_only_for_comfys_plain_sdpa(comfy, monkeypatch):
    """attention auto, SDPA measured fastest: with ComfyUI's plain SDPA path the registry's SDPA runs
    (torch's backend order, what was measured); with a user's own attention choice ComfyUI's is called."""
    import comfy.ldm.flux.math as fm
    from comfy.ldm.modules import attention as ca
    from flux_numba_pack.nodes.host import default_sdpa_attention
    sig = ("double", (1, 4, 8))
    monkeypatch.setattr(fm, "optimized_attention", ca.attention_pytorch)
    assert default_sdpa_attention()
    r = _runner()
    r.attn_choice[sig] = "cudnn"
    assert r._attention({}, sig) is None  # BlockContext calls the registry op (policy: the measured backend)
    q = torch.randn(1, 2, 4, 8)
    first = _runner()._attention({}, sig)  # first call of a signature: the registry chooses (CPU: the reference)
    assert torch.allclose(first(q, q, q, None), torch.nn.functional.scaled_dot_product_attention(q, q, q)
                          .transpose(1, 2).reshape(1, 4, 16), atol=1e-5)
    monkeypatch.setattr(fm, "optimized_attention", ca.attention_basic)  # e.g. a user's --use-split / other choice
    assert not default_sdpa_attention()
    r = _runner()
    r.attn_choice[sig] = "cudnn"
    f = r._attention({}, sig)
    assert f is not None
    assert torch.allclose(f(q, q, q, None), torch.nn.functional.scaled_dot_product_attention(q, q, q)
                          .transpose(1, 2).reshape(1, 4, 16), atol=1e-5)


def test_attention_override_goes_through_comfy(comfy, caplog):
    """Another node's transformer_options['optimized_attention_override'] is applied (ComfyUI's
    attention is called, which obeys it), even where the pack's kernel would run, with one log line."""
    seen = []

    def override(func, q, k, v, heads, **kw):
        seen.append(heads)
        return func(q, k, v, heads, **kw)
    topts = {"optimized_attention_override": override}
    q = torch.randn(1, 2, 4, 8)
    for attention in ("auto", "numba-bf16"):
        r = _runner(attention=attention)
        with caplog.at_level(logging.INFO, logger="flux_numba"):
            f = r._attention(topts, ("single", (1, 4, 8)))
        assert f is not None
        out = f(q, q, q, None)
        assert out.shape == (1, 4, 16)
    if "optimized_attention_override" in open(__import__("comfy.ldm.modules.attention", fromlist=["x"]).__file__).read():
        assert seen == [2, 2]  # the host's wrapper applied the override (v0.33)
    assert "optimized_attention_override" in caplog.text


# ----------------------------------------------------------------------------- conditioning on the GPU
def test_conds_to_device_moves_plain_tensor_conds_once_and_mutates_nothing(comfy):
    """``host.conds_to_device``: ComfyUI's plain tensor conditions (context, pooled vector, guidance,
    list conds) get their tensors on the device -- one copy per source tensor, the same class --
    while constants, other nodes' condition classes and the caller's dicts are left as they were."""
    import comfy.conds as cc
    from flux_numba_pack.nodes.host import conds_to_device

    class Other(cc.CONDRegular):  # another node's subclass may hold more state: left alone
        pass
    ctx = torch.randn(1, 5, 8)
    pooled = torch.randn(1, 4)
    mc = {"c_crossattn": cc.CONDCrossAttn(ctx), "y": cc.CONDRegular(pooled), "guidance": cc.CONDRegular(torch.tensor([3.5])),
          "lst": cc.CONDList([ctx, pooled]), "const": cc.CONDConstant(7), "other": Other(torch.ones(2))}
    pos = {"model_conds": mc, "strength": 1.0}
    neg = {"model_conds": {"c_crossattn": mc["c_crossattn"]}}  # shared with the positive: one copy

    class Guider:
        conds = {"positive": [pos], "negative": [neg]}
    g = Guider()
    n = conds_to_device(g, torch.device("meta"))
    assert n == 5
    new = g.conds["positive"][0]["model_conds"]
    assert g.conds["positive"][0] is not pos and pos["model_conds"] is mc and mc["y"].cond is pooled, "the caller's dicts stay as they were"
    for k in ("c_crossattn", "y", "guidance"):
        assert type(new[k]) is type(mc[k]) and new[k].cond.device.type == "meta" and new[k].cond.shape == mc[k].cond.shape
    assert [t.device.type for t in new["lst"].cond] == ["meta", "meta"]
    assert new["const"] is mc["const"] and new["other"] is mc["other"]
    assert g.conds["negative"][0]["model_conds"]["c_crossattn"].cond is new["c_crossattn"].cond, "one copy per source tensor"
    assert g.conds["positive"][0]["strength"] == 1.0
    assert conds_to_device(g, torch.device("meta")) == 0, "already moved: nothing more to do"


def test_conds_wrapper_runs_inside_comfys_sampler_and_changes_nothing(comfy, monkeypatch):
    """The patch installs a SAMPLER_SAMPLE wrapper that moves the processed conds (here: to the CPU
    itself, the same code path) before the sampler runs: it sees ComfyUI's processed conds in both
    versions, and the result equals stock's, with CFG and a negative too."""
    from flux_numba_pack.nodes.host import wrappers
    monkeypatch.setattr(wrappers, "CONDS_DEVICE_TYPES", ("cuda", "cpu"))
    calls = []
    orig = wrappers.conds_to_device

    def spy(guider, device):
        n = orig(guider, device)
        calls.append(n)
        return n
    monkeypatch.setattr(wrappers, "conds_to_device", spy)
    mp = tiny_patcher(comfy)
    latent = torch.zeros(1, *TINY_LATENT)
    for kw in (dict(), dict(cfg=2.0, neg=_cond(neg=True))):
        stock = _sample(mp, latent, **kw)
        pm, = Patch().patch(mp, backend="torch", profile="exact")
        assert pm.model_options["transformer_options"]["flux_numba"]["conds_on_device"] is True
        got = _sample(pm, latent, **kw)
        assert calls and calls[-1] >= 3, calls  # context, pooled vector, guidance (and the negative's)
        assert torch.allclose(got, stock, rtol=1e-5, atol=1e-5), rel_err(got, stock)


def test_run_innermost_keeps_working_where_the_chain_cannot_be_rebuilt():
    """An executor this code cannot rebuild (another ComfyUI's constructor): the wrapper's work runs
    where it stands, nothing raised -- the model still runs (its graph stays off, with the reason)."""
    from flux_numba_pack.nodes.host import wrappers as W

    class Odd:
        def __init__(self, original, class_obj, wrappers, idx, extra_required):
            pass
    ex = Odd.__new__(Odd)
    ex.original, ex.class_obj, ex.wrappers, ex.idx = (lambda *a: "model"), None, ["ours", "inner"], 0
    assert W.inner_wrappers(ex) == ["inner"]
    assert W.run_innermost(ex, lambda executor, *a: ("fn", executor is ex, a), 1, 2) == ("fn", True, (1, 2))
