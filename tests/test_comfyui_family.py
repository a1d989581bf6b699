"""The FLUX.1 family under ComfyUI itself (the tree at $COMFYUI_PATH, on CPU; v0.8.0 and v0.33.0).

Marked ``comfyui`` like tests/test_comfyui.py (whose helpers it uses): test_comfyui_matrix runs it
once per tree.  Direct use::

    COMFYUI_PATH=.carry/ComfyUI-0.33.0 /work/venv-comfy/bin/python -m pytest -q tests/test_comfyui_family.py

For each member, on tiny random weights built the way ComfyUI builds the member's model
(``model_detection.model_config_from_unet_config`` picks the supported-model class), FluxNumbaPatch's
forward equals ComfyUI's stock forward (torch backend: to 1e-5 of the output's largest value;
numba kernels in Numba's CUDA simulator, bf16: within test_comfyui's 3e-2 relative error), and
every block ran the pack's own path (calls counted, no fallback):

* Schnell: no guidance embedding (no ``guidance_in`` weights) -> FluxSchnell, FLOW sampling;
* Kontext: ``ref_latents`` with ``ref_latents_method`` "offset" / "index", directly and through the
  sampler's ``reference_latents`` conditioning; v0.33's "index_timestep_zero" raises in stock on a
  FLUX.1 model (its per-token modulation rows need Flux.2's global modulation): the patched model
  raises the same error (its block runs stock) and keeps its fused path for other inputs;
* Fill: img_in takes noise + masked-image latent + 8x8 mask (16 + 16 + 64 = 96 channels) ->
  FluxInpaint; the concat comes from ComfyUI's own ``model_base.Flux.concat_cond`` (what
  InpaintModelConditioning's conditioning turns into) through ``apply_model``;
* Redux: ComfyUI's StyleModelApply appends 9 image tokens to the context (multiply, and attn_bias
  with its attention mask);
* ControlNet: the ``control`` residuals forward_orig adds after each block ({"input": per double
  block, "output": per single block}; shorter lists, None entries and a shared tensor as ComfyUI's
  Flux ControlNets produce them).
"""
import dataclasses
import inspect

import pytest
import torch

import test_comfyui as tc
from test_comfyui import DEVICE, N_BLOCKS, Patch, _inputs, patch_mod, patch_stats, rel_err, tiny_patcher

pytestmark = tc.pytestmark
comfy = tc.comfy  # the module-scoped fixture: ComfyUI imported in-process on CPU

SIM_TOL = 3e-2  # test_comfyui.test_forward_numba_simulator's bf16 bound


def _configs():
    from flux_numba_pack.flux_core import TINY
    return {"schnell": dataclasses.replace(TINY, guidance_embed=False),
            "fill": dataclasses.replace(TINY, in_channels=16 + 16 + 64)}


def member_patcher(comfy, member, expect, dtype=torch.float32, seed=0):
    """A ModelPatcher around the model ComfyUI makes for this member's (tiny) unet config."""
    from flux_numba_pack.flux_core import random_state_dict
    import comfy.model_detection
    import comfy.model_patcher
    cfg = _configs()[member]
    mc = comfy.model_detection.model_config_from_unet_config(dict(cfg.comfy_kwargs(), image_model="flux"))
    assert type(mc).__name__ == expect, type(mc)
    mc.set_inference_dtype(dtype, None)
    bm = mc.get_model({}, device=DEVICE)
    sd = mc.process_unet_state_dict({k: v.to(dtype) for k, v in random_state_dict(cfg, seed).items()})
    bm.diffusion_model.load_state_dict(sd, strict=True)
    return comfy.model_patcher.ModelPatcher(bm, load_device=DEVICE, offload_device=torch.device("cpu"))


def call(mp, inp, inference=True, **kw):
    """The diffusion model's forward with this patcher's transformer_options and extra arguments."""
    to = dict(mp.model_options["transformer_options"])
    with torch.inference_mode(inference):
        return mp.model.diffusion_model(inp["x"].clone(), inp["timestep"], inp["context"], y=inp["y"],
                                        guidance=inp.get("guidance"), transformer_options=to, **kw)


def patched(mp, numba=False):
    if numba:
        pm, = Patch().patch(mp, backend="numba", profile="exact", attention="sdpa")
    else:
        pm, = Patch().patch(mp, backend="torch", profile="exact")
    info = pm.model_options["transformer_options"]["flux_numba"]
    assert info["active"] and info["double_blocks"] == 2 and info["single_blocks"] == 2, info
    return pm


def assert_exact(out, ref):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), rel_err(out, ref)


def assert_fused(pm, forwards):
    """Every block of ``forwards`` forwards ran the pack's path: no fallback, not turned off."""
    st = patch_stats(pm)
    assert st["calls"] == forwards * N_BLOCKS and st["fallbacks"] == 0 and not st.get("off"), st


def ksample(mp, latent, pos, steps, seed=7):
    """ComfyUI's own sampler (``nodes.common_ksampler``), cfg 1, under inference mode."""
    import nodes  # ComfyUI's nodes.py
    neg = [[torch.zeros_like(pos[0][0]), {"pooled_output": torch.zeros_like(pos[0][1]["pooled_output"])}]]
    with torch.inference_mode():
        out, = nodes.common_ksampler(mp, seed, steps, 1.0, "euler", "simple", pos, neg, {"samples": latent})
    return out["samples"]


def text_cond(txt=5, seed=3, **keys):
    from flux_numba_pack.flux_core import TINY
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, txt, TINY.context_in_dim, generator=g)
    return [[ctx, dict({"pooled_output": torch.randn(1, TINY.vec_in_dim, generator=g), "guidance": 3.5}, **keys)]]


def sample_check(mp, latent, pos, steps=2):
    """Sampling with the patch equals stock; the original model still samples stock afterwards."""
    stock = ksample(mp, latent, pos, steps)
    pm = patched(mp)
    got = ksample(pm, latent, pos, steps)
    assert_fused(pm, steps)
    assert torch.allclose(got, stock, rtol=1e-5, atol=1e-5), rel_err(got, stock)
    assert torch.equal(ksample(mp, latent, pos, steps), stock), "the original model must still sample stock"


def _g(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- Schnell
def test_schnell_is_comfys_flux_schnell(comfy):
    import comfy.model_base
    mp = member_patcher(comfy, "schnell", "FluxSchnell")
    dm = mp.model.diffusion_model
    assert dm.params.guidance_embed is False and isinstance(dm.guidance_in, torch.nn.Identity)
    assert mp.model.model_type == comfy.model_base.ModelType.FLOW


def test_schnell_forward_torch(comfy):
    mp = member_patcher(comfy, "schnell", "FluxSchnell")
    inp = dict(_inputs(torch.float32), guidance=None)
    ref = call(mp, inp)
    assert torch.equal(call(mp, _inputs(torch.float32)), ref), "guidance is ignored without guidance_in"
    pm = patched(mp)
    assert_exact(call(pm, inp), ref)
    assert_exact(call(pm, _inputs(torch.float32)), ref)  # extra_conds always passes a guidance: ignored
    assert_fused(pm, 2)
    assert torch.equal(call(mp, inp), ref), "unpatched model must still run stock"


def test_schnell_sampling(comfy):
    sample_check(member_patcher(comfy, "schnell", "FluxSchnell"), torch.zeros(1, 16, 8, 8), text_cond(), steps=3)


# ----------------------------------------------------------------------------- Kontext
def _flux_source(comfy, name):
    import comfy.ldm.flux.model as fm
    return inspect.getsource(getattr(fm.Flux, name))


def _need_ref_method(comfy, method):
    if method not in ("offset",) and f'"{method}"' not in _flux_source(comfy, "_forward"):
        pytest.skip(f"this ComfyUI's Flux._forward has no ref_latents_method {method!r}")


@pytest.mark.parametrize("method,refs", [("offset", 1), ("index", 1), ("offset", 2), ("index", 2)],
                         ids=["offset", "index", "offset-2refs", "index-2refs"])
def test_kontext_forward_torch(comfy, method, refs):
    """Reference latents: their tokens join img (RoPE rows from the method); stock vs patched."""
    _need_ref_method(comfy, method)
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    g = _g(11)
    lats = [torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 6, 10, generator=g)][:refs]
    kw = dict(ref_latents=lats, ref_latents_method=method)
    ref = call(mp, inp, **kw)
    assert rel_err(ref, call(mp, inp)) > 1e-3, "the reference latents must matter"
    pm = patched(mp)
    assert_exact(call(pm, inp, **kw), ref)
    assert_fused(pm, 1)


@pytest.mark.parametrize("method", [None, "index"], ids=["default", "index"])
def test_kontext_sampling(comfy, method):
    """A Kontext graph's conditioning: ReferenceLatent's ``reference_latents`` (and
    FluxKontextMultiReferenceLatentMethod's ``reference_latents_method``) through the sampler."""
    if method is not None:
        _need_ref_method(comfy, method)
    keys = {"reference_latents": [torch.randn(1, 16, 8, 8, generator=_g(12))]}
    if method is not None:
        keys["reference_latents_method"] = method
    sample_check(tiny_patcher(comfy), torch.zeros(1, 16, 8, 8), text_cond(**keys))


def test_kontext_index_timestep_zero_raises_as_stock(comfy):
    """v0.33's "index_timestep_zero" on a FLUX.1 model: stock raises inside double block 0 (per-token
    modulation rows with FLUX.1's per-block modulation); the patched model hands that block to
    stock (modulation_dims) and raises the same error, and its fused path stays on for other inputs."""
    import comfy.ldm.flux.model as fm
    if "timestep_zero_index" not in inspect.signature(fm.Flux.forward_orig).parameters:
        pytest.skip("this ComfyUI has no ref_latents_method 'index_timestep_zero' (added after v0.8.0)")
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32, B=1)  # B=1 reaches the blocks (B=2 fails earlier, in the vec sum)
    kw = dict(ref_latents=[torch.randn(1, 16, 8, 8, generator=_g(13))], ref_latents_method="index_timestep_zero")
    with pytest.raises(Exception) as stock:
        call(mp, inp, **kw)
    pm = patched(mp)
    with pytest.raises(Exception) as ours:
        call(pm, inp, **kw)
    assert type(ours.value) is type(stock.value) and str(ours.value) == str(stock.value), (ours.value, stock.value)
    st = patch_stats(pm)
    assert st["calls"] == 0 and st["fallbacks"] == 1 and not st.get("off"), st
    assert any("modulation_dims" in r for r in st["reasons"]), st
    kw["ref_latents_method"] = "index"
    if '"index"' in _flux_source(comfy, "_forward"):
        assert_exact(call(pm, inp, **kw), call(mp, inp, **kw))
        st = patch_stats(pm)
        assert st["calls"] == N_BLOCKS and st["fallbacks"] == 1 and not st.get("off"), st


# ----------------------------------------------------------------------------- Fill
def fill_conds(mp, x, seed=14, txt=5):
    """What sampling hands apply_model for FLUX Fill: ComfyUI's own extra_conds (its concat_cond
    makes c_concat from the masked-image latent and a pixel-resolution mask), per-batch processed."""
    from flux_numba_pack.flux_core import TINY
    B, _, h, w = x.shape
    g = _g(seed)
    mask = torch.zeros(1, 1, 8 * h, 8 * w)
    mask[..., 4 * h:, :] = 1.0  # the lower half is inpainted
    conds = mp.model.extra_conds(noise=x, device=DEVICE, concat_latent_image=torch.randn(1, 16, h, w, generator=g),
                                 concat_mask=mask, cross_attn=torch.randn(1, txt, TINY.context_in_dim, generator=g),
                                 pooled_output=torch.randn(1, TINY.vec_in_dim, generator=g), guidance=30.0)
    assert conds["c_concat"].cond.shape[1] == 16 + 64, conds["c_concat"].cond.shape
    return {k: c.process_cond(batch_size=B, area=None).cond for k, c in conds.items()}


def apply(mp, x, sigma, conds, inference=True):
    to = dict(mp.model_options["transformer_options"])
    with torch.inference_mode(inference):
        return mp.model.apply_model(x, sigma, transformer_options=to, **conds)


def test_fill_apply_model_torch(comfy):
    mp = member_patcher(comfy, "fill", "FluxInpaint")
    assert mp.model.diffusion_model.img_in.weight.shape == (128, 96 * 4)
    x = torch.randn(2, 16, 8, 8, generator=_g(15))
    sigma = torch.tensor([0.9, 0.4])
    conds = fill_conds(mp, x)
    ref = apply(mp, x, sigma, conds)
    pm = patched(mp)
    assert_exact(apply(pm, x, sigma, conds), ref)
    assert_fused(pm, 1)


def test_fill_sampling(comfy):
    """InpaintModelConditioning's conditioning keys (concat_latent_image, concat_mask) through the sampler."""
    mask = torch.zeros(1, 1, 64, 64)
    mask[..., 32:, :] = 1.0
    pos = text_cond(concat_latent_image=torch.randn(1, 16, 8, 8, generator=_g(16)), concat_mask=mask)
    pos[0][1]["guidance"] = 30.0
    sample_check(member_patcher(comfy, "fill", "FluxInpaint"), torch.zeros(1, 16, 8, 8), pos)


# ----------------------------------------------------------------------------- Redux
class StubStyleModel:
    """Stands in for comfy.sd.StyleModel (Redux): ``get_cond`` gives its image tokens at the context width."""

    def __init__(self, n=9, seed=17):
        from flux_numba_pack.flux_core import TINY
        self.tokens = torch.randn(1, n, TINY.context_in_dim, generator=_g(seed))

    def get_cond(self, clip_vision_output):
        return self.tokens.clone()


def redux_cond(strength, strength_type):
    import nodes
    pos, = nodes.StyleModelApply().apply_stylemodel(text_cond(), StubStyleModel(), None, strength, strength_type)
    assert pos[0][0].shape[1] == 5 + 9
    return pos


def test_redux_forward_torch(comfy):
    """The longer context (5 text + 9 image tokens) straight into the diffusion model."""
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32, txt=5 + 9)
    ref = call(mp, inp)
    pm = patched(mp)
    assert_exact(call(pm, inp), ref)
    assert_fused(pm, 1)


@pytest.mark.parametrize("strength,strength_type", [(1.0, "multiply"), (0.5, "attn_bias")],
                         ids=["multiply", "attn_bias-mask"])
def test_redux_sampling(comfy, monkeypatch, strength, strength_type):
    """ComfyUI's StyleModelApply on the conditioning; attn_bias != 1 adds an attention mask, which
    reaches the pack's blocks (txt 14 + img 16 tokens square)."""
    from flux_numba_pack.flux_core import blocks
    pos = redux_cond(strength, strength_type)
    assert ("attention_mask" in pos[0][1]) == (strength_type == "attn_bias")
    masks = []
    double_block = blocks.double_block

    def spy(blk, img, txt, vec, pe, mask=None, ctx=None):
        masks.append(None if mask is None else tuple(mask.shape))
        return double_block(blk, img, txt, vec, pe, mask, ctx)
    monkeypatch.setattr(blocks, "double_block", spy)
    sample_check(tiny_patcher(comfy), torch.zeros(1, 16, 8, 8), pos)
    assert masks == [(1, 30, 30) if strength_type == "attn_bias" else None] * 2 * 2, masks  # 2 steps x 2 blocks


# ----------------------------------------------------------------------------- ControlNet
def control_residuals(layout, B=2, tokens=16, seed=18, dtype=torch.float32):
    """``control`` as ComfyUI's ControlNet.control_merge hands it to the Flux forward."""
    from flux_numba_pack.flux_core import TINY
    g = _g(seed)

    def r():
        return (0.5 * torch.randn(B, tokens, TINY.hidden_size, generator=g)).to(dtype).to(DEVICE)
    if layout == "all":  # a residual after every block
        return {"input": [r(), r()], "middle": [], "output": [r(), r()]}
    if layout == "xlabs":  # XLabs: double-block residuals only, one tensor repeated (controlnet_double * repeat)
        t = r()
        return {"input": [t, t], "middle": [], "output": []}
    if layout == "short":  # fewer entries than blocks, None entries (merged with another ControlNet)
        return {"input": [r()], "middle": [], "output": [None, r()]}
    raise ValueError(layout)


@pytest.mark.parametrize("layout", ["all", "xlabs", "short"])
def test_controlnet_forward_torch(comfy, layout):
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    control = control_residuals(layout)
    ref = call(mp, inp, control=control)
    assert rel_err(ref, call(mp, inp)) > 1e-3, "the residuals must matter"
    pm = patched(mp)
    assert_exact(call(pm, inp, control=control), ref)
    assert_fused(pm, 1)


def test_controlnet_with_reference_latents_torch(comfy):
    """Residuals cover the first img tokens only when Kontext's reference tokens follow them."""
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    kw = dict(control=control_residuals("all"), ref_latents=[torch.randn(2, 16, 8, 8, generator=_g(19))])
    ref = call(mp, inp, **kw)
    pm = patched(mp)
    assert_exact(call(pm, inp, **kw), ref)
    assert_fused(pm, 1)


# ----------------------------------------------------------------------------- numba kernels (simulator)
@pytest.mark.parametrize("member", ["schnell", "kontext", "fill", "redux", "controlnet"])
def test_member_numba_simulator(comfy, monkeypatch, member):
    """One case per member with the numba kernels (Numba's CUDA simulator on CPU; a GPU when
    FLUX_NUMBA_REAL_GPU=1) vs stock, bf16, test_comfyui's tiny simulator shapes.  Attention stays
    ComfyUI's ("sdpa"), as in test_comfyui.test_forward_numba_simulator."""
    from flux_numba_pack.cuda_kernels import registry
    monkeypatch.setattr(patch_mod(), "SIMULATOR_OK", True)
    dt = torch.bfloat16
    inp = _inputs(dt, B=1, hw=4, txt=3 + (9 if member == "redux" else 0))
    kw = {}
    if member == "schnell":
        mp = member_patcher(comfy, "schnell", "FluxSchnell", dt)
        inp["guidance"] = None
    elif member == "fill":
        mp = member_patcher(comfy, "fill", "FluxInpaint", dt)
    else:
        mp = tiny_patcher(comfy, dt)
    if member == "kontext":
        kw = dict(ref_latents=[torch.randn(1, 16, 4, 4, generator=_g(20)).to(dt)], ref_latents_method="offset")
    elif member == "controlnet":
        kw = dict(control=control_residuals("all", B=1, tokens=4, dtype=dt))

    if member == "fill":
        x, sigma = inp["x"], torch.tensor([0.7])
        conds = fill_conds(mp, x, txt=3)

        def run(m):
            return apply(m, x, sigma, conds, inference=False)
    else:
        def run(m):
            return call(m, inp, inference=False, **kw)
    ref = run(mp)
    pm = patched(mp, numba=True)
    registry.take_usage()
    out = run(pm)
    usage = registry.take_usage()
    assert_fused(pm, 1)
    assert any("numba" in b for per in usage.values() for b in per), usage
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < SIM_TOL, (rel_err(out, ref), usage)
