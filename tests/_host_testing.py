"""Shared by the host tests (test_host*.py): the ComfyUI version, a tiny latent, conditioning,
sampling through ComfyUI's sampler, LoRA / EasyCache set-ups and the sampling cases."""
import torch


TINY_LATENT = (16, 8, 8)


def version():
    from flux_numba_pack.nodes.host import comfy_version
    return comfy_version()


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
