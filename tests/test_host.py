"""The ComfyUI host adapter (nodes/host/) and the patched model in ComfyUI's own sampler, per
supported ComfyUI version (the tree at $COMFYUI_PATH; test_comfyui_matrix runs this per tree).

* the adapter resolves every weight a fused block needs, the way ComfyUI's ops do (q/k norm
  scales and their epsilon, the up-projection weights), for plain, per-call cast (low-VRAM /
  DynamicVRAM style) and weight-function (on-the-fly LoRA) modules;
* sampling through ``nodes.common_ksampler`` with the pack's torch path equals stock and the pack's
  block code ran for every block (no fallback): plain, LoRA before / after the patch, CFG > 1 with
  a negative, img2img, latent noise mask, fp8 weight storage, batch 2, non-square and
  non-multiple-of-64 sizes, EasyCache / LazyCache after the patch;
* host features the fused path does not run (attn1_patch / attn1_output_patch, Kontext
  modulation_dims) make that call run stock with one logged reason.
"""
import logging

import pytest
import torch

from test_comfyui import (N_BLOCKS, Patch, _inputs, comfy, forward, patch_stats, rel_err,  # noqa: F401
                          tiny_patcher, pytestmark)

TINY_LATENT = (16, 8, 8)


def version():
    from flux_numba_pack.nodes.host import comfy_version
    return comfy_version()


# ----------------------------------------------------------------------------- the adapter
def _norms(dm):
    for blk in dm.double_blocks:
        for attn in (blk.img_attn, blk.txt_attn):
            yield attn.norm.query_norm
            yield attn.norm.key_norm
    for blk in dm.single_blocks:
        yield blk.norm.query_norm
        yield blk.norm.key_norm


def test_adapter_resolves_every_fused_block_weight(comfy):
    from flux_numba_pack.nodes.host import ComfyWeights, block_problem
    mp = tiny_patcher(comfy)
    dm = mp.model.diffusion_model
    for kind in ("double", "single"):
        for blk in getattr(dm, f"{kind}_blocks"):
            assert block_problem(kind, blk) is None
    like = torch.zeros(1, 2, 3 * 128, dtype=torch.bfloat16)
    w = ComfyWeights()
    for m in _norms(dm):
        (p,) = list(m.parameters(recurse=False))
        got = w.norm(m, like)
        assert got.dtype == torch.bfloat16 and got.shape == p.shape
        assert torch.equal(got, p.to(torch.bfloat16))
        eps = w.norm_eps(m, like)
        if isinstance(m, torch.nn.RMSNorm):  # v0.33: operations.RMSNorm, eps None -> dtype epsilon
            assert eps == (m.eps if m.eps is not None else torch.finfo(torch.bfloat16).eps)
        else:  # v0.8.0: flux layers.RMSNorm, 1e-6 in its forward
            assert eps == 1e-6
    x = torch.zeros(1, 2, 128)
    for blk in dm.double_blocks:
        for mlp in (blk.img_mlp, blk.txt_mlp):
            wb = w.linear(mlp[0], x)
            assert wb is not None and wb[0] is mlp[0].weight and wb[1] is mlp[0].bias
    w.release()


def test_adapter_casts_through_comfy_ops(comfy, monkeypatch):
    """Modules that cast per call (low-VRAM / DynamicVRAM) or carry weight functions (on-the-fly
    LoRA) get their weights from comfy.ops.cast_bias_weight, handed back by release()."""
    import comfy.ops
    from flux_numba_pack.nodes.host import ComfyWeights
    mp = tiny_patcher(comfy)
    dm = mp.model.diffusion_model
    casts, uncasts = [], []
    real_cast, real_uncast = comfy.ops.cast_bias_weight, comfy.ops.uncast_bias_weight

    def cast(s, *a, **k):
        casts.append(s)
        return real_cast(s, *a, **k)

    def uncast(s, *a, **k):
        uncasts.append(s)
        return real_uncast(s, *a, **k)
    monkeypatch.setattr(comfy.ops, "cast_bias_weight", cast)
    monkeypatch.setattr(comfy.ops, "uncast_bias_weight", uncast)
    lin = dm.double_blocks[0].img_mlp[0]
    monkeypatch.setattr(lin, "comfy_cast_weights", True, raising=False)
    w = ComfyWeights()
    x = torch.zeros(1, 2, lin.in_features)
    wb = w.linear(lin, x)
    assert casts == [lin] and wb is not None and torch.equal(wb[0], lin.weight)
    qn = dm.double_blocks[0].img_attn.norm.query_norm
    like = torch.zeros(1, 2, 3 * 128)
    if isinstance(qn, comfy.ops.CastWeightBiasOp):  # v0.33: the norm is one of ComfyUI's ops
        monkeypatch.setattr(qn, "weight_function", [lambda t: t * 2.0], raising=False)
        got = w.norm(qn, like)
        assert casts[-1] is qn and torch.equal(got, qn.weight * 2.0)
    w.release()
    assert uncasts == casts


def test_call_problem_names_what_the_fused_path_does_not_run(comfy, caplog):
    from flux_numba_pack.nodes.host import call_problem
    assert call_problem({"transformer_options": {}}, {"original_block": lambda a: a}) is None
    why = call_problem({"transformer_options": {"patches": {"attn1_patch": [lambda *a, **k: {}]}}}, {})
    assert "attn1_patch" in why
    why = call_problem({"transformer_options": {"patches": {"attn1_output_patch": [lambda a, e: a]}}}, {})
    assert "attn1_output_patch" in why
    extra_kwargs = {"modulation_dims_img": [(0, 4, 0)]}

    def block_wrap(args):  # like forward_orig's: the block and its extra kwargs are closure cells
        return extra_kwargs
    assert "modulation_dims" in call_problem({}, {"original_block": block_wrap})
    extra_kwargs = {}
    assert call_problem({}, {"original_block": block_wrap}) is None


def test_attn1_patches_run_stock_with_a_reason(comfy, caplog):
    """A model with an attn1_output_patch (what NAG / FluxKVCache-style nodes add): the patched
    model gives stock's result, every block ran ComfyUI's original, one log line says why."""
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    seen = []

    def out_patch(attn, extra_options):
        seen.append(1)
        return attn * 0.5
    m2 = mp.clone()
    m2.set_model_patch(out_patch, "attn1_output_patch")
    ref = forward(m2, inp)
    applied = len(seen)
    pm, = Patch().patch(m2, backend="torch")
    with caplog.at_level(logging.WARNING, logger="flux_numba"):
        out = forward(pm, inp)
    st = patch_stats(pm)
    if applied == 0:
        pytest.skip(f"ComfyUI {version()}'s FLUX blocks do not apply attn1_output_patch")
    assert torch.equal(out, ref) and len(seen) == 2 * applied
    assert st["fallbacks"] == N_BLOCKS and st["calls"] == 0, st
    assert caplog.text.count("attn1_output_patch") == 2  # once per block kind


# ----------------------------------------------------------------------------- sampling matrix
def _cond(B=1, txt=5, seed=3, neg=False):
    from flux_numba_pack.flux_core import TINY
    g = torch.Generator().manual_seed(seed + (100 if neg else 0))
    ctx = torch.randn(B, txt, TINY.context_in_dim, generator=g)
    pooled = torch.randn(B, TINY.vec_in_dim, generator=g)
    extra = {"pooled_output": pooled}
    if not neg:
        extra["guidance"] = 3.5
    return [[ctx, extra]]


def _sample(mp, latent, steps=2, cfg=1.0, denoise=1.0, noise_mask=None, neg=None, seed=7):
    import nodes
    pos = _cond()
    if neg is None:
        neg = [[torch.zeros_like(pos[0][0]), {"pooled_output": torch.zeros_like(pos[0][1]["pooled_output"])}]]
    lat = {"samples": latent}
    if noise_mask is not None:
        lat["noise_mask"] = noise_mask
    with torch.inference_mode():
        out, = nodes.common_ksampler(mp, seed, steps, cfg, "euler", "simple", pos, neg, lat, denoise=denoise)
    return out["samples"]


def _lora_patches(mp, scale=0.5, seed=5):
    import comfy.utils as cu
    g = torch.Generator().manual_seed(seed)
    names = [n for n, _ in mp.model.named_parameters()
             if n.startswith("diffusion_model.double_blocks.0.img_mlp.0.weight")
             or n.startswith("diffusion_model.single_blocks.1.linear1.weight")
             or n.startswith("diffusion_model.double_blocks.1.txt_attn.norm.key_norm.")]
    assert len(names) == 3, names
    return {k: (scale * torch.randn(cu.get_attr(mp.model, k).shape, generator=g),) for k in names}


def _easycache(mp, kind):
    import asyncio
    from comfy_extras import nodes_easycache as ec
    node = {"EasyCache": ec.EasyCacheNode, "LazyCache": ec.LazyCacheNode}[kind]
    res = node.execute(mp, 0.2, 0.15, 0.95, False)
    if asyncio.iscoroutine(res):
        res = asyncio.run(res)
    out = getattr(res, "result", res)
    return out[0]


CASES = {
    "plain": dict(),
    "lora_before_patch": dict(lora="before"),
    "lora_after_patch": dict(lora="after"),
    "cfg_negative": dict(cfg=3.0, neg=True),
    "img2img": dict(denoise=0.6, init=True),
    "noise_mask": dict(mask=True, init=True),
    "fp8_weights": dict(fp8=True),
    "batch2": dict(batch=2),
    "non_square": dict(hw=(8, 12)),
    "non_multiple_of_64": dict(hw=(6, 10)),  # 48x80 px: neither side a multiple of 64 (nor of 16 latents)
    "easycache_after_patch": dict(cache="EasyCache"),
    "lazycache_after_patch": dict(cache="LazyCache"),
}


def _after_patch(c, mp, pm):
    """(stock model, patched model) of a CASES entry: a LoRA added after the patch to both, a cache
    node after both."""
    stock_model = mp
    if c.get("lora") == "after":
        patches = _lora_patches(mp)
        stock_model = mp.clone()
        stock_model.add_patches(patches, 1.0)
        pm = pm.clone()
        pm.add_patches(patches, 1.0)
    if c.get("cache"):
        stock_model = _easycache(stock_model, c["cache"])
        pm = _easycache(pm, c["cache"])
    return stock_model, pm


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_runs_the_pack_and_equals_stock(comfy, case):
    c = CASES[case]
    dtype = torch.float32
    if c.get("fp8"):
        mp = _fp8_stored_patcher(comfy)
        assert any(p.dtype == torch.float8_e4m3fn for p in mp.model.diffusion_model.parameters())
    else:
        mp = tiny_patcher(comfy, dtype)
    h, w = c.get("hw", TINY_LATENT[1:])
    B = c.get("batch", 1)
    g = torch.Generator().manual_seed(11)
    latent = torch.randn(B, 16, h, w, generator=g) if c.get("init") else torch.zeros(B, 16, h, w)
    kw = dict(steps=2, cfg=c.get("cfg", 1.0), denoise=c.get("denoise", 1.0))
    if c.get("mask"):
        m = torch.zeros(B, 1, h * 8, w * 8)
        m[..., : h * 4, :] = 1.0
        kw["noise_mask"] = m
    if c.get("neg"):
        kw["neg"] = _cond(neg=True)
    if c.get("lora") == "before":
        mp = mp.clone()
        mp.add_patches(_lora_patches(mp), 1.0)
    stock_model, pm = _after_patch(c, mp, Patch().patch(mp, backend="torch", profile="exact")[0])
    stock = _sample(stock_model, latent, **kw)
    got = _sample(pm, latent, **kw)
    st = patch_stats(pm)
    assert st["fallbacks"] == 0 and not st.get("off") and st["calls"] >= 2 * N_BLOCKS, st
    tol = 5e-4 if c.get("fp8") else 1e-5
    assert torch.allclose(got, stock, rtol=tol, atol=tol), rel_err(got, stock)
    if c.get("lora"):
        assert rel_err(stock, _sample(tiny_patcher(comfy, dtype) if not c.get("fp8") else mp, latent, **kw)) > 1e-4, \
            "the LoRA patch must change the result"


def test_cache_wrappers_run_outside_the_whole_forward_graph(comfy, monkeypatch):
    """EasyCache added after the patch: its DIFFUSION_MODEL wrapper (host-side ``.item()`` reads, a
    per-step decision whether the model runs at all) runs first, and the pack's whole-forward graph
    wrapper innermost -- around the model's own forward, with no wrapper left inside it to capture --
    on every step EasyCache lets through; samples equal stock + EasyCache."""
    from comfy_extras import nodes_easycache as ec
    from flux_numba_pack.nodes import cuda_graph
    from flux_numba_pack.nodes.host import inner_wrappers
    order, inside = [], []
    ec_orig, ours_orig = ec.easycache_forward_wrapper, cuda_graph.GraphWrapper._graphed

    def ec_spy(executor, *a, **k):
        order.append("easycache")
        return ec_orig(executor, *a, **k)

    def ours_spy(self, executor, *a, **k):
        order.append("graph")
        inside.append(inner_wrappers(executor))
        return ours_orig(self, executor, *a, **k)
    monkeypatch.setattr(ec, "easycache_forward_wrapper", ec_spy)
    monkeypatch.setattr(cuda_graph.GraphWrapper, "_graphed", ours_spy)
    mp = tiny_patcher(comfy, torch.float32)
    pm, = Patch().patch(mp, backend="torch", profile="exact", cuda_graph="auto")
    import comfy.patcher_extension as pe
    (w,) = pm.get_wrappers(pe.WrappersMP.DIFFUSION_MODEL, cuda_graph.KEY)
    stock_model, pm = _after_patch(CASES["easycache_after_patch"], mp, pm)
    latent = torch.zeros(1, 16, *TINY_LATENT[1:])
    stock = _sample(stock_model, latent, steps=6)
    order.clear()
    got = _sample(pm, latent, steps=6)
    assert torch.allclose(got, stock, rtol=1e-5, atol=1e-5), rel_err(got, stock)
    assert inside and all(i == [] for i in inside), inside
    assert order[0] == "easycache" and all(order[i - 1] == "easycache" for i, o in enumerate(order) if o == "graph"), order
    assert w.stats.get("innermost") == len(inside)
    assert "wrappers run inside" not in (w.last_mode or ""), w.last_mode
    assert patch_stats(pm)["fallbacks"] == 0


def test_failure_turns_the_path_off_at_no_cost(comfy, monkeypatch):
    """After one failure the model runs stock at that signature: the pack's code is not entered again."""
    from flux_numba_pack.flux_core import blocks
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    ref = forward(mp, inp)
    pm, = Patch().patch(mp, backend="torch")
    entered = []

    def broken(*a, **k):
        entered.append(1)
        raise RuntimeError("synthetic failure")
    monkeypatch.setattr(blocks, "single_block", broken)
    monkeypatch.setattr(blocks, "double_block", broken)
    for _ in range(3):
        assert torch.equal(forward(pm, inp), ref)
    assert len(entered) == 1
    st = patch_stats(pm)
    assert st["stock"] == 3 * N_BLOCKS - 1 and st["fallbacks"] == 1


@pytest.mark.parametrize("method", ["index", "index_timestep_zero"])
def test_reference_latents(comfy, caplog, method):
    """Kontext-style reference latents: extra image tokens go through the pack ("index"); with
    ``index_timestep_zero`` the blocks get per-token modulation rows (modulation_dims), which the
    fused path does not implement: the block runs stock, with a log line naming it (for a FLUX.1
    model stock v0.33 itself fails in that mode: the patched model fails the same way)."""
    import inspect
    mp = tiny_patcher(comfy)
    dm = mp.model.diffusion_model
    if "timestep_zero_index" not in inspect.signature(dm.forward_orig).parameters and method != "index":
        pytest.skip(f"ComfyUI {version()} has no index_timestep_zero reference mode")
    inp = _inputs(torch.float32, B=1)
    ref_lat = [torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(9))]

    def fwd(m):
        to = dict(m.model_options["transformer_options"])
        with torch.inference_mode():
            return m.model.diffusion_model(inp["x"].clone(), inp["timestep"], inp["context"], y=inp["y"],
                                           guidance=inp["guidance"], ref_latents=ref_lat, transformer_options=to,
                                           ref_latents_method=method)
    pm, = Patch().patch(mp, backend="torch")
    try:
        ref = fwd(mp)
    except RuntimeError as e:  # v0.33: a FLUX.1 model (per-block modulation) cannot run this mode in stock
        with caplog.at_level(logging.WARNING, logger="flux_numba"):
            with pytest.raises(RuntimeError) as got:
                fwd(pm)
        assert str(got.value) == str(e), "the patched model must fail exactly as stock does"
        assert "modulation_dims" in caplog.text and patch_stats(pm)["calls"] == 0
        return
    with caplog.at_level(logging.WARNING, logger="flux_numba"):
        out = fwd(pm)
    st = patch_stats(pm)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), rel_err(out, ref)
    if method == "index":
        assert st["fallbacks"] == 0 and st["calls"] == N_BLOCKS, st
    else:
        assert st["calls"] == 0 and st["fallbacks"] == N_BLOCKS, st
        assert caplog.text.count("modulation_dims") == 2, caplog.text


def test_op_weights_for_the_vae_groupnorm(comfy, monkeypatch):
    """The VAE patch's GroupNorm weights: the module's own tensors, or -- when the op casts per call
    or carries a weight function -- cast_bias_weight's result, handed back on exit."""
    import comfy.ops
    from flux_numba_pack.nodes.host import op_weights
    gn = comfy.ops.disable_weight_init.GroupNorm(4, 8)
    gn.weight = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    gn.bias = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    x = torch.randn(1, 8, 2, 2)
    with op_weights(gn, x) as (w, b):
        assert w is gn.weight and b is gn.bias
    uncast = []
    real = comfy.ops.uncast_bias_weight
    monkeypatch.setattr(comfy.ops, "uncast_bias_weight", lambda *a: (uncast.append(a[0]), real(*a)))
    monkeypatch.setattr(gn, "weight_function", [lambda t: t * 3.0], raising=False)
    with op_weights(gn, x) as (w, b):
        assert torch.equal(w, gn.weight * 3.0) and torch.equal(b, gn.bias)
    assert uncast == [gn]


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


# ----------------------------------------------------------------------------- fast profile
@pytest.mark.parametrize("profile", ["fast", "fast-cached"])
def test_fast_profile_runs_fp8_and_follows_lora(comfy, monkeypatch, profile):
    """profiles fast / fast-cached in ComfyUI's sampler: every block GEMM goes through fp8 (no
    fallback), the result stays within fp8 error of stock, and a LoRA applied after the patch changes
    the fast output as it changes stock's (the fp8 weights are made from what ComfyUI's patcher hands
    the block: every step, or cached per weight version and ComfyUI's patch epoch)."""
    from flux_numba_pack.flux_core import fast
    if fast.support("cpu"):
        pytest.skip(fast.support("cpu"))
    _, n_mm, _ = _spy_fp8(monkeypatch)  # n_mm: the weight operand of every fp8 GEMM
    mp = tiny_patcher(comfy, torch.float32)
    latent = torch.zeros(1, 16, 8, 8)
    stock = _sample(mp, latent)
    pm, = Patch().patch(mp, backend="torch", profile=profile)
    got = _sample(pm, latent)
    st = patch_stats(pm)
    assert st["fallbacks"] == 0 and not st.get("off") and n_mm, st
    assert 1e-5 < rel_err(got, stock) < 0.1, rel_err(got, stock)
    patches = _lora_patches(mp)
    stock_l, pm_l = mp.clone(), pm.clone()
    stock_l.add_patches(patches, 1.0)
    pm_l.add_patches(patches, 1.0)
    s_l, g_l = _sample(stock_l, latent), _sample(pm_l, latent)
    assert rel_err(s_l, stock) > 1e-3 and rel_err(g_l, got) > 1e-3
    assert rel_err(g_l, s_l) < 0.1, rel_err(g_l, s_l)
    assert rel_err(g_l - got, s_l - stock) < 0.5  # the LoRA's effect, seen through fp8


def _spy_fp8(monkeypatch):
    """Lists filled as the fast profile runs: weights quantised (Fp8Weights.get calls), and the
    weight operand and weight scales of every fp8 GEMM."""
    from flux_numba_pack.flux_core import fast
    quantised, operands, scales = [], [], []
    real_get, real_mm = fast.Fp8Weights.get, fast.scaled_mm
    monkeypatch.setattr(fast.Fp8Weights, "get", lambda self, *a, **k: quantised.append(1) or real_get(self, *a, **k))
    monkeypatch.setattr(fast, "scaled_mm", lambda *a, **k: operands.append(a[2]) or scales.append(a[3]) or real_mm(*a, **k))
    return quantised, operands, scales


def _stock_and_fast(mp):
    """(stock, profile fast) samples of one model; the fast one without any block fallback."""
    latent = torch.zeros(1, 16, 8, 8)
    stock = _sample(mp, latent)
    pm, = Patch().patch(mp, backend="torch", profile="fast")
    got = _sample(pm, latent)
    st = patch_stats(pm)
    assert st["fallbacks"] == 0 and not st.get("off"), st
    return stock, got


def _fp8_stored_patcher(comfy):
    import comfy.model_patcher
    import comfy.supported_models
    from flux_numba_pack.flux_core import TINY, tiny_state_dict
    cfg = dict(TINY.comfy_kwargs(), image_model="flux")
    mc = comfy.supported_models.Flux(cfg)
    mc.set_inference_dtype(torch.float8_e4m3fn, torch.float32)  # fp8 storage, fp32 compute (manual cast)
    bm = mc.get_model({}, device=torch.device("cpu"))
    bm.diffusion_model.load_state_dict(mc.process_unet_state_dict(
        {k: v.to(torch.float8_e4m3fn) for k, v in tiny_state_dict(0).items()}), strict=True)
    return comfy.model_patcher.ModelPatcher(bm, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def test_fast_profile_uses_fp8_stored_weights_as_they_are(comfy, monkeypatch):
    """fp8-stored checkpoint (UNETLoader weight dtype fp8_e4m3fn): the fast profile feeds the stored
    e4m3 weights to the GEMM -- nothing re-quantised, no bf16 copy -- and matches stock closely."""
    from flux_numba_pack.flux_core import fast
    if fast.support("cpu"):
        pytest.skip(fast.support("cpu"))
    quantised, operands, _ = _spy_fp8(monkeypatch)
    mp = _fp8_stored_patcher(comfy)
    stock, got = _stock_and_fast(mp)
    assert operands and not quantised
    stored = {p.data_ptr() for p in mp.model.diffusion_model.parameters() if p.dtype == torch.float8_e4m3fn}
    assert all(w.dtype == torch.float8_e4m3fn and w.data_ptr() in stored for w in operands)
    assert rel_err(got, stock) < 0.1, rel_err(got, stock)


def test_fast_profile_uses_fp8_model_dtype_of_dynamic_weights(comfy, monkeypatch):
    """DynamicVRAM keeps a weight the file has in bf16 as fp8 on the GPU when the model dtype is fp8
    (UNETLoader fp8_e4m3fn on a bf16 checkpoint: the CPU tensor stays bf16, ``_model_dtype`` is fp8, the
    staging hands out fp8).  The fast profile takes that staged fp8 weight as it is: no bf16 cast by
    ComfyUI, nothing re-quantised by the pack."""
    import comfy.ops
    from flux_numba_pack.flux_core import fast
    from flux_numba_pack.nodes.host import ComfyWeights, fp8_stored_block
    if fast.support("cpu"):
        pytest.skip(fast.support("cpu"))
    mp = _fp8_stored_patcher(comfy)
    dm = mp.model.diffusion_model
    staged = {}
    for lin in [m for m in dm.modules() if isinstance(m, torch.nn.Linear)]:
        f8 = lin.weight.data
        lin.weight = torch.nn.Parameter(f8.to(torch.bfloat16), requires_grad=False)  # as the file has it
        lin.weight._model_dtype = torch.float8_e4m3fn                                # as DynamicVRAM stages it
        staged[id(lin)] = f8
    real = comfy.ops.cast_bias_weight
    asked = []

    def dyn_cast(s, input=None, dtype=None, device=None, bias_dtype=None, offloadable=False, **kw):
        if id(s) not in staged:
            return real(s, input, dtype=dtype, device=device, bias_dtype=bias_dtype, offloadable=offloadable, **kw)
        asked.append(dtype)
        dtype = dtype or input.dtype
        w = staged[id(s)] if dtype == torch.float8_e4m3fn else staged[id(s)].to(dtype)
        b = s.bias.to(bias_dtype or dtype) if s.bias is not None else None
        return (w, b, (None, None, None)) if offloadable else (w, b)
    monkeypatch.setattr(comfy.ops, "cast_bias_weight", dyn_cast)
    blk = dm.double_blocks[0]
    assert fp8_stored_block("double", blk)
    x = torch.zeros(1, 4, blk.hidden_size)
    wq, b, scale = ComfyWeights().linear_fp8(blk.img_attn.qkv, x)
    assert wq is staged[id(blk.img_attn.qkv)] and scale is None
    quantised, operands, _ = _spy_fp8(monkeypatch)
    stock, got = _stock_and_fast(mp)
    assert operands and not quantised
    assert all(w.dtype == torch.float8_e4m3fn for w in operands)
    assert torch.float8_e4m3fn in asked
    assert rel_err(got, stock) < 0.1, rel_err(got, stock)


def test_graph_blockers_allow_resident_casts_only(comfy):
    """fp8-stored weights (manual_cast ops, cast per call from resident weights) do not block a CUDA
    graph; a weight function (on-the-fly LoRA / low-VRAM patch) does."""
    from flux_numba_pack.nodes.host import residency as host
    mp = _fp8_stored_patcher(comfy)
    dm = mp.model.diffusion_model
    lins = [m for m in dm.modules() if isinstance(m, torch.nn.Linear)]
    assert lins and all(getattr(m, "comfy_cast_weights", False) for m in lins)
    assert not any(host._freezes_per_call_work(m) for m in dm.modules())
    why, _ = host.graph_state(dm, torch.device("cuda", 0))   # (the CPU weights read as offloaded here)
    assert not any("per call" in w for w in why), why
    lins[0].weight_function = [lambda w: w]
    assert host._freezes_per_call_work(lins[0])
    why, _ = host.graph_state(dm, torch.device("cuda", 0))
    assert any("stage or patch their weights per call" in w for w in why), why


def test_fast_on_dynamic_bf16_blocks(comfy, monkeypatch, caplog):
    """profile fast (per-step weight quantisation) on blocks with bf16 DynamicVRAM weights: with
    per-block graphs (cuda_graph auto) the quantisation is device work inside the graphs and the
    GEMMs run in fp8; with cuda_graph off (eager: slower than stock there) the blocks run the exact
    path with one warning; fast-cached keeps fp8 either way."""
    from flux_numba_pack.flux_core import fast
    if fast.support("cpu"):
        pytest.skip(fast.support("cpu"))
    mp = tiny_patcher(comfy, torch.float32)
    for blk in list(mp.model.diffusion_model.double_blocks) + list(mp.model.diffusion_model.single_blocks):
        blk._v = object()  # what comfy-aimdo's vbar staging leaves on a DynamicVRAM module (host.dynamic_block)
    _, n_mm, _ = _spy_fp8(monkeypatch)  # n_mm: the weight operand of every fp8 GEMM
    latent = torch.zeros(1, 16, 8, 8)
    stock = _sample(mp, latent)
    with caplog.at_level(logging.WARNING, logger="flux_numba"):
        pm, = Patch().patch(mp, backend="torch", profile="fast", cuda_graph="off")
        got = _sample(pm, latent)
    st = patch_stats(pm)
    assert st["fallbacks"] == 0 and not st.get("off") and not n_mm, st
    assert rel_err(got, stock) < 1e-4  # the exact path
    assert "DynamicVRAM weights" in caplog.text
    pg, = Patch().patch(mp, backend="torch", profile="fast", cuda_graph="auto")
    _sample(pg, latent)
    assert n_mm and patch_stats(pg)["fallbacks"] == 0
    n_mm.clear()
    pc, = Patch().patch(mp, backend="torch", profile="fast-cached", cuda_graph="off")
    _sample(pc, latent)
    assert n_mm


def _scaled_fp8_patcher(comfy):
    """A scaled fp8 checkpoint as ComfyUI loads one (mixed-precision ops, per-layer ``comfy_quant``
    metadata, one ``weight_scale`` per tensor): every block Linear weight e4m3 with its scale."""
    import json
    import comfy.model_patcher
    import comfy.supported_models
    from flux_numba_pack.flux_core import TINY, tiny_state_dict
    cfg = dict(TINY.comfy_kwargs(), image_model="flux")
    mc = comfy.supported_models.Flux(cfg)
    mc.quant_config = {"mixed_ops": True}
    mc.set_inference_dtype(torch.float32, torch.float32)
    bm = mc.get_model({}, device=torch.device("cpu"))
    meta = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    sd = {}
    for k, v in tiny_state_dict(0).items():
        if ("double_blocks" in k or "single_blocks" in k) and k.endswith(".weight") and v.ndim == 2:
            s = v.abs().amax().float() / 448
            sd[k], sd[k[:-6] + "weight_scale"], sd[k[:-6] + "comfy_quant"] = (v.float() / s).to(torch.float8_e4m3fn), s, meta
        else:
            sd[k] = v
    res = bm.diffusion_model.load_state_dict(mc.process_unet_state_dict(sd), strict=False)
    assert not res.missing_keys and not res.unexpected_keys, res
    return comfy.model_patcher.ModelPatcher(bm, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def test_fast_profile_uses_scaled_fp8_checkpoints_as_they_are(comfy, monkeypatch):
    """Scaled fp8 checkpoint (QuantizedTensor weights with per-tensor scales): the fast profile feeds
    the stored e4m3 data to the GEMM with that scale -- nothing re-quantised or dequantised -- and
    matches stock closely; the exact profile still calls ComfyUI's own op."""
    from flux_numba_pack.flux_core import fast
    from flux_numba_pack.nodes.host import flux as host
    if fast.support("cpu"):
        pytest.skip(fast.support("cpu"))
    quantised, operands, scales = _spy_fp8(monkeypatch)
    with torch.inference_mode():  # ComfyUI loads checkpoints inside its executor's inference mode
        mp = _scaled_fp8_patcher(comfy)
    dm = mp.model.diffusion_model
    assert host.fp8_stored_block("single", dm.single_blocks[0]) and host.fp8_stored_block("double", dm.double_blocks[0])
    stock, got = _stock_and_fast(mp)
    assert operands and not quantised
    stored = {m.weight._qdata.data_ptr(): m.weight._params.scale.item() for m in dm.modules()
              if host._fp8_qdata(getattr(m, "weight", None)) is not None}
    assert len(stored) == _quantized_linears(dm)
    assert all(w.dtype == torch.float8_e4m3fn and w.data_ptr() in stored for w in operands)
    assert all(torch.allclose(s, torch.full_like(s, stored[w.data_ptr()])) for w, s in zip(operands, scales))
    assert rel_err(got, stock) < 0.1, rel_err(got, stock)
    operands.clear()
    px, = Patch().patch(mp, backend="torch", profile="exact")
    assert rel_err(_sample(px, torch.zeros(1, 16, 8, 8)), stock) < 1e-4 and not operands


def _quantized_linears(dm):
    """Linears _scaled_fp8_patcher quantizes: the block GEMMs and the blocks' modulation Linears."""
    from flux_numba_pack.flux_core import fast
    return sum(len(fast.block_linears("double", b)) + 2 for b in dm.double_blocks) + \
        sum(len(fast.block_linears("single", b)) + 1 for b in dm.single_blocks)  # + the modulation Linears


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
