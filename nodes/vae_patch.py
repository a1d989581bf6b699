"""FluxNumbaVAEPatch: the FLUX VAE decoder through the op registry, NHWC end to end.

VAE -> VAE.  The input VAE object is never mutated: the node returns a shallow copy whose
``patcher`` is a ``ModelPatcher.clone()`` carrying ONE object patch, ``"decoder"`` -> a patched
copy of the decoder.  The copy is a tree of *cloned module objects* (fresh ``__dict__`` /
``_modules``) down to each ResnetBlock / AttnBlock / Upsample, whose class is a thin subclass with
a patched ``forward``; every leaf (conv, GroupNorm, their parameters) is the original object, so
weights are shared, state-dict keys are unchanged, and ComfyUI's loading / low-VRAM casting /
offloading act on the same parameters.

ComfyUI applies the object patch when it loads this VAE's patcher (``VAE.decode`` and the
tiled decoders call ``load_models_gpu([self.patcher])`` first) and restores the stock decoder
when the original VAE's patcher is loaded again (``unpatch_model`` restores object patches
from the backup shared by clones).  Tiled decode and the mid-block attention (``AttnBlock``
keeps its ``optimized_attention``) work unchanged.

Layout "nhwc" (default; bf16 decoders, backend not "torch"): the latent is made channels_last once
at entry and the image NCHW once at exit; in between every activation stays channels_last, so
each of ComfyUI's own convolutions (its ops, its weight casting) runs cuDNN's NHWC implicit GEMM
without the nchwToNhwc / nhwcToNchw conversions cuDNN wraps around an NCHW bf16 convolution (8.1 ms
of a 1024^2 decode).  The ops between the convolutions that torch runs slowly on channels_last
memory are ours: GroupNorm(+SiLU) -> ``groupnorm_silu_nhwc``, the Upsample's nearest 2x ->
``upsample_nearest2x``, and each convolution's bias, which torch's cuDNN path adds in a slow
broadcast pass of its own: the convolution runs without it (``conv._conv_forward`` with the weights
``op_weights`` gets, as ComfyUI's op would), then a ResnetBlock's conv1 bias goes into norm2's
statistics (``pre_bias``), conv2's bias and the residual add are one ``bias_residual_nhwc`` pass
(the attention's proj_out likewise), every other conv's bias a ``bias_residual_nhwc`` pass alone.
The mid block's attention (head dim 512, where torch's SDPA falls back to its mem-efficient kernel)
-> ``vae_attention`` when ComfyUI's choice is ``pytorch_attention`` (its SDPA is the reference);
xformers / split attention stay ComfyUI's and take the channels_last q / k / v as they are.
An exception inside the NHWC path (other than out-of-memory, which ComfyUI's own tiled fallback
handles) is logged once and that latent shape then runs the NCHW path.  The low-resolution stage
(everything at the latent's resolution, host-bound op by op) replays as a CUDA graph from the third
decode of a shape on (``LowResGraph``, input ``cuda_graph``), for as long as ComfyUI keeps the VAE
loaded (its patcher's detach drops the graph).
Layout "nchw" (and fp32 / fp16 VAEs, decoder keyword arguments): stock memory layout with the
GroupNorm(+SiLU) pairs routed through ``groupnorm_silu``.
Patched call sites (2-D decoders only; anything else runs the stock forward):
  ResnetBlock: norm1+swish, norm2+swish -> ``groupnorm_silu[_nhwc](..., silu=True)``
  AttnBlock:   norm                     -> ``groupnorm_silu[_nhwc](..., silu=False)``
  Decoder:     norm_out+nonlinearity    -> ``groupnorm_silu[_nhwc](..., silu=True)``
  Upsample:    nearest 2x of a channels_last x -> ``upsample_nearest2x``, then its conv

No ComfyUI import at module level (schema tests import this without ComfyUI).
"""
from __future__ import annotations

import contextlib
import copy
import logging

import torch

from ..cuda_kernels import ops, registry, runtime
from .host import drop_on_unload, op_weights

log = logging.getLogger("flux_numba")

OP = "groupnorm_silu"
NHWC_OP = "groupnorm_silu_nhwc"
UP_OP = "upsample_nearest2x"
BR_OP = "bias_residual_nhwc"
VA_OP = "vae_attention"
NODE_ID = "FluxNumbaVAEPatch"
BACKENDS = ("auto", "numba", "torch")
LAYOUTS = ("nhwc", "nchw")
CUDA_GRAPHS = ("auto", "off")
CL = torch.channels_last

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


def _is_nhwc(x):
    """x is a 4-D channels_last activation (the NHWC path's), not a plain NCHW one."""
    return x.ndim == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=CL)


def group_norm_act(norm, x, silu: bool, pre_bias=None):
    """``norm(x [+ pre_bias])`` (+ SiLU) through the registry, honouring ComfyUI's weight casting;
    ``pre_bias`` (the producing conv's bias, not yet added) only on the NHWC path."""
    _every_op()
    with op_weights(norm, x) as (w, b):
        if _is_nhwc(x):
            kw = {} if pre_bias is None else {"pre_bias": pre_bias}
            return ops.groupnorm_silu_nhwc(x, norm.num_groups, w, b, norm.eps, silu=silu, **kw)
        if pre_bias is not None:
            x = x + pre_bias.to(x.dtype).view(1, -1, 1, 1)
        return ops.groupnorm_silu(x, norm.num_groups, w, b, norm.eps, silu=silu)


def _backend_ctx(mod):
    b = getattr(mod, "_flux_numba_backend", "auto")
    return contextlib.nullcontext() if b == "auto" else registry.force(b, ops=[OP, NHWC_OP, UP_OP, BR_OP, VA_OP])


# ------------------------------------------------------------------ NHWC path
def _plain_conv(conv):
    return isinstance(conv, torch.nn.Conv2d) and hasattr(conv, "_conv_forward")


@contextlib.contextmanager
def _conv_without_bias(conv, x):
    """(y, bias): ComfyUI's convolution of channels_last ``x`` without its bias (weights as its op
    gets them: ``op_weights``, valid inside the context), y channels_last."""
    _every_op()
    with op_weights(conv, x) as (w, b):
        y = conv._conv_forward(x, w, None)
        if not _is_nhwc(y) and y.shape[1] % 8 == 0:   # (cuDNN keeps channels_last; some CPU kernels do not)
            y = y.contiguous(memory_format=CL)
        yield y, b


def _conv_nhwc(conv, x, residual=None):
    """The convolution with its bias (+ residual) added in one pass by ``bias_residual_nhwc`` instead
    of torch's broadcast add."""
    if not _plain_conv(conv):
        y = conv(x)
        return y if residual is None else y + residual
    with _conv_without_bias(conv, x) as (y, b):
        if b is None:
            return y if residual is None else y.add_(residual)
        return ops.bias_residual_nhwc(y, b, residual)


def _dropout_off(blk):
    d = getattr(blk, "dropout", None)
    return d is None or not (d.training and d.p)


def _resnet_nhwc(self, x):
    """norm1+SiLU -> conv1 (bias folded into norm2) -> norm2+SiLU -> conv2 (+ bias + shortcut, one pass)."""
    h = group_norm_act(self.norm1, x, True)
    if _plain_conv(self.conv1):
        with _conv_without_bias(self.conv1, h) as (h, b):
            h = group_norm_act(self.norm2, h, True, pre_bias=b)
    else:
        h = group_norm_act(self.norm2, self.conv1(h), True)
    if self.in_channels != self.out_channels:
        x = _conv_nhwc(self.conv_shortcut if self.use_conv_shortcut else self.nin_shortcut, x)
    return _conv_nhwc(self.conv2, h, residual=x)


def _attn_nhwc(self, x):
    h_ = group_norm_act(self.norm, x, False)
    q, k, v = (_conv_nhwc(m, h_) for m in (self.q, self.k, self.v))
    if getattr(self.optimized_attention, "__name__", "") == "pytorch_attention":
        h_ = ops.vae_attention(q, k, v)     # its reference is pytorch_attention's SDPA
    else:                                      # xformers / split attention: ComfyUI's choice stands
        h_ = self.optimized_attention(q, k, v)
    if not _is_nhwc(h_):
        h_ = h_.contiguous(memory_format=CL)
    return _conv_nhwc(self.proj_out, h_, residual=x)


# ------------------------------------------------------------------ patched forwards
def _resnet_forward(self, x, temb=None, conv_carry_in=None, conv_carry_out=None, **kwargs):
    base = type(self).__mro__[1]
    if x.ndim != 4 or temb is not None or conv_carry_in is not None or conv_carry_out is not None or kwargs:
        return base.forward(self, x, temb, conv_carry_in, conv_carry_out, **kwargs)
    if _is_nhwc(x) and _dropout_off(self):
        return _resnet_nhwc(self, x)
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
    if _is_nhwc(x):
        return _attn_nhwc(self, x)
    h_ = group_norm_act(self.norm, x, False)
    q = self.q(h_)
    k = self.k(h_)
    v = self.v(h_)
    h_ = self.optimized_attention(q, k, v)
    h_ = self.proj_out(h_)
    return x + h_


def _is_2x(sf):
    return sf in (2, 2.0) or (isinstance(sf, (tuple, list)) and len(sf) == 2 and all(v in (2, 2.0) for v in sf))


def _upsample_forward(self, x, *args, **kwargs):
    base = type(self).__mro__[1]
    if kwargs or any(a is not None for a in args) or not _is_nhwc(x) or not _is_2x(self.scale_factor):
        return base.forward(self, x, *args, **kwargs)
    x = ops.upsample_nearest2x(x)
    if self.with_conv:
        x = _conv_nhwc(self.conv, x)
    return x


def _level_blocks(self, i_level, h, kwargs):
    for i_block in range(self.num_res_blocks + 1):
        h = self.up[i_level].block[i_block](h, None, None, None, **kwargs)
        if len(self.up[i_level].attn) > 0:
            h = self.up[i_level].attn[i_block](h, **kwargs)
    return h


def _stage_low(self, z, kwargs=None):
    """conv_in, the mid block and the top level's blocks: every op at the latent's resolution (the
    stage the low-resolution graph replays)."""
    kwargs = kwargs or {}
    h = _conv_nhwc(self.conv_in, z) if _is_nhwc(z) else self.conv_in(z)
    h = self.mid.block_1(h, None, **kwargs)
    h = self.mid.attn_1(h, **kwargs)
    h = self.mid.block_2(h, None, **kwargs)
    return _level_blocks(self, self.num_resolutions - 1, h, kwargs)


def _stage_rest(self, h, kwargs):
    """The top level's upsample, the other levels, norm_out, conv_out (stock order)."""
    nhwc = _is_nhwc(h)
    top = self.num_resolutions - 1
    for i_level in reversed(range(self.num_resolutions)):
        if i_level != top:
            h = _level_blocks(self, i_level, h, kwargs)
        if i_level != 0:
            h = self.up[i_level].upsample(h, None, None)
    h = group_norm_act(self.norm_out, h, True)
    h = _conv_nhwc(self.conv_out, h) if nhwc else self.conv_out(h)
    if self.tanh_out:
        h = torch.tanh(h)
    return h


def _decoder_body(self, z, kwargs):
    return _stage_rest(self, _stage_low(self, z, kwargs), kwargs)


def _nhwc_why(self, z, kwargs):
    """None when this call runs the NHWC path, else why not."""
    if getattr(self, "_flux_numba_layout", "nchw") != "nhwc":
        return "layout nchw"
    if getattr(self, "_flux_numba_backend", "auto") == "torch":
        return "backend torch (stock math, stock layout)"
    if kwargs:
        return "decoder keyword arguments"
    if z.dtype != torch.bfloat16:
        return f"VAE dtype {z.dtype} (the NHWC path is bf16)"
    if tuple(z.shape) in self.__dict__.get("_flux_numba_nhwc_failed", ()):
        return "the NHWC path failed for this shape"
    return None


def _is_oom(e):
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _is_interrupt(e):
    """ComfyUI's "cancel" (raised by ``run_every_op`` inside any op): never a reason to change paths."""
    from ..flux_core.graphs import is_interrupt
    return is_interrupt(e)


class LowResGraph:
    """The NHWC decoder's low-resolution stage (``_stage_low``: conv_in, the mid block with its
    attention, the top level's ResnetBlocks -- at the latent's resolution, 128^2 for a 1024^2 image)
    replayed as a CUDA graph, per latent shape.

    Why that stage: its kernels are short (~0.3 ms of GPU work per ResnetBlock) and issuing them
    from Python (registry, ComfyUI's weight access, cuDNN and Numba launches, ~11 per block) takes
    longer, so without a graph the GPU idles there; every later stage is GPU-bound and the host
    issues it while the replay runs.  What the graph keeps allocated between decodes is that
    stage's activations (216 MB at 1024^2, measured; ``vae_attention`` uses small chunks inside a
    capture) -- and only while ComfyUI keeps the VAE loaded: the patched VAE's patcher drops the
    graphs when ComfyUI unloads it (``ON_DETACH`` with ``unpatch_all``: unloaded to make room), so a
    GPU too small to keep the VAE next to the diffusion model never holds them.

    ``flux_core.graphs.GraphedForward`` does the work: two eager decodes of a shape (the second
    proves the stage never syncs the host), then capture and replay; a change of any decoder
    weight's address re-captures.  Eager (reason logged once) when ``host.graph_state`` (one pass
    over the decoder's parameters per decode) says a graph is unsafe -- weights off the GPU (low-VRAM
    offload), DynamicVRAM staging, weight functions (on-the-fly LoRA), already inside a capture --
    and for good once a capture failed.
    Out-of-memory and ComfyUI's interrupt propagate (graphs dropped first on OOM).
    """

    def __init__(self, max_graphs: int = 2):
        self.max_graphs = max_graphs
        self.gf = None
        self.failed = None
        self.last_mode = None  # "graph" | "warm-up" | "eager: <why>"
        self._logged = set()

    def _eager(self, dec, z, why):
        if why not in self._logged:
            self._logged.add(why)
            log.info("[flux_numba] %s: low-resolution CUDA graph off for this decode: %s", NODE_ID, why)
        self.last_mode = "eager: " + why
        return _stage_low(dec, z)

    def drop(self):
        if self.gf is not None:
            from ..flux_core.graphs import drop_graph
            for e in self.gf.graphs.values():
                drop_graph(e.graph)
            self.gf = None

    def __call__(self, dec, z):
        why, wkey = self.failed, None
        if why is None:
            from .host import graph_state
            why, wkey = graph_state(dec, z.device)
            why = "; ".join(why) or None
        if why:
            return self._eager(dec, z, why)
        if self.gf is None:
            from ..flux_core.graphs import GraphedForward
            self.gf = GraphedForward(lambda x: _stage_low(dec, x), warmup=2, max_graphs=self.max_graphs)
        _every_op()  # the interrupt check the replayed ops no longer make
        replays = self.gf.replays
        try:
            out = self.gf(z, weights_key=wkey)
        except Exception as e:
            if _is_oom(e):
                self.drop()
                raise
            if _is_interrupt(e) or registry.strict:
                raise
            self.drop()
            self.failed = f"capture failed ({type(e).__name__}: {str(e)[:200]})"
            return self._eager(dec, z, self.failed)
        self.last_mode = "graph" if self.gf.replays > replays else "warm-up"
        return out


def _nhwc_decode(self, z, kwargs):
    z = z.contiguous(memory_format=CL)
    g = self.__dict__.get("_flux_numba_graph")
    h = g(self, z) if g is not None else _stage_low(self, z, kwargs)
    return _stage_rest(self, h, kwargs).contiguous()


def _decoder_forward(self, z, **kwargs):
    base = type(self).__mro__[1]
    if z.ndim != 4 or self.carried:
        return base.forward(self, z, **kwargs)
    with _backend_ctx(self):
        if _nhwc_why(self, z, kwargs) is None:
            try:
                return _nhwc_decode(self, z, kwargs)
            except Exception as e:  # logged once; this shape then runs the NCHW path
                if registry.strict or _is_oom(e) or _is_interrupt(e):
                    raise
                self.__dict__.setdefault("_flux_numba_nhwc_failed", set()).add(tuple(z.shape))
                log.warning("[flux_numba] %s: NHWC decoder path failed for latent %s (%s: %s); "
                            "that shape runs the NCHW path", NODE_ID, tuple(z.shape), type(e).__name__, e)
        return _decoder_body(self, z, kwargs)


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
    """Return (patched clone of ``decoder``, counts).  ``decoder`` itself is not modified.
    ``cuda_graph`` "auto": the NHWC path replays its low-resolution stage as a CUDA graph
    (``LowResGraph``); "off": always eager."""
    import comfy.ldm.modules.diffusionmodules.model as M

    table = {M.ResnetBlock: _resnet_forward, M.AttnBlock: _attn_forward, M.Decoder: _decoder_forward,
             M.Upsample: _upsample_forward}
    counts = {"ResnetBlock": 0, "AttnBlock": 0, "Decoder": 0, "Upsample": 0}

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
    new.__dict__["_flux_numba_original"] = decoder   # (not a submodule: no state-dict keys)
    new._flux_numba_backend = backend
    new._flux_numba_layout = layout
    new._flux_numba_graph = LowResGraph() if cuda_graph == "auto" else None
    new.__dict__.pop("_flux_numba_nhwc_failed", None)
    return new, counts


def is_patched(decoder) -> bool:
    return type(decoder).__name__.startswith("FluxNumba")


def original_decoder(decoder):
    """The stock decoder behind ``decoder``: ComfyUI applies an object patch in place, so after a
    patched VAE decoded, ``first_stage_model.decoder`` IS our clone until another patcher of that VAE
    loads -- a node re-run then (new widget values, a second patch node on the same VAE) patches the
    original again instead of refusing."""
    while is_patched(decoder) and "_flux_numba_original" in decoder.__dict__:
        decoder = decoder.__dict__["_flux_numba_original"]
    return decoder


def why_not_patchable(vae):
    """None when ``vae`` has a FLUX-style (16-channel, 2-D) ComfyUI Decoder, else the reason."""
    fsm = getattr(vae, "first_stage_model", None)
    dec = original_decoder(getattr(fsm, "decoder", None))
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


def patch_vae(vae, backend: str = "auto", layout: str = "nhwc", cuda_graph: str = "auto"):
    """Clone ``vae`` with the patched decoder as an object patch; returns (vae, info or reason str)."""
    why = why_not_patchable(vae)
    if why:
        return vae, why
    dec, counts = patched_decoder(original_decoder(vae.first_stage_model.decoder), backend, layout, cuda_graph)
    out = copy.copy(vae)
    out.patcher = vae.patcher.clone()
    out.patcher.add_object_patch("decoder", dec)
    g = dec.__dict__.get("_flux_numba_graph")
    if g is not None:
        _drop_on_detach(out.patcher, g)
    return out, counts


def _drop_on_detach(patcher, graph):
    """ComfyUI unloading the VAE frees the low-resolution graphs' memory (``host.drop_on_unload``:
    ``load_models_gpu``'s per-load detach with ``unpatch_all=False`` keeps them)."""
    if not drop_on_unload(patcher, "flux_numba_vae_graph", lambda: graph.drop()):
        log.info("[flux_numba] %s: no detach callback on this host; the low-res graph lives as long as the VAE",
                 NODE_ID)


class FluxNumbaVAEPatch:
    """Decode FLUX latents with fused GroupNorm+SiLU Numba kernels (reversible clone)."""

    CATEGORY = "FluxNumba"
    RETURN_TYPES = ("VAE",)
    RETURN_NAMES = ("vae",)
    FUNCTION = "patch"
    DESCRIPTION = ("Clones the VAE and runs the FLUX VAE decoder NHWC end to end: Numba-CUDA GroupNorm+SiLU, "
                   "upsample, conv bias+residual and attention-softmax kernels between cuDNN's NHWC convolutions "
                   "(no layout conversions). The input VAE is untouched; other VAEs pass through.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "vae": ("VAE",),
                "enabled": ("BOOLEAN", {"default": True}),
                "backend": (list(BACKENDS), {"default": "auto",
                                             "tooltip": "auto: fastest accepted backend; torch: stock math and "
                                                        "layout (A/B)"}),
            },
            "optional": {
                "layout": (list(LAYOUTS), {"default": "nhwc",
                                           "tooltip": "nhwc: the whole bf16 decoder channels_last (cuDNN's NHWC "
                                                      "convolutions, no layout conversions; measured faster); "
                                                      "nchw: stock layout, fused GroupNorm+SiLU only"}),
                "cuda_graph": (list(CUDA_GRAPHS), {"default": "auto",
                                                   "tooltip": "auto: from the third decode of a latent size on, replay "
                                                              "the decoder's low-resolution stage (host-bound when "
                                                              "issued op by op) as a CUDA graph; holds that stage's "
                                                              "activations in VRAM between decodes. Off with "
                                                              "low-VRAM offload / DynamicVRAM (logged). off: eager"}),
            },
        }

    def patch(self, vae, enabled=True, backend="auto", layout="nhwc", cuda_graph="auto"):
        if backend not in BACKENDS:
            raise ValueError(f"{NODE_ID}: backend must be one of {list(BACKENDS)}, got {backend!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"{NODE_ID}: layout must be one of {list(LAYOUTS)}, got {layout!r}")
        if cuda_graph not in CUDA_GRAPHS:
            raise ValueError(f"{NODE_ID}: cuda_graph must be one of {list(CUDA_GRAPHS)}, got {cuda_graph!r}")
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
        out, info = patch_vae(vae, backend, layout, cuda_graph)
        if isinstance(info, str):
            log.info("[flux_numba] %s passes the VAE through unpatched: %s", NODE_ID, info)
            return (vae,)
        log.info("[flux_numba] %s: decoder patched (%d ResnetBlocks, %d AttnBlocks, %d Upsamples, norm_out), "
                 "backend %s, layout %s, cuda_graph %s", NODE_ID, info["ResnetBlock"], info["AttnBlock"],
                 info["Upsample"], backend, layout, cuda_graph)
        return (out,)


NODE_CLASS_MAPPINGS = {NODE_ID: FluxNumbaVAEPatch}
NODE_DISPLAY_NAME_MAPPINGS = {NODE_ID: "FLUX VAE Patch (Numba GroupNorm+SiLU, NHWC)"}
