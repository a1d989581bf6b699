"""ComfyUI's VAE decoder as the VAE patch meets it (``comfy.ldm.modules.diffusionmodules.model``):
its classes, the forward signatures its decoder calls them with, ComfyUI's per-op hook, and the
patched clone of the decoder that the VAE node hands to ComfyUI as an object patch.

The NHWC math itself is ComfyUI-free (``flux_core.vae``); this module maps ComfyUI onto it
(``ComfyDecoderHost``): v0.33 calls ``ResnetBlock.forward(x, temb, conv_carry_in, conv_carry_out)``
and ``Upsample.forward(x, conv_carry_in, conv_carry_out)`` (v0.8.0 takes the same calls with the
extra arguments defaulted); the attention is ComfyUI's choice (``pytorch_attention`` -> the pack's
``vae_attention``).  Patched call sites (2-D decoders only; anything else runs the stock forward):
ResnetBlock, AttnBlock, Decoder (norm_out + nonlinearity, the NHWC body), Upsample.
Under DynamicVRAM the NHWC decode stages all decoder weights once (``staged_block``) and the low-res
graph keys on their residency (``_graph_state``); a re-run of the node on the same VAE and options hands
out the same patched decoder (``_reused_decoder``).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import sys
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

from ...cuda_kernels import registry
from ...flux_core import vae
from ...flux_core.graphs import is_interrupt, is_oom
from .flux import op_weights
from .wrappers import drop_on_unload

log = logging.getLogger("flux_numba")
NODE_ID = "FluxNumbaVAEPatch"

_run_every_op = None


def every_op():
    """ComfyUI's per-op hook (``comfy.ops.run_every_op``: the interrupt check and the like), called
    once per op the patched decoder runs; nothing outside ComfyUI."""
    global _run_every_op
    if _run_every_op is None:
        try:
            import comfy.ops
            _run_every_op = comfy.ops.run_every_op
        except Exception:  # outside ComfyUI
            _run_every_op = lambda: None  # noqa: E731
    _run_every_op()


def decoder_classes() -> dict:
    """ComfyUI's decoder building blocks by name (ResnetBlock, AttnBlock, Decoder, Upsample)."""
    import comfy.ldm.modules.diffusionmodules.model as M
    return {"ResnetBlock": M.ResnetBlock, "AttnBlock": M.AttnBlock, "Decoder": M.Decoder, "Upsample": M.Upsample}


class ComfyDecoderHost(vae.DecoderHost):
    """``flux_core.vae.DecoderHost`` for ComfyUI's decoder: weights through ComfyUI's op casts
    (``op_weights``: DynamicVRAM staging, low-VRAM offload, weight functions), ComfyUI's per-op hook,
    its blocks called with its signatures, its attention choice."""

    @contextlib.contextmanager
    def module(self, m, like):
        with op_weights(m, like) as wb:
            yield wb

    def every_op(self):
        every_op()

    def call_block(self, blk, h, kwargs):
        return blk(h, None, None, None, **kwargs)  # temb, conv_carry_in, conv_carry_out

    def call_attn(self, blk, h, kwargs):
        return blk(h, **kwargs)

    def call_upsample(self, up, h):
        return up(h, None, None)  # conv_carry_in, conv_carry_out

    def sdpa_attention(self, blk) -> bool:
        return getattr(blk.optimized_attention, "__name__", "") == "pytorch_attention"

    def attention(self, blk, q, k, v):
        return blk.optimized_attention(q, k, v)  # ComfyUI's choice for the VAE (xformers, split, SDPA ...)


HOST = ComfyDecoderHost()


def _graph_state(dec, device):
    """What the low-resolution graph may do this decode: (reasons, weights key[, can_capture]).

    A DynamicVRAM decoder (comfy-aimdo vbar weights; the decode runs inside ``staged_block``, which
    stages and pins all of them): the key is the weights' residency (``block_residency``: page
    signatures, as for a FLUX block), and a capture waits until ``capture_headroom`` finds room for
    it; weights that are streamed -> eager.  Otherwise ``graph_state`` (weights' addresses; per-call
    weight work -> eager).  Looked up on the host package at call time (one place to replace them)."""
    host = sys.modules[__package__]
    if device.type == "cuda" and host.dynamic_block(dec):
        key, why, pins = host.block_residency(dec, device, None)
        host.release_pins(pins)   # (the staging holds the decode's own pins)
        if key is None:
            return [why], None
        if torch.cuda.is_current_stream_capturing():
            return ["already inside a capture"], None
        return [], key, lambda: host.capture_headroom(pins, device)
    return host.graph_state(dec, device)


# ------------------------------------------------------------------ the patched classes' forwards
@dataclass
class DecoderPlan:
    """What a patched decoder is: the stock decoder it was made from, the VAE patch's settings, its
    low-resolution CUDA graph (None: cuda_graph off) and the latent shapes whose NHWC path failed
    (those run the NCHW path).  One attribute of the patched decoder (``plan_of``)."""
    original: torch.nn.Module
    backend: str = "auto"
    layout: str = "nhwc"
    graph: Optional[object] = None  # flux_core.vae.LowResGraph
    nhwc_failed: set = field(default_factory=set)


PLAN_ATTR = "_flux_numba_plan"  # (in the module's __dict__: not a submodule, no state-dict keys)


def plan_of(decoder) -> Optional[DecoderPlan]:
    """The DecoderPlan of a decoder the VAE patch made, else None."""
    return getattr(decoder, "__dict__", {}).get(PLAN_ATTR)


def _resnet_forward(self, x, temb=None, conv_carry_in=None, conv_carry_out=None, **kwargs):
    base = type(self).__mro__[1]
    if x.ndim != 4 or temb is not None or conv_carry_in is not None or conv_carry_out is not None or kwargs:
        return base.forward(self, x, temb, conv_carry_in, conv_carry_out, **kwargs)
    return vae.resnet(self, x, HOST)


def _attn_forward(self, x, **kwargs):
    base = type(self).__mro__[1]
    if x.ndim != 4 or kwargs:
        return base.forward(self, x, **kwargs)
    return vae.attn(self, x, HOST)


def _upsample_forward(self, x, *args, **kwargs):
    base = type(self).__mro__[1]
    if kwargs or any(a is not None for a in args) or not vae.is_nhwc(x) or not vae.is_2x(self.scale_factor):
        return base.forward(self, x, *args, **kwargs)
    return vae.upsample_nhwc(self, x, HOST)


def _decoder_forward(self, z, **kwargs):
    base = type(self).__mro__[1]
    if z.ndim != 4 or self.carried:
        return base.forward(self, z, **kwargs)
    plan = plan_of(self) or DecoderPlan(self, layout="nchw")
    backend = plan.backend
    with vae.backend_ctx(backend):
        why = vae.nhwc_problem(z, kwargs, plan.layout, backend, plan.nhwc_failed)
        if why is None:
            host = sys.modules[__package__]
            try:
                # DynamicVRAM: every decoder weight staged once for the decode (as ComfyUI's block
                # prefetch does), not op by op with a stream round trip each
                with host.staged_block(self, z.device, host.dynamic_block(self)):
                    return vae.decode_nhwc(self, z, HOST, kwargs, low=plan.graph)
            except Exception as e:  # logged once; this shape then runs the NCHW path
                if registry.strict or is_oom(e) or is_interrupt(e):
                    raise
                plan.nhwc_failed.add(tuple(z.shape))
                log.warning("[flux_numba] %s: NHWC decoder path failed for latent %s (%s: %s); "
                            "that shape runs the NCHW path", NODE_ID, tuple(z.shape), type(e).__name__, e)
        return vae.body(self, z, HOST, kwargs)


FORWARDS = {"ResnetBlock": _resnet_forward, "AttnBlock": _attn_forward, "Decoder": _decoder_forward,
            "Upsample": _upsample_forward}
_CLASSES = {}


def _patched_class(cls, fwd):
    key = (cls, fwd)
    if key not in _CLASSES:
        _CLASSES[key] = type("FluxNumba" + cls.__name__, (cls,), {"forward": fwd, "__module__": __name__})
    return _CLASSES[key]


def _clone_module(m, cls):
    """Shallow module clone: own __dict__ / _modules / _parameters / _buffers, shared leaves."""
    new = object.__new__(cls)
    new.__dict__ = m.__dict__.copy()
    for k in ("_modules", "_parameters", "_buffers"):
        if k in new.__dict__:
            new.__dict__[k] = copy.copy(m.__dict__[k])
    return new


def patched_decoder(decoder, backend: str = "auto", layout: str = "nhwc", cuda_graph: str = "auto"):
    """Return (patched clone of ``decoder``, counts).  ``decoder`` itself is not modified: the clone
    is a tree of cloned module objects (fresh ``__dict__`` / ``_modules``) down to each ResnetBlock /
    AttnBlock / Upsample, whose class is a thin subclass with a patched ``forward``; every leaf
    (conv, GroupNorm, their parameters) is the original object, so weights are shared, state-dict
    keys are unchanged, and ComfyUI's loading / low-VRAM casting / offloading act on the same
    parameters.  ``cuda_graph`` "auto": the NHWC path replays its low-resolution stage as a CUDA graph
    (``flux_core.vae.LowResGraph``); "off": always eager."""
    classes = decoder_classes()
    table = {classes[name]: fwd for name, fwd in FORWARDS.items()}
    counts = {name: 0 for name in FORWARDS}

    def rebuild(m):
        fwd = table.get(type(m))  # exact types only: subclasses may have other forwards
        kids = {name: rebuild(c) if c is not None else None for name, c in m._modules.items()}
        if fwd is None and all(kids[n] is m._modules[n] for n in kids):
            return m
        new = _clone_module(m, _patched_class(type(m), fwd) if fwd is not None else type(m))
        new._modules.update(kids)
        if fwd is not None:
            counts[type(m).__name__] += 1
        return new

    new = rebuild(decoder)
    new.__dict__[PLAN_ATTR] = DecoderPlan(decoder, backend, layout,
                                          vae.LowResGraph(HOST, _graph_state, NODE_ID) if cuda_graph == "auto" else None)
    return new, counts


def is_patched(decoder) -> bool:
    return type(decoder).__name__.startswith("FluxNumba")


def original_decoder(decoder):
    """The stock decoder behind ``decoder``: ComfyUI applies an object patch in place, so after a
    patched VAE decoded, ``first_stage_model.decoder`` IS our clone until another patcher of that VAE
    loads -- a node re-run then (new widget values, a second patch node on the same VAE) patches the
    original again instead of refusing."""
    while is_patched(decoder) and plan_of(decoder) is not None:
        decoder = plan_of(decoder).original
    return decoder


def why_not_patchable(vae_obj) -> Optional[str]:
    """None when ``vae_obj`` has a FLUX-style (16-channel, 2-D) ComfyUI Decoder, else the reason."""
    fsm = getattr(vae_obj, "first_stage_model", None)
    dec = original_decoder(getattr(fsm, "decoder", None))
    if dec is None or getattr(vae_obj, "patcher", None) is None:
        return "no first_stage_model.decoder / patcher"
    try:
        classes = decoder_classes()
    except Exception as e:
        return f"ComfyUI's VAE model module not importable ({e})"
    if is_patched(dec):
        return "decoder already patched"
    if type(dec) is not classes["Decoder"]:
        return f"decoder is {type(dec).__module__}.{type(dec).__name__}, not the image Decoder of model.py"
    lc = getattr(vae_obj, "latent_channels", None)
    if lc != 16:
        return f"latent channels {lc} (the FLUX VAE has 16)"
    if getattr(dec, "carried", False) or not isinstance(dec.conv_in, torch.nn.Conv2d):
        return "video (3-D) decoder"
    return None


# The last REUSE_MAX patched decoders, keyed by (the VAE's model, options): re-executing the VAE patch
# on the same VAE (a workflow alternating with one that lacks the node evicts its cached output, so
# ComfyUI runs the node again) hands out the same patched decoder -- its low-resolution CUDA graph
# included -- instead of warming up (two eager decodes) and capturing again on every such prompt.
# An entry goes when the VAE's model is collected (the patched decoder holds the original decoder,
# not the model around it), or when newer ones push it out.
_REUSE = OrderedDict()
REUSE_MAX = 3


def _reused_decoder(fsm, orig, backend, layout, cuda_graph):
    """(patched decoder, counts) for ``orig`` (the decoder of ``fsm``, a VAE's first_stage_model)."""
    key = (id(fsm), backend, layout, cuda_graph)
    hit = _REUSE.get(key)
    if hit is not None and hit[0]() is fsm and plan_of(hit[1]).original is orig:
        _REUSE.move_to_end(key)
        return hit[1], hit[2]
    dec, counts = patched_decoder(orig, backend, layout, cuda_graph)
    try:
        ref = weakref.ref(fsm)
        weakref.finalize(fsm, _REUSE.pop, key, None)
    except TypeError:  # not weak-referenceable: no reuse
        return dec, counts
    _REUSE[key] = (ref, dec, counts)
    while len(_REUSE) > REUSE_MAX:
        _REUSE.popitem(last=False)
    return dec, counts


def patch_vae(vae_obj, backend: str = "auto", layout: str = "nhwc", cuda_graph: str = "auto"):
    """A shallow copy of ``vae_obj`` whose ``patcher`` is a ``ModelPatcher.clone()`` carrying ONE object
    patch, ``"decoder"`` -> the patched decoder; returns (vae, counts) or (the input, reason str).

    ComfyUI applies the object patch when it loads this VAE's patcher (``VAE.decode`` and the tiled
    decoders call ``load_models_gpu([self.patcher])`` first) and restores the stock decoder when the
    original VAE's patcher is loaded again (``unpatch_model`` restores object patches from the backup
    shared by clones).  The low-resolution graph is dropped when ComfyUI unloads the VAE.  The same
    VAE patched again with the same options gets the same patched decoder (``_reused_decoder``)."""
    why = why_not_patchable(vae_obj)
    if why:
        return vae_obj, why
    fsm = vae_obj.first_stage_model
    dec, counts = _reused_decoder(fsm, original_decoder(fsm.decoder), backend, layout, cuda_graph)
    out = copy.copy(vae_obj)
    out.patcher = vae_obj.patcher.clone()
    out.patcher.add_object_patch("decoder", dec)
    g = plan_of(dec).graph
    if g is not None and not drop_on_unload(out.patcher, "flux_numba_vae_graph", lambda: g.drop()):
        log.info("[flux_numba] %s: no detach callback on this host; the low-res graph lives as long as the VAE",
                 NODE_ID)
    return out, counts


def random_vae_state_dict(seed: int = 1, generator: torch.Generator = None) -> dict:
    """Random weights for ComfyUI's FLUX VAE (ch 128, mult [1, 2, 4, 4], z 16), in the layout
    ``comfy.sd.VAE(sd=...)`` detects: N(0, 1/fan_in) convs, small biases, norm weights near 1
    (ComfyUI's AutoencodingEngine names the tensors); the benchmark and the server / browser tests
    use it when no real VAE file is at hand.  ``generator`` (instead of
    ``seed``): draw from the caller's CPU generator, which then continues past these tensors."""
    import math
    from comfy.ldm.models.autoencoder import AutoencodingEngine
    dd = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
          "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    m = AutoencodingEngine(regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                           encoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", "params": dd},
                           decoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Decoder", "params": dd})
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in m.state_dict().items():
        r = torch.randn(v.shape, generator=g)
        sd[k] = ((1 + 0.2 * r) if ("norm" in k and k.endswith("weight")) else
                 (0.05 * r if v.ndim == 1 else r / math.sqrt(v[0].numel()))).contiguous()
    return sd
