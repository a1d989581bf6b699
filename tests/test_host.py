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
from _host_testing import CASES, TINY_LATENT, _after_patch, _cond, _fp8_stored_patcher, _lora_patches, _sample, version


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
