"""gpu_server.py's API prompts: the case grammar (parse_case: base, family members, _t<x>, _sdpa,
_eager, _fp8, _lora suffixes), the prompt graph each case queues (graph, decode_graph), the stock case
each one's images are compared with (stock_partner) and the order the prompts run in (run_order)."""
from __future__ import annotations

import re

from _server_quant import gguf_file, scaled_fp8_file
from _server_weights import FAMILIES, LORA_FILE, family_file

LORA_SUFFIX = re.compile(r"_lora(b?)([0-9.]+)?$")  # _lora: after the patch, _lorab: before it; [strength]


def split_lora(case):
    """(the case without its LoRA suffix, the suffix, LoRA before the patch?, strength), or
    (case, "", None, None) for a case without a LoRA."""
    m = LORA_SUFFIX.search(case)
    if m is None:
        return case, "", None, None
    return case[: m.start()], m.group(0), m.group(1) == "b", float(m.group(2) or 1.0)


FAMILY_RE = re.compile(r"_(schnell|kontext|fill|redux|cn)(?=_|$)")
QUANTS = ("fp8s", "gguf")  # quantised checkpoints of --weights (bench/e2e/_server_quant.py): fp8 scaled, GGUF Q8_0
QUANT_RE = re.compile(r"_(fp8s|gguf)(?=_|$)")
SCHNELL_STEPS = 4        # FLUX.1-schnell is a 4-step model: its cases override --steps
REDUX_TOKENS = 729       # Redux's StyleModelApply appends 27 x 27 SigLIP image tokens to the text context
CN_STRENGTH = 0.7


VAE_CASES = {"vae_stock": None, "vae_patched": "auto", "vae_patched_eager": "off"}


def decode_graph(case, res, seed, vae):
    """Decode-only API prompt (``vae_*`` cases): a random latent -> VAEDecode (through FluxNumbaVAEPatch
    for vae_patched: low-res CUDA graph auto; vae_patched_eager: graph off) -> a sink output node."""
    g = {"lat": {"class_type": "FluxNumbaBenchLatent", "inputs": {"seed": seed, "res": res}},
         "vae": {"class_type": "VAELoader", "inputs": {"vae_name": vae}}}
    vae_ref = ["vae", 0]
    if VAE_CASES[case] is not None:
        g["vpatch"] = {"class_type": "FluxNumbaVAEPatch", "inputs": {"vae": vae_ref, "enabled": True, "backend": "auto",
                                                                     "layout": "nhwc", "cuda_graph": VAE_CASES[case]}}
        vae_ref = ["vpatch", 0]
    g["dec"] = {"class_type": "VAEDecode", "inputs": {"samples": ["lat", 0], "vae": vae_ref}}
    g["sink"] = {"class_type": "FluxNumbaBenchSink", "inputs": {"images": ["dec", 0]}}
    return g


BASES = ("stock", "patched", "patched_fast", "patched_fast_cached", "easycache", "lazycache", "stock_easycache",
         "stock_lazycache", "stock_cudnn", "stock_flash")
PATCHED_BASES = ("patched", "patched_fast", "patched_fast_cached", "easycache", "lazycache")
CASE_GRAMMAR = ("one of " + ", ".join(BASES) + " (or " + ", ".join(VAE_CASES) + ") with optional suffixes _t<x> "
                "(cache cases), _sdpa, _eager, _fp8, _lora[b][<strength>] in that order, and family members "
                + ", ".join("_" + f for f in FAMILIES) + " anywhere after the base (not _schnell with _fill), "
                "one quantised checkpoint _fp8s / _gguf anywhere after the base (not with _fp8, _schnell, _fill)")


def parse_case(case):
    """A case name read into its parts, or ValueError (one line: why) for a name graph() does not know:
    {base, families (FAMILIES order), lora (the suffix), lora_before, lora_strength, fp8, eager, sdpa,
    threshold}.  Family suffixes may stand anywhere after the base (stock_schnell_fp8 =
    stock_fp8_schnell); the other suffixes in the order base[_t<x>][_sdpa][_eager][_fp8][_lora...]."""
    if case in VAE_CASES:
        return {"base": case, "families": (), "vae": True}
    found = FAMILY_RE.findall(case)
    if len(found) != len(set(found)):
        raise ValueError(f"case {case!r}: a family suffix twice")
    if "schnell" in found and "fill" in found:
        raise ValueError(f"case {case!r}: _schnell and _fill are two checkpoints; one of them per case")
    quants = QUANT_RE.findall(case)
    if len(quants) > 1:
        raise ValueError(f"case {case!r}: one quantised checkpoint (_fp8s or _gguf) per case")
    if quants and ("schnell" in found or "fill" in found):
        raise ValueError(f"case {case!r}: _{quants[0]} is made from --weights (dev), not from the _schnell / _fill file")
    rest = QUANT_RE.sub("", FAMILY_RE.sub("", case))
    try:
        rest, lora, lora_before, lora_strength = split_lora(rest)
    except ValueError:
        raise ValueError(f"case {case!r}: a LoRA strength that is no number") from None
    out = {"families": tuple(f for f in FAMILIES if f in found), "lora": lora, "lora_before": lora_before,
           "lora_strength": lora_strength, "vae": False, "quant": quants[0] if quants else None}
    for flag in ("fp8", "eager", "sdpa"):
        out[flag] = rest.endswith("_" + flag)
        rest = rest[: -len(flag) - 1] if out[flag] else rest
    thr = re.fullmatch(r"(.*cache)_t([0-9.]+)", rest)  # easycache_t1.0: EasyCache with reuse_threshold 1.0
    try:
        out["threshold"] = float(thr.group(2)) if thr else 0.2
    except ValueError:
        raise ValueError(f"case {case!r}: a cache threshold _t<x> that is no number") from None
    rest = thr.group(1) if thr else rest
    if out["fp8"] and out["quant"]:
        raise ValueError(f"case {case!r}: _fp8 (weight_dtype fp8_e4m3fn) with a quantised checkpoint _{out['quant']}")
    if rest not in BASES:
        raise ValueError(f"unknown case {case!r}: a case is {CASE_GRAMMAR}")
    out["base"] = rest
    return out


def graph(case, steps, res, seed, unet, vae, cond_dims=(4096, 768), prefix="", stock_vae=False):
    """API prompt for one case: stock | patched | patched_fast (profile fast) | patched_fast_cached
    (profile fast-cached) | easycache | lazycache | stock_easycache | stock_lazycache; a case ending in
    ``_fp8`` loads the weights with UNETLoader's weight_dtype fp8_e4m3fn (stock_fp8, patched_fast_fp8);
    a patched case ending in ``_eager`` runs with cuda_graph off (patched_eager: the eager host path);
    ``patched_sdpa``: exact with attention "sdpa" (ComfyUI's own attention call, stock's backend order);
    ``stock_cudnn`` / ``stock_flash``: stock with SDPA's cuDNN / FLASH backend first (controls for image
    agreement: what a change of attention backend alone does); ``vae_*``: decode-only (``decode_graph``);
    a cache case ending in ``_t<x>`` (``easycache_t1.0``) sets the cache node's reuse_threshold to x
    (default 0.2, the node's own); ``_lora[b][<strength>]``: a random LoRA after (``_lorab``: before) the patch.

    FLUX.1 family members, as suffixes anywhere after the base (``parse_case``; stock_schnell,
    patched_schnell, patched_fast_cached_kontext, patched_fill_fp8, stock_kontext_cn ...):

    * ``_schnell``: FLUX.1-schnell -- UNETLoader of ``<unet stem>_schnell.safetensors`` (--weights without
      ``guidance_in``: ComfyUI detects FluxSchnell), SCHNELL_STEPS (4) steps whatever ``steps`` says
      (euler, simple, cfg 1 as every case).
    * ``_kontext``: a FLUX.1 Kontext-style reference image -- a seeded random image (res x res) ->
      VAEEncode -> ReferenceLatent on the positive conditioning (the dev weights: the reference
      latent's tokens join the image tokens, twice the sequence).
    * ``_fill``: FLUX.1 Fill -- UNETLoader of ``<unet stem>_fill.safetensors`` (img_in [hidden, 384]:
      FluxInpaint), InpaintModelConditioning (positive, negative, the VAE, a seeded random image, a mask
      of its lower half, noise_mask) whose latent goes into the KSampler.
    * ``_redux``: FLUX.1 Redux's longer context -- FluxNumbaBenchConditioning with 256 + 729 tokens.  A
      stand-in for the token count StyleModelApply gives (729 SigLIP image tokens appended to the T5
      context), not the style model: no CLIP vision, no Redux weights.
    * ``_cn``: a FLUX ControlNet -- ControlNetLoader of ``<unet stem>_cn.safetensors`` (a random
      XLabs-layout ControlNet, CN_DEPTH double blocks, in models/controlnet), ControlNetApplyAdvanced
      (strength 0.7, 0 -> 1) with a seeded random hint image on both conditionings.

    Conditioning order where several combine: ReferenceLatent, then ControlNet, then
    InpaintModelConditioning.  In patched cases VAEEncode / InpaintModelConditioning take the same VAE
    as VAEDecode (FluxNumbaVAEPatch's clone; its encoder is ComfyUI's).  The reference / picture / hint
    images have fixed seeds (as a user re-running with a new noise seed keeps them); ComfyUI's cache
    re-encodes them only when the VAE input changes (so an interleaved stock / patched pair encodes in
    every prompt, as a decode does)."""
    if case in VAE_CASES:
        return decode_graph(case, res, seed, vae)
    name = prefix + case  # the SaveImage prefix: the case's full name (image_psnr pairs files by it)
    c = parse_case(case)
    fams, base = c["families"], c["base"]
    lora, lora_before, lora_strength = c["lora"], c["lora_before"], c["lora_strength"]
    eager, sdpa = c["eager"], c["sdpa"]  # eager: cuda_graph off, every block eager (the host path's own cost)
    control = {"stock_cudnn": "cudnn", "stock_flash": "flash"}.get(base)
    patched = base in PATCHED_BASES
    profile = {"patched_fast": "fast", "patched_fast_cached": "fast-cached"}.get(base, "exact")
    unet_name = (family_file(unet, "schnell") if "schnell" in fams else
                 family_file(unet, "fill") if "fill" in fams else
                 scaled_fp8_file(unet) if c["quant"] == "fp8s" else gguf_file(unet) if c["quant"] == "gguf" else unet)
    if "schnell" in fams:
        steps = SCHNELL_STEPS
    g = {
        "unet": ({"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": unet_name}} if c["quant"] == "gguf" else
                 {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name,
                                                         "weight_dtype": "fp8_e4m3fn" if c["fp8"] else "default"}}),
        "cond": {"class_type": "FluxNumbaBenchConditioning", "inputs": {
            "seed": 3, "tokens": 256 + (REDUX_TOKENS if "redux" in fams else 0),
            "context_dim": cond_dims[0], "pooled_dim": cond_dims[1]}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
    }
    if "fill" not in fams:
        g["lat"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": res, "height": res, "batch_size": 1}}
    model = ["unet", 0]
    vae_ref = ["vae", 0]
    if control:
        g["sdpa"] = {"class_type": "FluxNumbaBenchSDPA", "inputs": {"model": model, "backend": control}}
        model = ["sdpa", 0]

    def with_lora(model):
        g["lora"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": model, "lora_name": LORA_FILE,
                                                                     "strength_model": lora_strength}}
        return ["lora", 0]
    if lora and (lora_before or not patched):
        model = with_lora(model)
    if patched:
        g["patch"] = {"class_type": "FluxNumbaPatch", "inputs": {
            "model": model, "profile": profile, "route_norms": True, "attention": "sdpa" if sdpa else "auto",
            "backend": "auto",
            "cuda_graph": "off" if eager else "auto"}}
        model = ["patch", 0]
        if not stock_vae:
            g["vpatch"] = {"class_type": "FluxNumbaVAEPatch", "inputs": {"vae": vae_ref, "enabled": True, "backend": "auto"}}
            vae_ref = ["vpatch", 0]
    if lora and patched and not lora_before:  # LoRA after the patch: a clone of the patched model
        model = with_lora(model)
    cache = {"easycache": "EasyCache", "stock_easycache": "EasyCache",
             "lazycache": "LazyCache", "stock_lazycache": "LazyCache"}.get(base)
    if cache:
        g["cache"] = {"class_type": cache, "inputs": {"model": model, "reuse_threshold": c["threshold"],
                                                      "start_percent": 0.15, "end_percent": 0.95, "verbose": False}}
        model = ["cache", 0]
    pos = neg = ["cond", 0]
    latent = ["lat", 0]
    if "kontext" in fams:
        g["ref_img"] = {"class_type": "FluxNumbaBenchImage", "inputs": {"seed": 5, "width": res, "height": res}}
        g["ref_enc"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["ref_img", 0], "vae": vae_ref}}
        g["ref"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": pos, "latent": ["ref_enc", 0]}}
        pos = ["ref", 0]
    if "cn" in fams:
        g["cn"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": family_file(unet, "cn")}}
        g["cn_img"] = {"class_type": "FluxNumbaBenchImage", "inputs": {"seed": 6, "width": res, "height": res}}
        g["cn_apply"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
            "positive": pos, "negative": neg, "control_net": ["cn", 0], "image": ["cn_img", 0],
            "strength": CN_STRENGTH, "start_percent": 0.0, "end_percent": 1.0}}
        pos, neg = ["cn_apply", 0], ["cn_apply", 1]
    if "fill" in fams:
        g["fill_img"] = {"class_type": "FluxNumbaBenchImage", "inputs": {"seed": 4, "width": res, "height": res}}
        g["fill_mask"] = {"class_type": "FluxNumbaBenchMask", "inputs": {"width": res, "height": res}}
        g["inpaint"] = {"class_type": "InpaintModelConditioning", "inputs": {
            "positive": pos, "negative": neg, "vae": vae_ref, "pixels": ["fill_img", 0], "mask": ["fill_mask", 0],
            "noise_mask": True}}
        pos, neg, latent = ["inpaint", 0], ["inpaint", 1], ["inpaint", 2]
    g["ks"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": pos, "negative": neg, "latent_image": latent, "denoise": 1.0}}
    g["dec"] = {"class_type": "VAEDecode", "inputs": {"samples": ["ks", 0], "vae": vae_ref}}
    g["save"] = {"class_type": "SaveImage", "inputs": {"images": ["dec", 0], "filename_prefix": name}}
    return g


def stock_partner(case, cases):
    """The case in ``cases`` whose images ``case``'s are compared with: the plain stock case of the same
    family members, fp8-ness and LoRA (``_lorab`` as ``_lora``, same strength) -- stock_fp8 for *_fp8,
    stock_schnell for patched_schnell, stock_lora for patched_lorab; None if there is none (or
    ``case`` is it, or a decode-only case)."""
    def key(c):
        try:
            p = parse_case(c)
        except ValueError:
            return None
        if p["vae"]:
            return None
        return p["fp8"], p["families"], p["quant"], p["lora"].replace("_lorab", "_lora")
    k = key(case)
    if k is None:
        return None
    for c in cases:
        if key(c) == k:
            p = parse_case(c)
            if p["base"] == "stock" and not p["eager"] and not p["sdpa"]:
                return None if c == case else c
    return None


def run_order(cases, repeat, interleave):
    """[(case, run index)] in the order the prompts are queued.  --interleave: run by run, each case
    once per round -- within each checkpoint's group of cases (--weights, its _schnell, its _fill
    file; groups in the order of their first case): ComfyUI holds one of these 24 GB models on the
    GPU at a time, so a round over cases of several checkpoints would put a model load (seconds)
    into the first case after each switch; grouped, only each group's run 1 (left out of the medians
    over runs 2..N) pays it.  Cases of one checkpoint keep the plain interleaved order.  Without
    --interleave: each case's runs in a row."""
    if not interleave:
        return [(c, i) for c in cases for i in range(repeat)]
    groups = {}
    for c in cases:
        pc = {"families": (), "quant": None} if c in VAE_CASES else parse_case(c)
        fams = pc["families"]
        groups.setdefault("schnell" if "schnell" in fams else "fill" if "fill" in fams else pc["quant"] or "",
                          []).append(c)
    return [(c, i) for grp in groups.values() for i in range(repeat) for c in grp]
