"""FluxNumbaVAEPatch: route the FLUX VAE decoder's GroupNorm(+SiLU) pairs through the op registry.

VAE -> VAE.  The input VAE object is never mutated: the node returns a shallow copy whose
``patcher`` is a ``ModelPatcher.clone()`` carrying ONE object patch, ``"decoder"`` -> a patched
copy of the decoder.  The copy is a tree of *cloned module objects* (fresh ``__dict__`` /
``_modules``) down to each ResnetBlock / AttnBlock, whose class is a thin subclass with a
patched ``forward``; every leaf (conv, GroupNorm, their parameters) is the original object, so
weights are shared, state-dict keys are unchanged, and ComfyUI's loading / low-VRAM casting /
offloading act on the same parameters.

ComfyUI applies the object patch when it loads this VAE's patcher (``VAE.decode`` and the
tiled decoders call ``load_models_gpu([self.patcher])`` first) and restores the stock decoder
when the original VAE's patcher is loaded again (``unpatch_model`` restores object patches
from the backup shared by clones).  Tiled decode and the mid-block attention (``AttnBlock``
keeps its ``optimized_attention``) work unchanged: only ``norm -> swish`` pairs change.

Patched call sites (2-D decoders only; anything else runs the stock forward):
  ResnetBlock: norm1+swish, norm2+swish -> ``groupnorm_silu(..., silu=True)``
  AttnBlock:   norm                     -> ``groupnorm_silu(..., silu=False)``
  Decoder:     norm_out+nonlinearity    -> ``groupnorm_silu(..., silu=True)``

No ComfyUI import at module level (schema tests import this without ComfyUI).
"""
from __future__ import annotations

import contextlib
import copy
import logging

import torch

from ..cuda_kernels import registry, runtime
from .host import op_weights

log = logging.getLogger("flux_numba")

OP = "groupnorm_silu"
NODE_ID = "FluxNumbaVAEPatch"
BACKENDS = ("auto", "numba", "torch")

_run_every_op = None


def _every_op():
    global _run_every_op
    if _run_every_op is None:
        try:
            import comfy.ops
            _run_every_op = comfy.ops.run_every_op
        except Exception:  # pragma: no cover - outside ComfyUI
            _run_every_op = lambda: None  # noqa: E731
    _run_every_op()


def group_norm_act(norm, x, silu: bool):
    """``norm(x)`` (+ SiLU) through the registry, honouring ComfyUI's weight casting."""
    _every_op()
    with op_weights(norm, x) as (w, b):
        return registry.call(OP, x, norm.num_groups, w, b, norm.eps, silu=silu)


def _backend_ctx(mod):
    b = getattr(mod, "_flux_numba_backend", "auto")
    return contextlib.nullcontext() if b == "auto" else registry.force(b, ops=[OP])


# ------------------------------------------------------------------ patched forwards
def _resnet_forward(self, x, temb=None, conv_carry_in=None, conv_carry_out=None, **kwargs):
    base = type(self).__mro__[1]
    if x.ndim != 4 or temb is not None or conv_carry_in is not None or conv_carry_out is not None or kwargs:
        return base.forward(self, x, temb, conv_carry_in, conv_carry_out, **kwargs)
    h = group_norm_act(self.norm1, x, True)
    h = self.conv1(h)
    h = group_norm_act(self.norm2, h, True)
    h = self.dropout(h)
    h = self.conv2(h)
    if self.in_channels != self.out_channels:
        x = self.conv_shortcut(x) if self.use_conv_shortcut else self.nin_shortcut(x)
    return x + h


def _attn_forward(self, x, **kwargs):
    base = type(self).__mro__[1]
    if x.ndim != 4 or kwargs:
        return base.forward(self, x, **kwargs)
    h_ = group_norm_act(self.norm, x, False)
    q = self.q(h_)
    k = self.k(h_)
    v = self.v(h_)
    h_ = self.optimized_attention(q, k, v)
    h_ = self.proj_out(h_)
    return x + h_


def _decoder_forward(self, z, **kwargs):
    base = type(self).__mro__[1]
    if z.ndim != 4 or self.carried:
        return base.forward(self, z, **kwargs)
    with _backend_ctx(self):
        temb = None
        h = self.conv_in(z)
        h = self.mid.block_1(h, temb, **kwargs)
        h = self.mid.attn_1(h, **kwargs)
        h = self.mid.block_2(h, temb, **kwargs)
        for i_level in reversed(range(self.num_resolutions)):
            for i_block in range(self.num_res_blocks + 1):
                h = self.up[i_level].block[i_block](h, temb, None, None, **kwargs)
                if len(self.up[i_level].attn) > 0:
                    h = self.up[i_level].attn[i_block](h, **kwargs)
            if i_level != 0:
                h = self.up[i_level].upsample(h, None, None)
        h = group_norm_act(self.norm_out, h, True)
        h = self.conv_out(h)
        if self.tanh_out:
            h = torch.tanh(h)
        return h


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


def patched_decoder(decoder, backend: str = "auto"):
    """Return (patched clone of ``decoder``, counts).  ``decoder`` itself is not modified."""
    import comfy.ldm.modules.diffusionmodules.model as M

    table = {M.ResnetBlock: _resnet_forward, M.AttnBlock: _attn_forward, M.Decoder: _decoder_forward}
    counts = {"ResnetBlock": 0, "AttnBlock": 0, "Decoder": 0}

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
    new._flux_numba_backend = backend
    return new, counts


def is_patched(decoder) -> bool:
    return type(decoder).__name__.startswith("FluxNumba")


def why_not_patchable(vae):
    """None when ``vae`` has a FLUX-style (16-channel, 2-D) ComfyUI Decoder, else the reason."""
    fsm = getattr(vae, "first_stage_model", None)
    dec = getattr(fsm, "decoder", None)
    if dec is None or getattr(vae, "patcher", None) is None:
        return "no first_stage_model.decoder / patcher"
    try:
        import comfy.ldm.modules.diffusionmodules.model as M
    except Exception as e:
        return f"ComfyUI's VAE model module not importable ({e})"
    if is_patched(dec):
        return "decoder already patched"
    if type(dec) is not M.Decoder:
        return f"decoder is {type(dec).__module__}.{type(dec).__name__}, not the image Decoder of model.py"
    lc = getattr(vae, "latent_channels", None)
    if lc != 16:
        return f"latent channels {lc} (the FLUX VAE has 16)"
    if getattr(dec, "carried", False) or not isinstance(dec.conv_in, torch.nn.Conv2d):
        return "video (3-D) decoder"
    return None


def patch_vae(vae, backend: str = "auto"):
    """Clone ``vae`` with the patched decoder as an object patch; returns (vae, info or reason str)."""
    why = why_not_patchable(vae)
    if why:
        return vae, why
    dec, counts = patched_decoder(vae.first_stage_model.decoder, backend)
    out = copy.copy(vae)
    out.patcher = vae.patcher.clone()
    out.patcher.add_object_patch("decoder", dec)
    return out, counts


class FluxNumbaVAEPatch:
    """Decode FLUX latents with fused GroupNorm+SiLU Numba kernels (reversible clone)."""

    CATEGORY = "FluxNumba"
    RETURN_TYPES = ("VAE",)
    RETURN_NAMES = ("vae",)
    FUNCTION = "patch"
    DESCRIPTION = ("Clones the VAE and routes the FLUX VAE decoder's GroupNorm+SiLU pairs through fused "
                   "Numba-CUDA kernels. The input VAE is untouched; other VAEs pass through.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "vae": ("VAE",),
                "enabled": ("BOOLEAN", {"default": True}),
                "backend": (list(BACKENDS), {"default": "auto",
                                             "tooltip": "auto: fastest accepted backend; torch: stock math (A/B)"}),
            }
        }

    def patch(self, vae, enabled=True, backend="auto"):
        if backend not in BACKENDS:
            raise ValueError(f"{NODE_ID}: backend must be one of {list(BACKENDS)}, got {backend!r}")
        if not isinstance(enabled, (bool, int)):
            raise ValueError(f"{NODE_ID}: enabled must be a boolean, got {enabled!r}")
        if not enabled:
            log.info("[flux_numba] %s disabled: VAE passes through stock", NODE_ID)
            return (vae,)
        why = runtime.numba_status()
        if why is None and not runtime.SIMULATOR and not torch.cuda.is_available():
            why = "no CUDA device"
        if why:
            log.warning("[flux_numba] %s passes the VAE through unpatched: %s", NODE_ID, why)
            return (vae,)
        out, info = patch_vae(vae, backend)
        if isinstance(info, str):
            log.info("[flux_numba] %s passes the VAE through unpatched: %s", NODE_ID, info)
            return (vae,)
        log.info("[flux_numba] %s: decoder patched (%d ResnetBlocks, %d AttnBlocks, norm_out), backend %s",
                 NODE_ID, info["ResnetBlock"], info["AttnBlock"], backend)
        return (out,)


NODE_CLASS_MAPPINGS = {NODE_ID: FluxNumbaVAEPatch}
NODE_DISPLAY_NAME_MAPPINGS = {NODE_ID: "FLUX VAE Patch (Numba GroupNorm+SiLU)"}
