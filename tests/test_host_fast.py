"""The fast profile through the host adapter, per supported ComfyUI version (split from test_host.py):
fp8 rows and LoRA, fp8-stored and scaled-fp8 checkpoints used as they are, DynamicVRAM bf16
blocks, the graph blockers.
"""
import logging

import pytest
import torch

from test_comfyui import (N_BLOCKS, Patch, _inputs, comfy, forward, patch_stats, rel_err,  # noqa: F401
                          tiny_patcher, pytestmark)
from _host_testing import _fp8_stored_patcher, _lora_patches, _sample


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
